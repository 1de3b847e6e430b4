"""How much faster than real time the simulator runs, per step-time profile.

One Poisson trace per profile, shaped for it (the CPU profile's steps take 0.1-2 s, the modelled
accelerator's ~12 ms with 64-128 sequences, the fake model's ~3 ms), one replica of the spec in
examples/gpu-autoscaling.yaml with autoscaling off, so the figure is the replica's cost per
step. Speed is simulated seconds per second of the simulator, on two clocks: wall (what you wait
on this machine) and the process's CPU time (what it costs on a core of its own: on a shared
machine the wall figure mostly measures the other processes). Prints a table and writes JSON.

    .venv/bin/python -m bench.simulator.speed [--quick] [--json docs/perf/sim/speed.json]
"""

from __future__ import annotations

import argparse
import os
import time

from bench import common

CASES = {  # profile: (rate req/s, duration s, prompt, output, maxNumSeqs)
    "smollm2-135m-cpu": (0.5, 120, "uniform:8:128", "zipf:40", 16),
    "modelled-accelerator": (12.0, 60, "uniform:64:1024", "zipf:512", 128),
    "fake-model": (40.0, 60, "uniform:32:256", "zipf:128", 64),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a quarter of each trace")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()

    from iterserve.operator.models import InferenceServiceSpec
    from iterserve.replica_model import profile as profiles
    from iterserve.replica_model.replica import fake_model_profile
    from iterserve.simulate import traces
    from iterserve.simulate.cli import simulate
    from iterserve.simulate.cluster import SimOptions
    from iterserve.simulate.report import Slo

    rows = []
    load_before = os.getloadavg()
    for name, (rate, duration, prompt, output, seqs) in CASES.items():
        duration = duration / 4 if args.quick else duration
        trace = traces.poisson(rate, duration, traces.Lengths.parse(prompt), traces.Lengths.parse(output), seed=7)
        engine = {"maxNumSeqs": seqs, "kvCacheMemory": "8GiB", "maxModelLen": 2048}
        if name == "fake-model":
            engine["extraArgs"] = ["--fake-model"]
        spec = InferenceServiceSpec.model_validate({"model": {"uri": "smollm2-135m"}, "engine": engine})
        profile = fake_model_profile() if name == "fake-model" else profiles.load_profile(name)
        cpu_started = time.process_time()
        document, wall = simulate(trace, spec, profile, SimOptions(router="round-robin"), Slo(), {})
        cpu = time.process_time() - cpu_started
        s = document["summary"]
        simulated, steps = s["simulated_seconds"], s["engine_steps"]
        row = {"profile": name, "requests": len(trace), "simulated_s": simulated, "steps": steps,
               "mean_step_s": simulated / max(steps, 1), "wall_s": round(wall, 3), "cpu_s": round(cpu, 3),
               "x_real_time_wall": simulated / wall, "x_real_time_cpu": simulated / cpu,
               "simulator_ms_per_step_cpu": 1000 * cpu / max(steps, 1)}
        rows.append(row)
        print(f"{name:<22} {len(trace):>5} requests, {simulated:7.1f} simulated s, {steps:>6} steps "
              f"(mean {row['mean_step_s'] * 1000:7.1f} ms): {row['x_real_time_cpu']:7.1f}x real time per CPU "
              f"second ({row['simulator_ms_per_step_cpu']:.2f} ms CPU per step), {row['x_real_time_wall']:7.1f}x "
              "on the wall clock", flush=True)
    load_after = os.getloadavg()
    print(f"load average {load_before[0]:.1f} -> {load_after[0]:.1f} on {os.cpu_count()} CPUs")
    if args.json:
        common.write_json(args.json, {"benchmark": "sim_speed", "quick": args.quick,
                                      "load_average": [load_before, load_after], "cpus": os.cpu_count(), "rows": rows})
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
