"""How the simulator scales to a large fleet: N replicas (autoscaling off, spec.replicas N) on a
Poisson trace at a fleet-wide rate, timed on the process's CPU clock and profiled (cProfile),
with the wall time projected to the target: 1,000 replicas, a one-hour trace of 1M requests
(277.8 req/s), in under 10 minutes on this machine. The projection is linear in simulated
seconds at the same rate and fleet (the work per simulated second is steady once the replicas are
busy). Prints where the time goes and writes JSON.

    .venv/bin/python -m bench.simulator.scale --replicas 1000 --seconds 20 --json docs/perf/sim/scale.json
    .venv/bin/python -m bench.simulator.scale --quick        # 100 replicas, 10 s at the same per-replica rate
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import time

from bench import common

TARGET_REPLICAS, TARGET_REQUESTS, TARGET_SECONDS, TARGET_WALL_S = 1000, 1_000_000, 3600.0, 600.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=TARGET_REPLICAS)
    parser.add_argument("--seconds", type=float, default=20.0, help="simulated seconds of trace")
    parser.add_argument("--rate", type=float, help="fleet-wide req/s (default: the target's per-replica rate x replicas)")
    parser.add_argument("--profile", default="modelled-accelerator")
    parser.add_argument("--router", default="round-robin", choices=["round-robin", "least-load"])
    parser.add_argument("--quick", action="store_true", help="100 replicas, 10 simulated seconds")
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.quick:
        args.replicas, args.seconds = 100, 10.0
    rate = args.rate or TARGET_REQUESTS / TARGET_SECONDS * args.replicas / TARGET_REPLICAS

    from iterserve.operator.models import InferenceServiceSpec
    from iterserve.replica_model.profile import load_profile
    from iterserve.simulate import traces
    from iterserve.simulate.cluster import ClusterSim, SimOptions

    spec = InferenceServiceSpec.model_validate({
        "model": {"uri": "smollm2-135m"}, "replicas": args.replicas,
        "engine": {"maxNumSeqs": 64, "kvCacheMemory": "2GiB", "maxModelLen": 2048}})
    trace = traces.poisson(rate, args.seconds, traces.Lengths.parse("uniform:64:1024"),
                           traces.Lengths.parse("zipf:512"), seed=3)
    profile = load_profile(args.profile)
    load_before = os.getloadavg()
    profiler = cProfile.Profile()
    cpu_started, wall_started = time.process_time(), time.perf_counter()
    profiler.enable()
    result = ClusterSim(spec, profile, trace, SimOptions(router=args.router)).run()
    profiler.disable()
    cpu, wall = time.process_time() - cpu_started, time.perf_counter() - wall_started

    stats = pstats.Stats(profiler, stream=io.StringIO())
    total = sum(v[3] for k, v in stats.stats.items() if k[2] == "run" and k[0].endswith("cluster.py"))
    where = {}
    for (path, _, function), (_, _, _own, cumulative, _) in stats.stats.items():
        short = f"{os.path.basename(path)}:{function}"
        if any(part in path for part in ("iterserve", "engine")) and cumulative > 0.02 * total:
            where[short] = round(cumulative / total, 3)
    where = dict(sorted(where.items(), key=lambda kv: -kv[1])[:16])
    finished = sum(1 for r in result.requests if r.status == "ok")
    projected_cpu = cpu * TARGET_SECONDS / args.seconds * TARGET_REPLICAS / args.replicas
    row = {"replicas": args.replicas, "rate_req_s": rate, "simulated_trace_s": args.seconds,
           "requests": len(trace), "finished": finished, "steps": result.steps, "simulated_s": result.end,
           "cpu_s": round(cpu, 2), "wall_s": round(wall, 2), "ms_cpu_per_step": 1000 * cpu / max(1, result.steps),
           "projected_cpu_s_for_target": round(projected_cpu, 0),
           "target": {"replicas": TARGET_REPLICAS, "requests": TARGET_REQUESTS, "seconds": TARGET_SECONDS,
                      "wall_s": TARGET_WALL_S},
           "meets_target": projected_cpu <= TARGET_WALL_S, "share_of_cpu": where}
    print(f"{args.replicas} replicas, {len(trace)} requests over {args.seconds:g} s ({rate:.1f} req/s, "
          f"profile {profile.name}, router {args.router}): {result.steps} engine steps in {cpu:.1f} s CPU "
          f"({wall:.1f} s wall), {row['ms_cpu_per_step']:.3f} ms CPU per step")
    print(f"projected to {TARGET_REPLICAS} replicas x {TARGET_SECONDS:.0f} s ({TARGET_REQUESTS:,} requests): "
          f"{projected_cpu:,.0f} s CPU against the {TARGET_WALL_S:.0f} s target: "
          f"{'met' if row['meets_target'] else 'MISSED'}")
    print("share of the run's CPU (cumulative, functions over 2%):")
    for name, share in where.items():
        print(f"  {share:6.1%}  {name}")
    print(f"load average {load_before[0]:.1f} -> {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    common.write_json(args.json, {"benchmark": "sim_scale", "quick": args.quick, "profile": profile.name,
                                  "router": args.router, "load_average": [load_before, os.getloadavg()],
                                  "cpus": os.cpu_count(), **row})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
