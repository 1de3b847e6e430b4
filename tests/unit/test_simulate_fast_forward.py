"""The simulator's fast-forward (Replica.fast_forward / catch_up): runs of decode-only steps applied
in one go must leave every replica exactly where stepping one step at a time leaves it."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from iterserve.operator.models import InferenceServiceSpec
from iterserve.replica_model import profile as profiles
from iterserve.replica_model import replica as replica_module
from iterserve.replica_model.replica import fake_model_profile
from iterserve.simulate import traces
from iterserve.simulate.cluster import ClusterSim, Delay, SimOptions
from iterserve.simulate.report import Slo, to_json

SPEC = {  # the whole loop's InferenceService, fake model: 41 KV blocks, so 8 sequences of 96 tokens preempt
    "model": {"uri": "smollm2-135m"},
    "engine": {"maxNumSeqs": 8, "maxModelLen": 512, "kvCacheMemory": "29MiB", "drainSeconds": 4,
               "extraArgs": ["--fake-model", "--max-waiting-requests", "1000"]},
    "replicas": 1,
    "autoscaling": {"mode": "Builtin", "minReplicas": 1, "maxReplicas": 4, "targetWaitingPerReplica": 4,
                    "intervalSeconds": 1, "warmupSeconds": 3, "coldStartSeconds": 120,
                    "scaleDown": {"stabilizationWindowSeconds": 10},
                    "kvRetune": {"threshold": 0.95, "consecutiveSamples": 3, "stepFactor": 0.75, "floor": 4,
                                 "recoveryWindowSeconds": 600}},
}


@pytest.mark.parametrize("name", profiles.PROFILES)
def test_a_run_of_decode_steps_takes_the_same_bits_as_each_step(name):
    profile = fake_model_profile() if name == "fake-model" else profiles.load_profile(name)
    extra = profiles.StepProfile("all-terms", {**profile.coefficients, "padded_context": 3.1e-7, "num_seqs": 1.7e-4,
                                               "multi_token": 0.013, "prefill_attention": 2e-9},
                                 profile.kv_bytes_per_token, memory_floor_s=0.011)
    rng = random.Random(7)
    for p in (profile, extra):
        for _ in range(20):
            n, steps = rng.randint(1, 70), rng.randint(1, 300)
            computed = [rng.randint(1, 4000) for _ in range(n)]
            run = p.decode_steps_seconds(n, sum(computed) + n, max(computed) + 1, steps)
            each = [p.step_seconds(profiles.StepFeatures(0, n, sum(computed) + n * (j + 1), n, max(computed) + 1 + j))
                    for j in range(steps)]
            assert run.tolist() == each
            clock = start = rng.uniform(0, 3600)
            ends = []
            for d in each:  # SimClock.advance, step after step
                clock += d
                ends.append(clock)
            assert np.cumsum(np.concatenate(([start], run))).tolist()[1:] == ends


def _sim(spec_dict, trace, plain, profile=None, **options):
    spec = InferenceServiceSpec.model_validate(spec_dict)
    sim = ClusterSim(spec, profile or fake_model_profile(4.0), trace, SimOptions(plain_loop=plain, **options))
    return sim.run()


def _state(result) -> str:
    """Everything a run leaves behind: the report, and each pod's engine and counters."""
    pods = []
    for pod in result.pods:
        replica = pod.replica
        counters = replica.counters
        pods.append({"name": pod.name, "steps": replica.steps, "engine_steps": replica.engine.num_steps,
                     "executor_steps": replica.engine.executor.steps, "clock": replica.clock.now,
                     "gaps": replica.gaps.tobytes().hex(), "ttft": counters.ttft.counts, "itl": counters.itl.counts,
                     "requests": counters.requests, "tokens": counters.generation_tokens,
                     "free_blocks": replica.engine.block_manager.gpu.free_blocks(),
                     "samples": [repr(s) for s in pod.samples], "gone_at": pod.gone_at})
    return json.dumps({"report": to_json(result, Slo(), {}), "pods": pods}, sort_keys=True)


@pytest.mark.parametrize("router", ["round-robin", "least-load"])
def test_fast_forward_gives_the_same_run_as_stepping_every_step(router):
    # Scale-ups with start-up delays (pods ready out of creation order), KV pressure (preemptions,
    # max_num_seqs retunes), scale-downs (pods draining), and both routers.
    heavy = traces.poisson(20.0, 20, traces.Lengths("fixed", 32), traces.Lengths("fixed", 64), seed=1)
    light = [traces.TraceRequest(20 + i * 0.5, 32, 16 + 12 * (i % 7)) for i in range(40)]
    trickle = [traces.TraceRequest(40 + i, 32, 470) for i in range(10)]  # up to the model length
    late = [traces.TraceRequest(100 + i * 0.25, 32, 400) for i in range(12)]
    runs = [_sim(SPEC, heavy + light + trickle + late, plain, startup=Delay.parse("uniform:3:9"), tail_s=40,
                 router=router) for plain in (True, False)]
    assert _state(runs[0]) == _state(runs[1])
    plain, fast = runs
    ups = [e for e in plain.scale_events if e["to"] > e["from"]]
    downs = [e for e in plain.scale_events if e["to"] < e["from"]]
    assert len(ups) >= (4 if router == "least-load" else 1) and plain.preemptions > 0 and plain.retunes
    assert downs or router == "round-robin"  # with round robin this load keeps all four replicas
    fast_steps = sum(p.replica.fast_steps for p in fast.pods)
    assert fast_steps > fast.steps / 2  # most steps were fast-forwarded
    assert sum(p.replica.fast_steps for p in plain.pods) == 0


def test_fast_forward_with_prefix_caching_and_the_accelerator_profile_matches_stepping(monkeypatch):
    # A real model's engine options (prefix caching on: full blocks are named as they fill), a
    # roofline profile, SLO mode reading the TTFT/ITL histograms, and requests reaching max_model_len.
    spec = {"model": {"uri": "smollm2-135m"}, "replicas": 2,
            "engine": {"maxNumSeqs": 16, "maxModelLen": 384, "kvCacheMemory": "24MiB"},
            "autoscaling": {"mode": "Builtin", "minReplicas": 1, "maxReplicas": 3, "intervalSeconds": 2,
                            "warmupSeconds": 2, "slo": {"ttftP95Ms": 400, "itlP95Ms": 40}}}
    trace = traces.poisson(12.0, 12, traces.Lengths.parse("uniform:16:200"), traces.Lengths.parse("zipf:300"), seed=4)
    profile = profiles.load_profile("modelled-accelerator")
    monkeypatch.setattr(replica_module, "SKIP_PREFIX_CACHE", False)  # name every full block as it fills
    runs = [_sim(spec, trace, plain, profile=profile, startup=Delay.parse(3), tail_s=10) for plain in (True, False)]
    assert _state(runs[0]) == _state(runs[1])
    assert runs[0].pods[0].replica.engine.block_manager.prefix_cache.queries > 0
    assert sum(p.replica.fast_steps for p in runs[1].pods) > runs[1].steps / 2


def test_slo_planning_predicts_the_same_with_fast_forward():
    from iterserve.engine.config import EngineConfig
    from iterserve.replica_model import plan
    from iterserve.replica_model.replica import ServerOptions

    engine = EngineConfig(model="smollm2-135m", max_num_seqs=16, max_model_len=1024, kv_cache_memory="64MiB")
    profile = profiles.load_profile("modelled-accelerator")
    for rate, replicas in ((40.0, 2), (6.0, 1)):
        workload = plan.Workload(rate, 300.0, 120.0)
        args = (engine, ServerOptions(), profile, workload, replicas, 16, 0)
        assert plan._predict(*args, fast=True) == plan._predict(*args, fast=False)
