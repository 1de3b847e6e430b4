"""Replays the whole-loop e2e's load (e2e/wholeloop/scenario.py, the full shape of the recorded
run in docs/getting-started.md) through the simulator with the loop's own InferenceService and its pods' start-up delay, and
compares the replica timeline with the recorded run's (docs/whole_loop.png; the times below are
read off that plot, to about a second).

    .venv/bin/python -m bench.simulator.wholeloop [--profile fake-model|PROFILE.json] --json OUT --plot OUT.png
"""

from __future__ import annotations

import argparse
import json

from e2e.wholeloop.scenario import Scenario, inference_service
from iterserve.operator.engine_config import profile_for
from iterserve.operator.models import InferenceServiceSpec
from iterserve.simulate.cli import simulate
from iterserve.simulate.cluster import Delay, SimOptions
from iterserve.simulate.report import Slo, plot
from iterserve.simulate.traces import Lengths, TraceRequest, poisson

# docs/whole_loop.png (fake model, full scenario; seconds since the InferenceService was applied).
# Its heavy phase started at ~24 s; the 110-126 s scale-down-and-back came from a policy
# without the scale-down floor, so the current policy is not expected to repeat it.
RECORDED = {
    "first_ready_s": 3, "heavy_start_s": 24, "heavy_end_s": 174, "end_s": 240,
    "scale_events": [(25, 1, 2), (30, 2, 3), (110, 3, 2), (120, 2, 1), (121, 1, 2), (126, 2, 3), (206, 3, 1)],
    "retunes": [(28, 8, 6), (126, 6, 4)],
    "requests": 1254, "failed": 0,
}


def trace_for(scenario: Scenario, heavy_start: float, light_seconds: float) -> list[TraceRequest]:
    heavy = poisson(scenario.heavy_rate, scenario.heavy_seconds, Lengths("fixed", scenario.prompt_tokens),
                    Lengths("fixed", scenario.output_tokens), scenario.seed)
    light = poisson(scenario.light_rate, light_seconds, Lengths("fixed", scenario.prompt_tokens),
                    Lengths("fixed", scenario.light_max_tokens), scenario.seed + 1)
    first = [TraceRequest(heavy_start + r.arrival_s, r.prompt_tokens, r.output_tokens) for r in heavy]
    second = [TraceRequest(heavy_start + scenario.heavy_seconds + r.arrival_s, r.prompt_tokens, r.output_tokens)
              for r in light]
    return first + second


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", help="default: the fake model's modelled step (what --fake-model sleeps)")
    parser.add_argument("--startup-delay", default="3")
    parser.add_argument("--json")
    parser.add_argument("--plot")
    args = parser.parse_args()
    scenario = Scenario.full()
    spec = InferenceServiceSpec.model_validate(inference_service(scenario)["spec"])
    profile = profile_for(spec, args.profile)
    heavy_start = RECORDED["heavy_start_s"] - RECORDED["first_ready_s"]
    light = RECORDED["end_s"] - RECORDED["heavy_end_s"]
    trace = trace_for(scenario, heavy_start, light)
    # t=0 of the simulation is the recorded run's first ready replica (3 s after the apply)
    # The recorded run spread its load over the ready endpoints in turn (before the router existed).
    options = SimOptions(startup=Delay.parse(args.startup_delay), tail_s=0, timeline_interval_s=1.0,
                         router="round-robin")
    document, wall = simulate(trace, spec, profile, options, Slo(), {"profile": profile.name})
    s = document["summary"]
    offset = RECORDED["first_ready_s"]
    sim_events = [(round(e["t"] + offset, 1), e["from"], e["to"]) for e in s["scale_events"]]
    sim_retunes = [(round(e["t"] + offset, 1), e["from"], e["to"]) for e in s["retunes"]]
    print(f"profile {profile.name}; {len(trace)} requests ({RECORDED['requests']} in the recorded run); "
          f"statuses {s['statuses']}; sim wall {wall:.1f} s")
    print("scale events (s since apply, from, to)")
    print(f"  recorded:  {RECORDED['scale_events']}")
    print(f"  simulated: {sim_events}")
    print("retunes (s, from, to)")
    print(f"  recorded:  {RECORDED['retunes']}")
    print(f"  simulated: {sim_retunes}")
    print(f"max ready: simulated {s['max_ready_replicas']}, recorded 3; preemptions simulated {s['preemptions']}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"profile": profile.name, "recorded": RECORDED, "simulated_scale_events": sim_events,
                       "simulated_retunes": sim_retunes, "summary": s}, handle, indent=2)
    if args.plot:
        plot(document, args.plot, f"replaying the whole loop's load ({profile.name}); t=0 is the first ready pod")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
