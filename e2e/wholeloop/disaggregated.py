"""The whole loop's disaggregated run (`e2e/whole_loop.py --disaggregated`): one InferenceService
with spec.disaggregation.enabled (Router mode), a prefill pool (Deployment NAME-prefill, scaled on
queued prompt tokens per replica) and a decode pool (the engine Deployment, scaled on waiting
requests), and load in phases that load one pool at a time:

- idle: one replica in each pool;
- long: long prompts (over the router's threshold, so prefilled on the prefill pool) with a few
  output tokens: the prefill pool's queue grows and it scales up; the decode pool holds;
- short: short prompts (under the threshold, prefilled where they are decoded) with long outputs:
  the decode pool's queue grows and it scales up; the prefill pool idles and comes back down,
  never up;
- light: a trickle of both until both pools are back at their minimum and nothing terminates.

Engines run --fake-model (the real scheduler, KV pool, KV transfer and metrics, with a modelled
step time): the prefill pods' step time is scaled up so that one prefill replica keeps fewer long
prompts per second than the long phase sends, and the decode pods' so that one decode replica
keeps fewer short requests per second than the short phase sends. The step time is a sleep, so
six engine pods fit on two cores.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from e2e.wholeloop.checks import Check, _same, _t
from e2e.wholeloop.go_on import go_on, ready_at_least
from e2e.wholeloop.plot import plot_clients
from e2e.wholeloop.timeline import RequestLog, Sampler, epoch
from iterserve.devcluster.podrunner import local_runtime_scheduling
from iterserve.engine.loadgen import LoadSpec, run_load

NAME = "chat"
LIGHT_CHUNK_SECONDS = 5
PHASES = ("idle", "long", "short", "light")


@dataclass(frozen=True)
class DisaggregatedScenario:
    disaggregated: bool = True  # tells run() and the JSON which loop this is
    idle_seconds: float = 3
    long_seconds: float = 30  # long prompts at long_rate: the prefill pool's load
    long_rate: float = 1.5
    long_prompt_tokens: int = 2000  # over threshold_tokens: prefilled on the prefill pool
    long_max_tokens: int = 4
    short_seconds: float = 40  # short prompts with long outputs at short_rate: the decode pool's load
    short_rate: float = 5.0
    short_prompt_tokens: int = 32  # under threshold_tokens: prefilled on the decode pod itself
    short_max_tokens: int = 128
    # Each pool's load goes on past its seconds, at most this much more, until that pool has a second
    # Ready replica (a loaded machine starts pods later; e2e/wholeloop/go_on.py).
    answer_wait_seconds: float = 60
    light_rate: float = 0.5  # per kind (long and short) after the load, until both pools are at min
    light_max_tokens: int = 16
    settle_seconds: float = 5  # one light chunk at min replicas
    light_max_seconds: float = 150
    threshold_tokens: int = 512
    # Decode pool (spec.replicas, spec.autoscaling)
    min_replicas: int = 1
    max_replicas: int = 3
    target_waiting_per_replica: float = 4
    max_num_seqs: int = 8
    decode_step_time_scale: float = 4  # one decode replica keeps ~3.5 short requests/s
    # Prefill pool (spec.disaggregation.prefill)
    prefill_min_replicas: int = 1
    prefill_max_replicas: int = 3
    target_queued_prompt_tokens: int = 3000
    prefill_step_time_scale: float = 10  # 0.5 ms per prompt token: one prefill replica keeps ~1 long prompt/s
    scale_down_window_seconds: int = 10
    kv_cache_memory: str = "1GiB"  # ~23k tokens of SmolLM2-135M's fp32 KV (the fake model allocates none of it)
    max_model_len: int = 4096
    drain_seconds: int = 30
    ready_timeout_seconds: float = 180
    seed: int = 0
    real_model: bool = False
    served_model: str = "fake"

    @classmethod
    def quick(cls) -> DisaggregatedScenario:
        return cls()

    @classmethod
    def full(cls) -> DisaggregatedScenario:
        return cls(idle_seconds=10, long_seconds=80, short_seconds=80, scale_down_window_seconds=20,
                   settle_seconds=15, light_max_seconds=240)


def inference_service(scenario: DisaggregatedScenario) -> dict:
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
                "extraArgs": ["--fake-model", "--max-waiting-requests", "1000"],
                "resources": {"limits": {"nvidia.com/gpu": 1}},
            },
            "replicas": scenario.min_replicas,
            "autoscaling": {
                "mode": "Builtin",
                "minReplicas": scenario.min_replicas,
                "maxReplicas": scenario.max_replicas,
                "targetWaitingPerReplica": scenario.target_waiting_per_replica,
                "intervalSeconds": 1,
                "warmupSeconds": 3,
                "coldStartSeconds": 120,
                "scaleDown": {"stabilizationWindowSeconds": scenario.scale_down_window_seconds},
                "kvRetune": {"enabled": False},
            },
            "disaggregation": {
                "enabled": True,
                "thresholdTokens": scenario.threshold_tokens,
                # The router keeps sending long prompts to the prefill pool however long its queue
                # (else it prefills them on the decode pool, and that pool's queue would grow too).
                "maxPrefillQueue": 1000,
                "prefill": {
                    "replicas": scenario.prefill_min_replicas,
                    "minReplicas": scenario.prefill_min_replicas,
                    "maxReplicas": scenario.prefill_max_replicas,
                    "scalingSignal": "QueuedPromptTokens",
                    "targetQueuedPromptTokens": scenario.target_queued_prompt_tokens,
                    "extraArgs": ["--fake-step-time-scale", f"{scenario.prefill_step_time_scale:g}"],
                },
                "decode": {"extraArgs": ["--fake-step-time-scale", f"{scenario.decode_step_time_scale:g}"]},
            },
            "scheduling": local_runtime_scheduling(),
            "routing": {"mode": "Router", "maxQueue": 1000, "queueTimeoutSeconds": 60},
            "podTemplatePatch": {"spec": {"containers": [{
                "name": "engine",
                "startupProbe": {"periodSeconds": 2, "failureThreshold": 60},
                "readinessProbe": {"periodSeconds": 1},
            }]}},
        },
    }


def both_at_min(row: dict, scenario: DisaggregatedScenario) -> bool:
    return (row.get("replicas_desired") == scenario.min_replicas == row.get("pods_live") == row.get("replicas_ready")
            and row.get("pods_terminating") == 0
            and row.get("prefill_desired") == scenario.prefill_min_replicas == row.get("prefill_live")
            == row.get("prefill_ready") and row.get("prefill_terminating") == 0)


async def drive(scenario: DisaggregatedScenario, endpoints, requests: RequestLog, sampler: Sampler, log) -> dict:
    origin = sampler.timeline.started
    phases: dict[str, list] = {}

    def spec(rate: float, seconds: float, prompt: int, max_tokens: int, seed: int) -> LoadSpec:
        return LoadSpec(url="http://127.0.0.1:9", rate=rate, requests=None, duration=seconds, prompt_len=prompt,
                        max_tokens=max_tokens, model=scenario.served_model, seed=seed, timeout=300,
                        endpoints=endpoints, on_result=requests.on_result)

    def begin(phase: str) -> None:
        now = round(time.time() - origin, 2)
        if phases:
            phases[list(phases)[-1]][1] = now
        phases[phase] = [now, None]
        requests.phase = phase

    begin("idle")
    await asyncio.sleep(scenario.idle_seconds)
    begin("long")
    log(f"long prompts: {scenario.long_prompt_tokens} tokens, {scenario.long_max_tokens} out, "
        f"{scenario.long_rate:g} req/s for {scenario.long_seconds:g} s")
    tasks = [asyncio.create_task(run_load(spec(scenario.long_rate, scenario.long_seconds, scenario.long_prompt_tokens,
                                               scenario.long_max_tokens, scenario.seed)))]
    await asyncio.sleep(scenario.long_seconds)
    await _until_ready(sampler, "prefill_ready", phases["long"][0], scenario, tasks, log, lambda seconds, chunk: spec(
        scenario.long_rate, seconds, scenario.long_prompt_tokens, scenario.long_max_tokens, scenario.seed + 100 + chunk))
    begin("short")
    log(f"short prompts: {scenario.short_prompt_tokens} tokens, {scenario.short_max_tokens} out, "
        f"{scenario.short_rate:g} req/s for {scenario.short_seconds:g} s")
    tasks.append(asyncio.create_task(run_load(spec(scenario.short_rate, scenario.short_seconds,
                                                   scenario.short_prompt_tokens, scenario.short_max_tokens,
                                                   scenario.seed + 1))))
    await asyncio.sleep(scenario.short_seconds)
    await _until_ready(sampler, "replicas_ready", phases["short"][0], scenario, tasks, log, lambda seconds, chunk: spec(
        scenario.short_rate, seconds, scenario.short_prompt_tokens, scenario.short_max_tokens,
        scenario.seed + 200 + chunk))
    begin("light")
    log(f"light: {scenario.light_rate:g} req/s of each kind until both pools are back at their minimum "
        f"for {scenario.settle_seconds:g} s")
    deadline = time.monotonic() + scenario.light_max_seconds
    settled_since, chunk = None, 0
    while time.monotonic() < deadline:
        chunk += 1
        await asyncio.gather(
            run_load(spec(scenario.light_rate, LIGHT_CHUNK_SECONDS, scenario.long_prompt_tokens,
                          scenario.long_max_tokens, scenario.seed + 10 * chunk)),
            run_load(spec(scenario.light_rate, LIGHT_CHUNK_SECONDS, scenario.short_prompt_tokens,
                          scenario.light_max_tokens, scenario.seed + 10 * chunk + 1)))
        at_min = both_at_min(sampler.latest or {}, scenario)
        settled_since = (settled_since or time.monotonic()) if at_min else None
        if settled_since is not None and time.monotonic() - settled_since >= scenario.settle_seconds:
            break
    await asyncio.gather(*tasks)
    phases["light"][1] = round(time.time() - origin, 2)
    return phases


async def _until_ready(sampler: Sampler, key: str, since: float, scenario: DisaggregatedScenario,
                       tasks: list[asyncio.Task], log, chunk_spec) -> None:
    """The phase's load goes on until its pool (`key`: prefill_ready, replicas_ready for decode)
    has a second Ready replica, at most answer_wait_seconds more."""
    ready = ready_at_least(sampler, key, 2, since)
    went_on = await go_on(ready, chunk_spec, scenario.answer_wait_seconds, tasks)
    if went_on > 0.05:
        pool = "prefill" if key == "prefill_ready" else "decode"
        log(f"  went on {went_on:.1f} s more, until the {pool} pool had a second Ready replica"
            + ("" if ready() else " (it never did)"))


# ---------------------------------------------------------------------------------------- checks


def _max(rows: list[dict], key: str, start: float, end: float) -> int:
    return max((r.get(key) or 0 for r in rows if start <= r["t"] <= end), default=0)


def _pool_changes(rows: list[dict], prefix: str) -> list[list]:
    keys = ("replicas_desired", "replicas_ready", "pods_terminating") if prefix == "decode" else (
        "prefill_desired", "prefill_ready", "prefill_terminating")
    out, last = [], None
    for row in rows:
        now = tuple(row.get(k) for k in keys)
        if now != last:
            out.append([row["t"], *now])
            last = now
    return out


def evaluate(result: dict) -> tuple[dict, list[Check]]:
    """(the summary of the run's figures, each judgement) for one disaggregated whole-loop run."""
    rows = [r for r in result["timeline"] if "error" not in r and "prefill_desired" in r]
    decisions = result["decisions"]
    failed = [r for r in result["requests"] if not r["ok"]]
    checks = [*_long_phase(result, rows, decisions), *_short_phase(result, rows, decisions),
              *_bounds_checks(result, rows, decisions), *_request_checks(result, failed),
              _decisions_per_pool(result, decisions),
              Check("operator_least_privilege", not result["operator_forbidden"],
                    f"{len(result['operator_forbidden'])} forbidden API calls in the operator log"),
              Check("load_through_the_router", bool(result.get("load_via_router")),
                    result.get("load_address") or "no load address recorded")]
    return _summary(result, rows, decisions, failed), checks


def _changes(decisions: list[dict], action: str, pool: str) -> list[dict]:
    return [d for d in decisions if d["action"] == action and d.get("pool") == pool]


def _when(result: dict, records: list[dict]) -> str:
    return ", ".join(f"{d['fromReplicas']}->{d['toReplicas']} at t={_t(result, d['time']):.0f}s ({d['reason']})"
                     for d in records) or "none"


def _long_phase(result: dict, rows: list[dict], decisions: list[dict]) -> list[Check]:
    """Long prompts: the prefill pool scales up, the decode pool holds."""
    (long_start, _), (short_start, _) = result["phases"]["long"], result["phases"]["short"]
    prefill_ups = _changes(decisions, "ScaleUp", "prefill")
    prefill_ready_long = _max(rows, "prefill_ready", long_start, short_start + 5)
    decode_desired_long = _max(rows, "replicas_desired", long_start, short_start)
    return [Check("prefill_pool_scaled_up_under_long_prompts", prefill_ready_long >= 2
                  and any(long_start <= _t(result, d["time"]) <= short_start + 5 for d in prefill_ups),
                  f"max ready prefill replicas in the long phase: {prefill_ready_long}; prefill scale-ups: "
                  f"{_when(result, prefill_ups)}; queued prompt tokens up to "
                  f"{_max(rows, 'prefill_queued_prompt_tokens', long_start, short_start)}"),
            Check("decode_pool_held_under_long_prompts", decode_desired_long == result["scenario"]["min_replicas"],
                  f"decode desired replicas in the long phase: at most {decode_desired_long}; waiting at most "
                  f"{_max(rows, 'waiting_total', long_start, short_start)}")]


def _short_phase(result: dict, rows: list[dict], decisions: list[dict]) -> list[Check]:
    """Short prompts: the decode pool scales up, the prefill pool never rises."""
    short_start, short_end = result["phases"]["short"]
    decode_ups = _changes(decisions, "ScaleUp", "decode")
    decode_ready_short = _max(rows, "replicas_ready", short_start, short_end + 5)
    prefill_up_in_short = [d for d in _changes(decisions, "ScaleUp", "prefill")
                           if short_start + 2 <= _t(result, d["time"]) <= short_end]
    return [Check("decode_pool_scaled_up_under_short_prompts", decode_ready_short >= 2
                  and any(short_start <= _t(result, d["time"]) <= short_end + 5 for d in decode_ups),
                  f"max ready decode replicas in the short phase: {decode_ready_short}; decode scale-ups: "
                  f"{_when(result, decode_ups)}; waiting up to {_max(rows, 'waiting_total', short_start, short_end)}"),
            Check("prefill_pool_held_under_short_prompts", not prefill_up_in_short,
                  f"prefill scale-ups in the short phase: {_when(result, prefill_up_in_short)}; queued prompt "
                  f"tokens there up to {_max(rows, 'prefill_queued_prompt_tokens', short_start + 5, short_end)}")]


def _bounds_checks(result: dict, rows: list[dict], decisions: list[dict]) -> list[Check]:
    """Both pools back down to their minimum, and within their bounds at all times."""
    scenario, final = result["scenario"], rows[-1] if rows else {}
    prefill_downs, decode_downs = _changes(decisions, "ScaleDown", "prefill"), _changes(decisions, "ScaleDown", "decode")
    over = [r["t"] for r in rows if (r.get("replicas_desired") or 0) > scenario["max_replicas"]
            or (r.get("prefill_desired") or 0) > scenario["prefill_max_replicas"]]
    return [Check("both_pools_back_to_min", both_at_min(final, _Bounds(scenario))
                  and bool(prefill_downs) and bool(decode_downs),
                  f"final: decode desired {final.get('replicas_desired')} ready {final.get('replicas_ready')}, "
                  f"prefill desired {final.get('prefill_desired')} ready {final.get('prefill_ready')}; "
                  f"prefill scale-downs {_when(result, prefill_downs)}; decode scale-downs "
                  f"{_when(result, decode_downs)}"),
            Check("within_each_pools_bounds", not over, f"above a pool's maxReplicas at t={over[:3]}"
                  if over else "every row within both pools' bounds")]


def _request_checks(result: dict, failed: list[dict]) -> list[Check]:
    """Every request answered, none failed; the long prompts went through the prefill pool."""
    requests, pd = result["requests"], result.get("router_pd_decisions") or {}
    statuses = sorted({r["status"] for r in failed})
    return [Check("no_failed_requests", bool(requests) and not failed,
                  f"{len(requests)} requests answered, {len(failed)} failed"
                  + (f" ({', '.join(statuses)})" if failed else "")),
            Check("long_prompts_prefilled_remotely", pd.get("remote", 0) > 0,
                  f"router P/D decisions: {pd or 'not read'}; fallbacks: {result.get('router_pd_fallbacks')}")]


def _decisions_per_pool(result: dict, decisions: list[dict]) -> Check:
    """Every decision is an Event and a scalingHistory record naming its pool."""
    events = [e for e in result["events"] if e["reason"] in ("ScaleUp", "ScaleDown")]
    unmatched_events = [e for e in events if not any(_same(e, d) for d in decisions)]
    unmatched_records = [d for d in decisions if not any(_same(e, d) for e in events)]
    poolless = [d for d in decisions if d.get("pool") not in ("prefill", "decode")]
    # An Event has no field for the pool: its message must name it for whoever reads the Events.
    unnamed = [e for e in events if not e["message"].startswith(("prefill pool:", "decode pool:"))]
    return Check("decisions_are_events_and_history_per_pool",
                 bool(decisions) and not (unmatched_events or unmatched_records or poolless or unnamed),
                 f"{len(decisions)} records, {len(events)} Events; unmatched Events "
                 f"{[e['message'][:80] for e in unmatched_events]}, unmatched records "
                 f"{[d['message'][:80] for d in unmatched_records]}, records without a pool {len(poolless)}, "
                 f"Events not naming the pool {len(unnamed)}")


def _summary(result: dict, rows: list[dict], decisions: list[dict], failed: list[dict]) -> dict:
    (long_start, _), (short_start, short_end) = result["phases"]["long"], result["phases"]["short"]
    light_end, requests = result["phases"]["light"][1], result["requests"]
    final = rows[-1] if rows else {}

    def ttft_p95(phase: str) -> float | None:
        start, end = result["phases"][phase]
        values = sorted(r["ttft"] for r in requests if r["ttft"] is not None
                        and start <= r["start"] - result["started_at"] <= end)
        return round(values[int(0.95 * (len(values) - 1))], 3) if values else None

    return {
        "model": result["model"],
        "wall_seconds": result["wall_seconds"],
        "requests": len(requests),
        "failed_requests": len(failed),
        "max_ready_prefill_replicas": _max(rows, "prefill_ready", 0, light_end),
        "max_ready_decode_replicas": _max(rows, "replicas_ready", 0, light_end),
        "final_prefill_replicas": final.get("prefill_ready"),
        "final_decode_replicas": final.get("replicas_ready"),
        "max_queued_prompt_tokens_long_phase": _max(rows, "prefill_queued_prompt_tokens", long_start, short_start),
        "max_decode_waiting_short_phase": _max(rows, "waiting_total", short_start, short_end),
        "ttft_p95_s": {phase: ttft_p95(phase) for phase in ("long", "short")},
        "router_pd_decisions": result.get("router_pd_decisions") or {},
        "decisions": [f"t={_t(result, d['time']):.0f}s {d.get('pool')} {d['action']} "
                      f"{d['fromReplicas']}->{d['toReplicas']} ({d['reason']})" for d in decisions],
        "prefill_over_time": _pool_changes(rows, "prefill"),  # [t, desired, ready, terminating] at each change
        "decode_over_time": _pool_changes(rows, "decode"),
        "phases": result["phases"],
    }


class _Bounds:
    """The scenario's bounds from its JSON form, as both_at_min reads them."""

    def __init__(self, scenario: dict):
        self.min_replicas = scenario["min_replicas"]
        self.prefill_min_replicas = scenario["prefill_min_replicas"]


# ------------------------------------------------------------------------------------------ plot

PHASE_COLOURS = {"idle": "#f2f2f2", "long": "#fde0dd", "short": "#deebf7", "light": "#e5f5e0"}


def plot(result: dict, summary: dict, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scenario = result["scenario"]
    rows = [r for r in result["timeline"] if "error" not in r and "prefill_desired" in r]
    t = [r["t"] for r in rows]
    fig, axes = plt.subplots(4, 1, figsize=(12, 11), sharex=True)
    prefill, decode, signals, clients = axes
    prefill.step(t, [r["prefill_desired"] for r in rows], where="post", lw=2,
                 label="desired (spec.disaggregation.prefill.replicas)")
    prefill.step(t, [r["prefill_ready"] for r in rows], where="post", lw=2, label="ready")
    prefill.step(t, [r["prefill_terminating"] for r in rows], where="post", ls=":", label="terminating")
    prefill.set_ylabel("prefill pool\nreplicas")
    prefill.set_ylim(-0.2, scenario["prefill_max_replicas"] + 0.8)
    decode.step(t, [r["replicas_desired"] for r in rows], where="post", lw=2, label="desired (spec.replicas)")
    decode.step(t, [r["replicas_ready"] for r in rows], where="post", lw=2, label="ready")
    decode.step(t, [r["pods_terminating"] for r in rows], where="post", ls=":", label="terminating")
    decode.set_ylabel("decode pool\nreplicas")
    decode.set_ylim(-0.2, scenario["max_replicas"] + 0.8)

    signals.plot(t, [r["prefill_queued_prompt_tokens"] for r in rows], color="tab:red",
                 label="prefill pool: queued prompt tokens (sum)")
    signals.plot(t, [r["prefill_signal_value"] for r in rows], color="tab:red", ls="--",
                 label="prefill pool: per replica, as the operator read it")
    signals.axhline(scenario["target_queued_prompt_tokens"], color="tab:red", lw=0.8, ls=":",
                    label="targetQueuedPromptTokens")
    signals.set_ylabel("queued prompt\ntokens")
    waiting = signals.twinx()
    waiting.plot(t, [r["waiting_total"] for r in rows], color="tab:blue", label="decode pool: waiting requests")
    waiting.axhline(scenario["target_waiting_per_replica"], color="tab:blue", lw=0.8, ls=":")
    waiting.set_ylabel("decode waiting", color="tab:blue")
    waiting.legend(loc="upper left", fontsize=7)

    plot_clients(clients, t, rows)

    for ax in axes:
        for phase, (start, end) in result["phases"].items():
            ax.axvspan(start, end, color=PHASE_COLOURS.get(phase, "white"), zorder=0)
        ax.grid(alpha=0.3)
        ax.legend(loc="upper right", fontsize=7, ncol=2)
    for record in result["decisions"]:
        ax = prefill if record.get("pool") == "prefill" else decode
        at = epoch(record["time"]) - result["started_at"]
        colour = "tab:red" if record["action"] == "ScaleUp" else "tab:green"
        ax.axvline(at, color=colour, lw=1, alpha=0.7)
        ax.annotate(f"{record['fromReplicas']}→{record['toReplicas']}", (at, ax.get_ylim()[1] - 0.3), rotation=90,
                    fontsize=7, va="top", color=colour)
    fig.suptitle(f"iterserve whole loop, disaggregated — fake model, wall {summary['wall_seconds']:.0f} s, "
                 f"max ready prefill {summary['max_ready_prefill_replicas']} / decode "
                 f"{summary['max_ready_decode_replicas']}, {summary['requests']} requests, "
                 f"failed {summary['failed_requests']}\nphases: idle (grey), long prompts (red), short prompts with "
                 "long outputs (blue), light (green); lines: scale-up (red), scale-down (green)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
