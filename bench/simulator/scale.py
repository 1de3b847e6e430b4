"""How the simulator scales to a large fleet: N replicas (autoscaling off, spec.replicas N) on a
Poisson trace at a fleet-wide rate, timed on the process's CPU clock (and the wall clock), with
the CPU time at every simulated minute recorded and plotted. The target: 1,000 replicas, a
one-hour trace of 1M requests (277.8 req/s), in under 10 minutes on this machine. By default
both routers run, one after the other in one process on the same trace: round-robin (a
Service) and least-load (the iterserve router's pick, what spec.routing.mode Router deploys).

The run is real unless --seconds is shorter than the hour; then the CPU time is also projected
to the target (linear in simulated seconds at the same rate and fleet). --cprofile profiles the
run (cProfile roughly doubles its CPU time, so the timed run goes without) and prints where the
time goes; --plain-loop runs the reference loop that steps every engine step.

    .venv/bin/python -m bench.simulator.scale --json docs/perf/sim/scale.json --plot docs/perf/sim/scale.png
    .venv/bin/python -m bench.simulator.scale --replicas 200 --seconds 60 --router least-load --cprofile
    .venv/bin/python -m bench.simulator.scale --quick        # 100 replicas, 60 s at the same per-replica rate
"""

from __future__ import annotations

import argparse
import collections
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
    parser.add_argument("--router", default="both", choices=["both", "round-robin", "least-load"])
    parser.add_argument("--plain-loop", action="store_true", help="step every engine step (the reference loop)")
    parser.add_argument("--scan-routing", action="store_true",
                        help="least-load: build every pod's load and call pick() on each arrival (the reference)")
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

    spec = InferenceServiceSpec.model_validate({
        "model": {"uri": "smollm2-135m"}, "replicas": args.replicas,
        "engine": {"maxNumSeqs": 64, "kvCacheMemory": "2GiB", "maxModelLen": 2048}})
    trace = traces.poisson(rate, args.seconds, traces.Lengths.parse(PROMPTS), traces.Lengths.parse(OUTPUTS), seed=SEED)
    profile = load_profile(args.profile)
    real = args.replicas == TARGET_REPLICAS and args.seconds >= TARGET_SECONDS and len(trace) >= 0.99 * TARGET_REQUESTS
    routers = ["round-robin", "least-load"] if args.router == "both" else [args.router]
    load_before = os.getloadavg()
    runs = [run_one(spec, profile, trace, router, args, real) for router in routers]
    load_after = os.getloadavg()
    print(f"load average {load_before[0]:.1f} -> {load_after[0]:.1f} on {os.cpu_count()} CPUs")
    document = {"benchmark": "sim_scale", "quick": args.quick, "profile": profile.name,
                "load_average": [load_before, load_after], "cpus": os.cpu_count(),
                "replicas": args.replicas, "rate_req_s": rate, "simulated_trace_s": args.seconds,
                "trace": {"kind": "poisson", "prompt_tokens": PROMPTS, "output_tokens": OUTPUTS, "seed": SEED,
                          "requests": len(trace), "output_tokens_total": sum(r.output_tokens for r in trace)},
                "real_target_run": real,
                "target": {"replicas": TARGET_REPLICAS, "requests": TARGET_REQUESTS, "seconds": TARGET_SECONDS,
                           "cpu_s": TARGET_WALL_S},
                "runs": runs}
    if len(runs) == 2:
        document["least_load_cpu_over_round_robin"] = round(runs[1]["cpu_s"] / max(runs[0]["cpu_s"], 1e-9), 3)
        print(f"least-load / round-robin CPU: {document['least_load_cpu_over_round_robin']:.2f}x")
    common.write_json(args.json, document)
    if args.plot:
        plot(document, args.plot)
    return 0


def run_one(spec, profile, trace, router: str, args, real: bool) -> dict:
    """One timed run of the fleet behind `router`: its figures, as a row of the JSON."""
    import gc

    from iterserve.simulate.cluster import ClusterSim, SimOptions
    from iterserve.simulate.report import percentile

    progress: list[tuple[float, float, float]] = []  # (simulated s, CPU s, wall s) at each simulated minute
    gc.collect()
    cpu_started, wall_started = time.process_time(), time.perf_counter()
    next_mark = [60.0]

    def mark(now: float) -> None:
        if now >= next_mark[0]:
            progress.append((next_mark[0], round(time.process_time() - cpu_started, 2),
                             round(time.perf_counter() - wall_started, 2)))
            next_mark[0] += 60.0

    profiler = cProfile.Profile() if args.cprofile else None
    sim = ClusterSim(spec, profile, trace, SimOptions(router=router, plain_loop=args.plain_loop,
                                                             scan_routing=args.scan_routing), progress=mark)
    if profiler is not None:
        profiler.enable()
    result = sim.run()
    if profiler is not None:
        profiler.disable()
    cpu, wall = time.process_time() - cpu_started, time.perf_counter() - wall_started

    finished = [r for r in result.requests if r.status == "ok"]
    fast_steps = sum(p.replica.fast_steps for p in result.pods)
    scale = TARGET_SECONDS / args.seconds * TARGET_REPLICAS / args.replicas
    projected_cpu = cpu * scale
    ttfts = [r.first_token - r.arrival for r in finished]
    row = {"router": router, "plain_loop": args.plain_loop, "scan_routing": args.scan_routing, "cprofile": args.cprofile,
           "finished": len(finished), "generated_tokens": sum(r.tokens for r in result.requests),
           "statuses": dict(collections.Counter(r.status for r in result.requests)),
           "steps": result.steps, "fast_forwarded_steps": fast_steps, "engine_steps_run": result.steps - fast_steps,
           "simulated_s": round(result.end, 3),
           "ttft_s": {"p50": percentile(ttfts, 50), "p95": percentile(ttfts, 95)},
           "cpu_s": round(cpu, 2), "wall_s": round(wall, 2),
           "max_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
           "us_cpu_per_step": round(1e6 * cpu / max(1, result.steps), 3),
           "projected_cpu_s_for_target": None if real else round(projected_cpu, 0),
           "meets_target_cpu": projected_cpu <= TARGET_WALL_S, "meets_target_wall": wall * scale <= TARGET_WALL_S,
           "cpu_by_simulated_minute": progress}
    if profiler is not None:
        row["share_of_cpu"] = where_the_time_goes(profiler)
    del sim, result
    print(f"{args.replicas} replicas, {len(trace):,} requests over {args.seconds:g} s ({len(trace) / args.seconds:.1f} "
          f"req/s, profile {profile.name}, router {router}{', plain loop' if args.plain_loop else ''}"
          f"{', scan routing' if args.scan_routing else ''}): "
          f"{row['steps']:,} engine steps ({fast_steps:,} fast-forwarded) in {cpu:.1f} s CPU ({wall:.1f} s wall), "
          f"{row['us_cpu_per_step']:.2f} us CPU per step, p95 TTFT {row['ttft_s']['p95']:.3f} s, "
          f"max RSS {row['max_rss_mib']} MiB", flush=True)
    if real:
        print(f"  the target itself: {cpu:,.0f} s CPU, {wall:,.0f} s wall against {TARGET_WALL_S:.0f} s: "
              f"CPU {'met' if row['meets_target_cpu'] else 'MISSED'}, wall {'met' if row['meets_target_wall'] else 'MISSED'}")
    else:
        print(f"  projected to {TARGET_REPLICAS} replicas x {TARGET_SECONDS:.0f} s ({TARGET_REQUESTS:,} requests): "
              f"{projected_cpu:,.0f} s CPU against the {TARGET_WALL_S:.0f} s target: "
              f"{'met' if row['meets_target_cpu'] else 'MISSED'}")
    if profiler is not None:
        print("  share of the run's CPU (cumulative, functions over 2%):")
        for name, share in row["share_of_cpu"].items():
            print(f"    {share:6.1%}  {name}")
    return row


def plot(document: dict, path: str) -> None:
    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for run, color in zip(document["runs"], ("tab:blue", "tab:green"), strict=False):
        marks = run["cpu_by_simulated_minute"]
        ax.plot([m[0] for m in marks], [m[1] for m in marks], lw=2, color=color,
                label=f"{run['router']}: CPU s ({run['cpu_s']:.0f} s)")
        ax.plot([m[0] for m in marks], [m[2] for m in marks], lw=1, ls="--", color=color,
                label=f"{run['router']}: wall s, shared machine ({run['wall_s']:.0f} s)")
    ax.axhline(TARGET_WALL_S, color="tab:red", lw=1, label="target: 600 s")
    ax.set_xlabel("simulated seconds")
    ax.set_ylabel("seconds of the simulator")
    first = document["runs"][0]
    ax.set_title(f"{document['replicas']} replicas, {document['trace']['requests']:,} requests\n{first['steps']:,} "
                 f"engine steps, {first['fast_forwarded_steps'] / max(1, first['steps']):.1%} fast-forwarded", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    common.save_figure(fig, path)


if __name__ == "__main__":
    raise SystemExit(main())
