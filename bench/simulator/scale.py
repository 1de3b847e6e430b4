"""How the simulator scales to a large fleet: N replicas (autoscaling off, spec.replicas N) on a
Poisson trace at a fleet-wide rate, timed on the process's CPU clock (and the wall clock), with
the CPU time at every simulated minute recorded and plotted. The target: 1,000 replicas, a
one-hour trace of 1M requests (277.8 req/s), in under 10 minutes on this machine.

The run is real unless --seconds is shorter than the hour; then the CPU time is also projected
to the target (linear in simulated seconds at the same rate and fleet). --cprofile profiles the
run (cProfile roughly doubles its CPU time, so the timed run goes without) and prints where the
time goes; --plain-loop runs the reference loop that steps every engine step.

    .venv/bin/python -m bench.simulator.scale --json docs/perf/sim/scale.json --plot docs/perf/sim/scale.png
    .venv/bin/python -m bench.simulator.scale --replicas 100 --seconds 120 --cprofile    # where the time goes
    .venv/bin/python -m bench.simulator.scale --quick        # 100 replicas, 60 s at the same per-replica rate
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import resource
import time

from bench import common

TARGET_REPLICAS, TARGET_REQUESTS, TARGET_SECONDS, TARGET_WALL_S = 1000, 1_000_000, 3600.0, 600.0
PROMPTS, OUTPUTS, SEED = "uniform:64:1024", "zipf:512", 3


def where_the_time_goes(profiler: cProfile.Profile) -> dict[str, float]:
    """Cumulative share of the run's CPU per function of the simulator or the engine (over 2%)."""
    stats = pstats.Stats(profiler, stream=io.StringIO())
    total = sum(v[3] for k, v in stats.stats.items() if k[2] == "run" and k[0].endswith("cluster.py"))
    where = {}
    for (path, _, function), (_, _, _own, cumulative, _) in stats.stats.items():
        short = f"{os.path.basename(path)}:{function}"
        if any(part in path for part in ("iterserve", "engine")) and cumulative > 0.02 * total:
            where[short] = round(cumulative / total, 3)
    return dict(sorted(where.items(), key=lambda kv: -kv[1])[:20])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=TARGET_REPLICAS)
    parser.add_argument("--seconds", type=float, default=TARGET_SECONDS, help="simulated seconds of trace")
    parser.add_argument("--rate", type=float, help="fleet-wide req/s (default: the target's per-replica rate x replicas)")
    parser.add_argument("--profile", default="modelled-accelerator")
    parser.add_argument("--router", default="round-robin", choices=["round-robin", "least-load"])
    parser.add_argument("--plain-loop", action="store_true", help="step every engine step (the reference loop)")
    parser.add_argument("--cprofile", action="store_true", help="profile the run and print where the time goes")
    parser.add_argument("--quick", action="store_true", help="100 replicas, 60 simulated seconds")
    parser.add_argument("--json")
    parser.add_argument("--plot")
    args = parser.parse_args()
    if args.quick:
        args.replicas, args.seconds = 100, 60.0
    rate = args.rate or TARGET_REQUESTS / TARGET_SECONDS * args.replicas / TARGET_REPLICAS

    from iterserve.operator.models import InferenceServiceSpec
    from iterserve.replica_model.profile import load_profile
    from iterserve.simulate import traces
    from iterserve.simulate.cluster import ClusterSim, SimOptions
    from iterserve.simulate.report import percentile

    spec = InferenceServiceSpec.model_validate({
        "model": {"uri": "smollm2-135m"}, "replicas": args.replicas,
        "engine": {"maxNumSeqs": 64, "kvCacheMemory": "2GiB", "maxModelLen": 2048}})
    trace = traces.poisson(rate, args.seconds, traces.Lengths.parse(PROMPTS), traces.Lengths.parse(OUTPUTS), seed=SEED)
    profile = load_profile(args.profile)
    progress: list[tuple[float, float, float]] = []  # (simulated s, CPU s, wall s) at each simulated minute
    cpu_started, wall_started = time.process_time(), time.perf_counter()
    next_mark = [60.0]

    def mark(now: float) -> None:
        if now >= next_mark[0]:
            progress.append((next_mark[0], round(time.process_time() - cpu_started, 2),
                             round(time.perf_counter() - wall_started, 2)))
            next_mark[0] += 60.0

    load_before = os.getloadavg()
    profiler = cProfile.Profile() if args.cprofile else None
    sim = ClusterSim(spec, profile, trace, SimOptions(router=args.router, plain_loop=args.plain_loop), progress=mark)
    if profiler is not None:
        profiler.enable()
    result = sim.run()
    if profiler is not None:
        profiler.disable()
    cpu, wall = time.process_time() - cpu_started, time.perf_counter() - wall_started
    load_after = os.getloadavg()

    finished = [r for r in result.requests if r.status == "ok"]
    fast_steps = sum(p.replica.fast_steps for p in result.pods)
    scale = TARGET_SECONDS / args.seconds * TARGET_REPLICAS / args.replicas
    projected_cpu = cpu * scale
    real = args.replicas == TARGET_REPLICAS and args.seconds >= TARGET_SECONDS and len(trace) >= 0.99 * TARGET_REQUESTS
    ttfts = [r.first_token - r.arrival for r in finished]
    row = {"replicas": args.replicas, "rate_req_s": rate, "simulated_trace_s": args.seconds,
           "trace": {"kind": "poisson", "prompt_tokens": PROMPTS, "output_tokens": OUTPUTS, "seed": SEED,
                     "requests": len(trace), "output_tokens_total": sum(r.output_tokens for r in trace)},
           "plain_loop": args.plain_loop, "cprofile": args.cprofile,
           "finished": len(finished), "generated_tokens": sum(r.tokens for r in result.requests),
           "steps": result.steps, "fast_forwarded_steps": fast_steps, "engine_steps_run": result.steps - fast_steps,
           "simulated_s": round(result.end, 3),
           "ttft_s": {"p50": percentile(ttfts, 50), "p95": percentile(ttfts, 95)},
           "cpu_s": round(cpu, 2), "wall_s": round(wall, 2),
           "max_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
           "us_cpu_per_step": round(1e6 * cpu / max(1, result.steps), 3),
           "real_target_run": real,
           "projected_cpu_s_for_target": None if real else round(projected_cpu, 0),
           "target": {"replicas": TARGET_REPLICAS, "requests": TARGET_REQUESTS, "seconds": TARGET_SECONDS,
                      "cpu_s": TARGET_WALL_S},
           "meets_target_cpu": projected_cpu <= TARGET_WALL_S, "meets_target_wall": wall * scale <= TARGET_WALL_S,
           "cpu_by_simulated_minute": progress}
    if profiler is not None:
        row["share_of_cpu"] = where_the_time_goes(profiler)
    print(f"{args.replicas} replicas, {len(trace):,} requests over {args.seconds:g} s ({rate:.1f} req/s, "
          f"profile {profile.name}, router {args.router}{', plain loop' if args.plain_loop else ''}): "
          f"{result.steps:,} engine steps ({fast_steps:,} fast-forwarded) in {cpu:.1f} s CPU ({wall:.1f} s wall), "
          f"{row['us_cpu_per_step']:.2f} us CPU per step, max RSS {row['max_rss_mib']} MiB")
    if real:
        print(f"the target itself: {cpu:,.0f} s CPU, {wall:,.0f} s wall against {TARGET_WALL_S:.0f} s: "
              f"CPU {'met' if row['meets_target_cpu'] else 'MISSED'}, wall {'met' if row['meets_target_wall'] else 'MISSED'}")
    else:
        print(f"projected to {TARGET_REPLICAS} replicas x {TARGET_SECONDS:.0f} s ({TARGET_REQUESTS:,} requests): "
              f"{projected_cpu:,.0f} s CPU against the {TARGET_WALL_S:.0f} s target: "
              f"{'met' if row['meets_target_cpu'] else 'MISSED'}")
    if profiler is not None:
        print("share of the run's CPU (cumulative, functions over 2%):")
        for name, share in row["share_of_cpu"].items():
            print(f"  {share:6.1%}  {name}")
    print(f"load average {load_before[0]:.1f} -> {load_after[0]:.1f} on {os.cpu_count()} CPUs")
    common.write_json(args.json, {"benchmark": "sim_scale", "quick": args.quick, "profile": profile.name,
                                  "router": args.router, "load_average": [load_before, load_after],
                                  "cpus": os.cpu_count(), **row})
    if args.plot:
        plot(row, args.plot)
    return 0


def plot(row: dict, path: str) -> None:
    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    marks = row["cpu_by_simulated_minute"]
    ax.plot([m[0] for m in marks], [m[1] for m in marks], lw=2, label="CPU seconds (process)")
    ax.plot([m[0] for m in marks], [m[2] for m in marks], lw=1, ls="--", label="wall seconds (shared machine)")
    ax.axhline(TARGET_WALL_S, color="tab:red", lw=1, label="target: 600 s")
    ax.set_xlabel("simulated seconds")
    ax.set_ylabel("seconds of the simulator")
    ax.set_title(f"{row['replicas']} replicas, {row['trace']['requests']:,} requests: {row['cpu_s']:.0f} s CPU, "
                 f"{row['wall_s']:.0f} s wall\n{row['steps']:,} engine steps, "
                 f"{row['fast_forwarded_steps'] / max(1, row['steps']):.1%} fast-forwarded", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    common.save_figure(fig, path)


if __name__ == "__main__":
    raise SystemExit(main())
