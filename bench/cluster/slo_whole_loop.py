"""SLO mode against the queue policy tuned for the same TTFT target, and scale to zero, in the local
cluster with the embedded model (e2e/wholeloop/slo.py does the runs).

One local control plane; three runs one after the other, each in its own namespace with its own
operator and pod runtime:

  slo    an InferenceService with spec.autoscaling.slo.ttftP95Ms = --target-ms (step profile
         smollm2-135m-cpu, window 20 s), min 1, max 3 replicas; its fallback (a prediction off
         by more than half the measurement) is the queue policy below.
  queue  the same InferenceService on the waiting-requests signal, targetWaitingPerReplica from
         the same target and profile (queue_target_for(): the queue a replica drains within the
         target's headroom over its light-load p95).
  zero   minReplicas 0, scaleToZeroAfterSeconds 5: served once, idle to zero, then a burst of
         --burst concurrent streaming requests at zero; each request's first-token latency and
         the cold start's parts.

The slo and queue runs get the same client load (loadgen, streaming through the router's Service,
TTFT measured by the client): --light-rate for --before s, --step-rate for --step s, --light-rate
for --after s. Printed and written per policy: p95 TTFT before/during/after the step, the share of
requests whose TTFT met the target, replica-seconds over the load (pods alive, loading ones
included; and ready ones), scale events.

    .venv/bin/python -m bench.cluster.slo_whole_loop --json docs/perf/slo_whole_loop.json \\
        --plot docs/perf/slo_whole_loop.png             # sized for ~12 min (17 at load average 25)
    .venv/bin/python -m bench.cluster.slo_whole_loop --quick                        # ~5 min

Needs `make cluster-tools`. Two cores run the engines, the router, the operator and the control
plane together: a figure measured while other work loads the machine says as much about the
machine as about the policies (the JSON records the load average).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

from bench.common import finish_machine, format_table, machine, pyplot, save_figure, write_json

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # `e2e` as a package

from e2e.wholeloop.slo import (  # noqa: E402
    STEP_PROFILE,
    Load,
    Policy,
    ZeroRun,
    run_policy,
    run_zero,
    summarize,
)
from e2e.wholeloop.timeline import percentile  # noqa: E402


def queue_target_for(target_s: float, load: Load, max_num_seqs: int = 8) -> tuple[int, dict]:
    """targetWaitingPerReplica for the queue policy, from the same target and step profile: a request
    that finds W waiting waits for W slots to free; a replica at a full batch frees one every
    output_tokens x step(max_num_seqs) / max_num_seqs seconds. W is the largest whole queue that fits
    in the target's headroom over the replica's predicted p95 at the light load (what every request
    pays anyway), at least 1."""
    from iterserve.replica_model.plan import Workload, predict
    from iterserve.replica_model.profile import StepFeatures

    settings = _slo_settings(target_s, load, max_num_seqs)
    profile = settings.profile
    context = load.prompt_tokens + load.output_tokens // 2  # a sequence's mean context while it decodes
    full_step = profile.step_seconds(StepFeatures(0, max_num_seqs, max_num_seqs * context, max_num_seqs, context))
    per_slot_s = load.output_tokens * full_step / max_num_seqs
    base = predict(settings.engine, settings.server, profile, Workload(load.light_rate, load.prompt_tokens,
                                                                        load.output_tokens), 1, max_num_seqs)
    waiting = max(1, math.floor((target_s - base.ttft_p95_s) / per_slot_s))
    return waiting, {"full_batch_step_s": round(full_step, 4), "seconds_per_freed_slot": round(per_slot_s, 4),
                     "light_load_predicted_p95_s": round(base.ttft_p95_s, 3), "target_waiting_per_replica": waiting}


def _slo_settings(target_s: float, load: Load, max_num_seqs: int):
    from e2e.wholeloop.slo import Engine, inference_service, policy_autoscaling
    from iterserve.operator.autoscaling.settings import slo_settings
    from iterserve.operator.models import InferenceServiceSpec

    policy = Policy("slo", target_s * 1000, True, max_num_seqs=max_num_seqs)
    spec = InferenceServiceSpec.model_validate(
        inference_service(policy_autoscaling(policy), Engine(), max_num_seqs)["spec"])
    return slo_settings(spec, spec.autoscaling.slo)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="shorter phases (~5 min in all)")
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--plot", metavar="PNG")
    parser.add_argument("--target-ms", type=float, default=1500, help="p95 TTFT target (default 1500)")
    parser.add_argument("--light-rate", type=float, default=0.5)
    parser.add_argument("--step-rate", type=float, default=2.0)
    parser.add_argument("--before", type=float, default=30)
    parser.add_argument("--step", type=float, default=90)
    parser.add_argument("--after", type=float, default=60)
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=12)
    parser.add_argument("--burst", type=int, default=8, help="concurrent streams arriving at zero")
    parser.add_argument("--runs", default="slo,queue,zero", help="which runs, comma-separated (default all)")
    parser.add_argument("--workdir", type=Path, help="cluster, operator and pod logs (default: a temp folder)")
    parser.add_argument("--resummarize", metavar="JSON",
                        help="recompute the summary and the plot from a written result (no run)")
    args = parser.parse_args()
    if args.resummarize:
        return _resummarize(Path(args.resummarize), args.plot)
    runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    unknown = set(runs) - {"slo", "queue", "zero"}
    if unknown:
        parser.error(f"--runs: unknown {sorted(unknown)}; choose from slo, queue, zero")
    if args.quick:
        args.before, args.step, args.after = 20, 60, 40
    load = Load(prompt_tokens=args.prompt_tokens, output_tokens=args.output_tokens, light_rate=args.light_rate,
                step_rate=args.step_rate, before_seconds=args.before, step_seconds=args.step,
                after_seconds=args.after)
    target_s = args.target_ms / 1000
    waiting, how = queue_target_for(target_s, load)
    # SLO mode falls back to the waiting-requests signal when its prediction is off: the same tuned target.
    policies = {"slo": Policy("slo", args.target_ms, True, target_waiting_per_replica=waiting),
                "queue": Policy("queue", args.target_ms, False, target_waiting_per_replica=waiting)}
    info = machine(1)
    from iterserve.devcluster import LocalCluster

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="slo-whole-loop-"))
    print(f"logs under {workdir}; queue policy: targetWaitingPerReplica {waiting} ({how})")
    results, summaries, zero = {}, {}, None
    started = time.monotonic()
    with LocalCluster(workdir / "cluster") as cluster:
        handle = cluster.cluster_handle()
        for name in runs:
            if name == "zero":
                zero = run_zero(handle, workdir / name, ZeroRun(burst=args.burst))
                print(_zero_table(zero))
                continue
            results[name] = run_policy(handle, workdir / name, policies[name], load)
            summaries[name] = summarize(results[name])
            print(_policy_table({name: summaries[name]}))
    info = finish_machine(info)
    print(_policy_table(summaries))
    document = {
        "benchmark": "slo_whole_loop",
        "model": "SmolLM2-135M (embedded), CPU, one torch thread per engine",
        "machine": info, "wall_seconds": round(time.monotonic() - started, 1),
        "target_ms": args.target_ms, "step_profile": STEP_PROFILE, "load": vars(load),
        "queue_target_choice": how,
        "summary": summaries,
        "runs": {name: _slim(result) for name, result in results.items()},
        "scale_to_zero": zero,
        "note": ("Measured on a shared 2-core machine while other work ran (load average in machine): "
                 "provisional; rerun the command on an idle machine."),
    }
    write_json(args.json, document)
    if args.plot and results:
        plot(results, summaries, target_s, args.plot)
    return 0


def _resummarize(path: Path, plot_path: str | None) -> int:
    """Summaries from the runs a result holds (after summarize() learns a figure), written back."""
    document = json.loads(path.read_text())
    results = {name: _unslim(run) for name, run in document["runs"].items()}
    document["summary"] = {name: summarize(result) for name, result in results.items()}
    path.write_text(json.dumps(document, indent=2) + "\n")
    print(_policy_table(document["summary"]))
    if plot_path:
        plot(results, document["summary"], document["target_ms"] / 1000, plot_path)
    return 0


def _slim(result: dict) -> dict:
    """The timeline without per-pod detail (the JSON stays readable); requests as (start, ttft, ok)."""
    origin = result["started_at"]
    rows = [{k: v for k, v in row.items() if k != "pods"} for row in result["timeline"]]
    return {**{k: v for k, v in result.items() if k not in ("timeline", "requests")}, "timeline": rows,
            "requests": [[round(r["start"] - origin, 2), None if r["ttft"] is None else round(r["ttft"], 3), r["ok"],
                          r["status"]] for r in result["requests"]]}


def _unslim(run: dict) -> dict:
    """A run as run_policy returned it, from its slim JSON form (for --resummarize)."""
    origin = run["started_at"]
    requests = [{"start": row[0] + origin, "ttft": row[1], "ok": row[2], "status": row[3] if len(row) > 3 else None}
                for row in run["requests"]]
    return {**run, "requests": requests}


def _policy_table(summaries: dict) -> str:
    rows = []
    for name, s in summaries.items():
        p = s["phases"]
        rows.append([name, *(p.get(ph, {}).get("ttft_p95_s") for ph in ("before", "step", "after")),
                     s["all"]["attainment"], s["replica_seconds"], s["ready_replica_seconds"],
                     s["replica_seconds_to_last_answer"], s["max_replicas"],
                     len(s["scale_events"]), s["failed"]])
    return format_table(["policy", "p95 before s", "p95 step s", "p95 after s", "attainment", "replica-s",
                         "ready replica-s", "replica-s to last answer", "max replicas", "scale events", "failed"],
                        rows)


def _zero_table(zero: dict) -> str:
    ttfts = [r["ttft_s"] for r in zero["burst"] if r["ttft_s"] is not None]
    failed = sum(1 for r in zero["burst"] if not r["ok"])
    parts = zero["cold_start"]["parts_s"]
    lines = [f"scale to zero: at zero {zero['to_zero_after_idle_s']} s after the last request; burst of "
             f"{len(zero['burst'])}: {failed} failed, first token min {min(ttfts, default=None)} s, "
             f"p50 {percentile(ttfts, 0.5)} s, max {max(ttfts, default=None)} s"]
    lines += [f"  {k}: {v}" for k, v in parts.items()]
    return "\n".join(lines)


def plot(results: dict, summaries: dict, target_s: float, path: str) -> None:
    plt = pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    colors = {"slo": "tab:blue", "queue": "tab:orange"}
    for name, result in results.items():
        origin = result["started_at"]
        step_start = result["phases"]["step"][0] - origin
        rows = [r for r in result["timeline"] if "error" not in r]
        t = [r["t"] - step_start for r in rows]
        s = summaries[name]
        label = f"{name}: {s['replica_seconds']:.0f} replica-s, attainment {s['all']['attainment']:.0%}"
        top.step(t, [r["replicas_desired"] for r in rows], where="post", color=colors.get(name), label=f"{label} (desired)")
        top.step(t, [r["replicas_ready"] for r in rows], where="post", color=colors.get(name), linestyle=":",
                 label=f"{name} ready")
        points = sorted((r["start"] - origin - step_start, r["ttft"]) for r in result["requests"] if r["ttft"] is not None)
        window = [percentile([y for x, y in points if a - 10 <= x < a], 0.95) for a, _ in points]
        bottom.plot([x for x, _ in points], window, color=colors.get(name), label=f"{name}: client p95 TTFT (10 s)")
        if name == "slo":
            predicted = [(r["t"] - step_start, r["slo"].get("predictedTtftP95")) for r in rows if r.get("slo")]
            bottom.plot([x for x, y in predicted if y is not None], [y for x, y in predicted if y is not None],
                        color=colors["slo"], linestyle="--", label="slo: status.slo predicted p95")
        end = result["phases"]["step"][1] - origin - step_start
        top.axvspan(0, end, color="grey", alpha=0.08)
        bottom.axvspan(0, end, color="grey", alpha=0.08)
    bottom.axhline(target_s, color="red", linestyle="--", label=f"target {target_s:g} s")
    bottom.set_yscale("log")
    top.set_ylabel("replicas")
    bottom.set_ylabel("TTFT p95 (s, log)")
    bottom.set_xlabel("seconds since the load step began (shaded: the step)")
    top.legend(fontsize=7)
    bottom.legend(fontsize=7)
    top.set_title("SLO mode vs the queue policy tuned for the same target (embedded model, local cluster)")
    save_figure(fig, path)


if __name__ == "__main__":
    raise SystemExit(main())
