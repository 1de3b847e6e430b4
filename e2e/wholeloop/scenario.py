"""What the whole-loop run does: the InferenceService it applies and the load phases it drives.

The KV pool is sized so that the spec's max_num_seqs thrashes it: a request is a 32-token prompt
and 128 generated tokens, 10 blocks of 16 at its end, and the pool holds 41 blocks. At
max_num_seqs 8 the running sequences ask for up to 80 blocks (usage pinned near 1, preemption
after preemption); the KV retune's steps 8 -> 6 -> 4 end at 40 blocks, where nothing is preempted.

Scenario.real_model() is the same loop with the embedded SmolLM2-135M (no --fake-model), shrunk to
what one torch thread per engine serves on a shared CPU core (~40 tokens/s, ~2 short requests/s):
a 12-token prompt and 16 generated tokens, 2 blocks each, in a pool of 9 blocks. At
max_num_seqs 8 the running sequences ask for 16 blocks; the steps 8 -> 6 -> 4 end at 8.
"""

from __future__ import annotations

from dataclasses import dataclass

from iterserve.devcluster.podrunner import local_runtime_scheduling
from iterserve.engine.config import DEFAULT_MODEL

NAME = "chat"
PROMPT_TOKENS = 32
OUTPUT_TOKENS = 128


@dataclass(frozen=True)
class Scenario:
    idle_seconds: float = 10  # before the load: one replica, nothing to do
    heavy_seconds: float = 75  # Poisson arrivals at heavy_rate
    heavy_rate: float = 8.0  # requests/s: one replica keeps ~4/s, three keep up
    # The heavy load goes on past heavy_seconds, at most this much more, until a second replica is
    # Ready and the first retuned pod has run a whole measured window after its last retune (a
    # loaded machine starts pods and retunes later; e2e/wholeloop/go_on.py).
    answer_wait_seconds: float = 60
    light_rate: float = 1.0  # requests/s after the heavy phase, through the scale-down and its drain
    light_max_tokens: int = 64
    settle_seconds: float = 8  # back at min replicas this long, with nothing terminating, ends the run
    light_max_seconds: float = 150  # give up waiting for the scale-down after this
    min_replicas: int = 1
    max_replicas: int = 3
    max_num_seqs: int = 8
    kv_floor: int = 4
    target_waiting_per_replica: float = 4
    scale_down_window_seconds: int = 10
    seed: int = 0
    real_model: bool = False  # the embedded SmolLM2-135M instead of --fake-model
    prompt_tokens: int = PROMPT_TOKENS
    output_tokens: int = OUTPUT_TOKENS
    kv_cache_memory: str = "29MiB"  # 41 blocks x 16 tokens of SmolLM2-135M's KV
    max_model_len: int = 512
    drain_seconds: int = 30
    ready_timeout_seconds: float = 180  # for the first replica
    autoscaling_mode: str = "Builtin"  # External: an HPA scales it (e2e/autoscaling_modes.py)

    @property
    def served_model(self) -> str:
        return DEFAULT_MODEL if self.real_model else "fake"

    @classmethod
    def quick(cls) -> Scenario:
        # The CI run. The KV retune's last step comes ~8 s into the load (scale-ups at +0 and +13 s,
        # docs/perf/whole_loop_alerts.json); the preemption rate after it is measured from that
        # step +8 s for up to 40 s and needs at least 10 s of load: 50 s of load leave a retune
        # as late as +32 s room (later, the load goes on: answer_wait_seconds). Nothing is checked in the idle phase, and at min replicas one
        # light chunk (5 s) of load is enough to see that the scale-down has settled.
        return cls(heavy_seconds=50, idle_seconds=3, settle_seconds=5)

    @classmethod
    def real(cls, quick: bool = False) -> Scenario:
        """The embedded model on CPU: light enough load that a request finishes in seconds, so the
        heavy phase's backlog clears and a draining pod's requests end inside drainSeconds."""
        return cls(real_model=True, prompt_tokens=12, output_tokens=16, light_max_tokens=8,
                   kv_cache_memory="6.5MiB",  # 9 blocks x 16 tokens of SmolLM2-135M's float32 KV
                   max_model_len=128, heavy_rate=2.5, light_rate=0.25, drain_seconds=60,
                   idle_seconds=10 if quick else 20, heavy_seconds=60 if quick else 120,
                   scale_down_window_seconds=10 if quick else 20, settle_seconds=8 if quick else 20,
                   light_max_seconds=360, ready_timeout_seconds=300)

    @classmethod
    def full(cls) -> Scenario:
        return cls(idle_seconds=20, heavy_seconds=150, scale_down_window_seconds=20, settle_seconds=20,
                   light_max_seconds=240)


def inference_service(scenario: Scenario) -> dict:
    # --fake-model: the real scheduler and KV pool, modelled step time (see e2e/whole_loop.py).
    engine_args = ([] if scenario.real_model else ["--fake-model"]) + ["--max-waiting-requests", "1000"]
    return {
        "apiVersion": "iterserve.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": NAME},
        "spec": {
            "model": {"uri": "smollm2-135m"},
            "engine": {
                "maxNumSeqs": scenario.max_num_seqs,
                "maxModelLen": scenario.max_model_len,
                "kvCacheMemory": scenario.kv_cache_memory,
                "drainSeconds": scenario.drain_seconds,
                "startupSeconds": 120,
                "extraArgs": engine_args,
                "resources": {"limits": {"nvidia.com/gpu": 1}},
            },
            "replicas": scenario.min_replicas,
            "autoscaling": {
                "mode": scenario.autoscaling_mode,
                "minReplicas": scenario.min_replicas,
                "maxReplicas": scenario.max_replicas,
                "targetWaitingPerReplica": scenario.target_waiting_per_replica,
                "intervalSeconds": 1,
                "warmupSeconds": 3,
                "coldStartSeconds": 120,
                "scaleDown": {"stabilizationWindowSeconds": scenario.scale_down_window_seconds},
                "kvRetune": {"threshold": 0.95, "consecutiveSamples": 3, "stepFactor": 0.75,
                             "floor": scenario.kv_floor, "recoveryWindowSeconds": 600},
            },
            "scheduling": local_runtime_scheduling(),  # the router pod lands there too
            # The load goes through the router's Service; the engines queue (that is what the
            # autoscaler scales on), so the router lets them, as their --max-waiting-requests does.
            "routing": {"mode": "Router", "maxQueue": 1000, "queueTimeoutSeconds": 60},
            # Probe every second or two rather than every 5-10 s, so a short run sees pods come and go.
            "podTemplatePatch": {"spec": {"containers": [{
                "name": "engine",
                "startupProbe": {"periodSeconds": 2, "failureThreshold": 60},
                "readinessProbe": {"periodSeconds": 1},
            }]}},
        },
    }
