"""The policy table: autoscaling policies compared in the simulator on one bursty trace, with pod
start-up delays of 30 s and 100 s. Prints a markdown table and writes JSON.

Policies: static N (no autoscaling), queue threshold only (waiting requests per replica; no
preemption signal, no KV retune), iterserve's default (the spec's defaults, retune off),
default + retune (the spec's defaults as they are: KV retune on), SLO mode (spec.autoscaling.slo
at the table's targets, planned by the simulator's own replica model) and scale to zero
(minReplicas 0, scaleToZeroAfterSeconds 180). The trace ends with an idle spell and a small
wake-up burst, so scale to zero shows its cold starts (requests held while no replica is ready).

    .venv/bin/python -m bench.simulator.policy_table --burst-rate 2 --json docs/perf/sim/policy_table.json \
        --plot docs/perf/sim/policy [--quick]

--plot PREFIX draws the timelines of PLOTTED (PREFIX_default_retune_30s.png, ...).
"""

from __future__ import annotations

import argparse
import copy
import os
import time

from bench import common
from iterserve.operator.models import InferenceServiceSpec
from iterserve.replica_model.profile import load_profile
from iterserve.simulate.cli import simulate
from iterserve.simulate.cluster import Delay, SimOptions
from iterserve.simulate.report import Slo
from iterserve.simulate.traces import Lengths, TraceRequest, gamma

ENGINE = {"maxNumSeqs": 16, "kvCacheMemory": "24MiB", "maxModelLen": 512, "drainSeconds": 60,
          "extraArgs": ["--max-waiting-requests", "100000"]}
AUTOSCALING = {"mode": "Builtin", "minReplicas": 1, "maxReplicas": 6}
POLICIES = {
    "static 2": {"replicas": 2, "autoscaling": None},
    "static 4": {"replicas": 4, "autoscaling": None},
    "queue threshold only": {"autoscaling": dict(AUTOSCALING, preemptionsPerMinuteThreshold=1e9,
                                                 kvRetune={"enabled": False})},
    "iterserve default": {"autoscaling": dict(AUTOSCALING, kvRetune={"enabled": False})},
    "default + retune": {"autoscaling": dict(AUTOSCALING)},
    "SLO mode": {"autoscaling": dict(AUTOSCALING, slo={"ttftP95Ms": 2000, "itlP95Ms": 500,
                                                       "stepProfile": "smollm2-135m-cpu"})},
    "scale to zero": {"autoscaling": dict(AUTOSCALING, minReplicas=0, scaleToZeroAfterSeconds=180)},
}
PLOTTED = {("default + retune", "30"): "default_retune_30s", ("iterserve default", "100"): "default_100s",
           ("queue threshold only", "100"): "queue_only_100s"}


IDLE_S, WAKE_REQUESTS, WAKE_S = 360.0, 20, 10.0


def workload(minutes: float, seed: int, burst_rate: float) -> list[TraceRequest]:
    """Quiet (0.4 req/s), a burst, quiet again (each part gamma-distributed gaps, cv 2), then
    IDLE_S seconds without a request and WAKE_REQUESTS requests over WAKE_S seconds."""
    prompt, output = Lengths("uniform", 96, 32), Lengths("zipf", 128)
    part = minutes * 60 / 4
    quiet1 = gamma(0.4, 2.0, part, prompt, output, seed)
    burst = gamma(burst_rate, 2.0, 1.5 * part, prompt, output, seed + 1)
    quiet2 = gamma(0.4, 2.0, 1.5 * part, prompt, output, seed + 2)
    wake = [TraceRequest(4 * part + IDLE_S + WAKE_S * i / WAKE_REQUESTS, 64, 64) for i in range(WAKE_REQUESTS)]
    return ([r for r in quiet1] + [TraceRequest(r.arrival_s + part, r.prompt_tokens, r.output_tokens) for r in burst]
            + [TraceRequest(r.arrival_s + 2.5 * part, r.prompt_tokens, r.output_tokens) for r in quiet2] + wake)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", default="smollm2-135m-cpu")
    parser.add_argument("--minutes", type=float, default=20)
    parser.add_argument("--quick", action="store_true", help="8 simulated minutes")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--burst-rate", type=float, default=2.5, help="requests/s during the burst")
    parser.add_argument("--json")
    parser.add_argument("--plot", metavar="PREFIX", help="write the timelines of a few rows as PREFIX_<row>.png")
    args = parser.parse_args()
    minutes = 8 if args.quick else args.minutes
    profile = load_profile(args.profile)
    trace = workload(minutes, args.seed, args.burst_rate)
    slo = Slo(ttft_s=2.0, itl_s=0.5)
    rows = []
    started = time.perf_counter()
    for name, overrides in POLICIES.items():
        for startup in ("30", "100"):
            if name.startswith("static") and startup == "100":
                continue  # nothing starts after t=0
            raw = {"model": {"uri": "smollm2-135m"}, "engine": copy.deepcopy(ENGINE), "replicas": 1}
            raw.update(copy.deepcopy(overrides))
            spec = InferenceServiceSpec.model_validate({k: v for k, v in raw.items() if v is not None})
            # Routing as the spec deploys it: the iterserve router (least load, 429 after a 2 s hold).
            document, wall = simulate(trace, spec, profile, SimOptions(seed=args.seed, startup=Delay.parse(startup),
                                                                       tail_s=120), slo, {})
            s = document["summary"]
            if args.plot and (name, startup) in PLOTTED:
                from iterserve.simulate.report import plot

                path = f"{args.plot}_{PLOTTED[name, startup]}.png"
                plot(document, path, f"{name}, start-up {startup} s, profile {profile.name}")
                print(f"  wrote {path}")
            rows.append({"policy": name, "startup_s": None if name.startswith("static") else float(startup),
                         "slo_attainment": s["slo"]["attainment"], "ttft_p95_s": s["ttft_s"]["p95"],
                         "replica_seconds": s["replica_seconds"], "scale_events": len(s["scale_events"]),
                         "retunes": len(s["retunes"]), "preemptions": s["preemptions"],
                         "max_ready": s["max_ready_replicas"], "statuses": s["statuses"],
                         "cold_start_requests": s["held"]["requests"], "cold_start_ttft_p95_s": s["held"]["ttft_p95_s"],
                         "simulated_s": s["simulated_seconds"], "wall_s": round(wall, 2)})
            print(f"  {name:<22} start-up {startup:>3} s: {rows[-1]}", flush=True)
    print(f"\nprofile {profile.name}{' (MODELLED)' if profile.modelled else ''}; {len(trace)} requests over "
          f"{minutes:g} min (burst {args.burst_rate:g} req/s); SLO TTFT <= {slo.ttft_s} s and mean ITL <= {slo.itl_s} s; "
          f"bench wall {time.perf_counter() - started:.0f} s\n")
    print("| policy | start-up | SLO attainment | TTFT p95 (s) | replica-seconds | scale events | retunes | preemptions "
          "| 429s | max ready | cold starts (TTFT p95 s) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        startup = "-" if r["startup_s"] is None else f"{r['startup_s']:.0f} s"
        cold = (f"{r['cold_start_requests']} ({r['cold_start_ttft_p95_s']:.1f})" if r["cold_start_requests"]
                else "0")
        print(f"| {r['policy']} | {startup} | {r['slo_attainment']:.1%} | {r['ttft_p95_s']:.2f} | "
              f"{r['replica_seconds']:.0f} | {r['scale_events']} | {r['retunes']} | {r['preemptions']} | "
              f"{r['statuses'].get('rejected', 0)} | {r['max_ready']} | {cold} |")
    common.write_json(args.json, {"load_average_at_end": list(os.getloadavg()), "profile": profile.name,
                                  "minutes": minutes, "burst_rate": args.burst_rate, "requests": len(trace),
                                  "slo": vars(slo), "engine": ENGINE, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
