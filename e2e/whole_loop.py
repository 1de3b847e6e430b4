"""The whole autoscaling loop on one machine, for people: a local Kubernetes control plane with a
KWOK GPU node whose pods run as real `iterserve serve` processes, the operator as the Helm chart's
ServiceAccount, one InferenceService with Builtin autoscaling (min 1, max 3) and a small KV pool,
and load in phases idle -> heavy -> light. It checks that replicas rose under load without
runaway, that a replica under KV pressure got a lower max_num_seqs and preempted less after, that
replicas came back to min with no failed request, and that every decision is an Event and a
scalingHistory record.

    python e2e/whole_loop.py [--quick] [--real-model] [--alerts] [--json PATH] [--plot PNG]
    python e2e/whole_loop.py --disaggregated [--quick] [--json PATH] [--plot PNG]

--disaggregated runs a disaggregated InferenceService instead (spec.disaggregation.enabled, Router
mode; e2e/wholeloop/disaggregated.py): a prefill pool scaled on queued prompt tokens and a decode
pool scaled on waiting requests, under long prompts (the prefill pool must scale up while the decode
pool holds), then short prompts with long outputs (the decode pool must scale up while the prefill
pool does not), then light load until both pools are back at their minimum, with no failed request
and every decision an Event and a scalingHistory record naming its pool.

Engines run with --fake-model: the real scheduler, KV pool, metrics and admin API, with a modelled
step time. The embedded SmolLM2-135M does ~35 tokens/s on one shared CPU core, and on a two-core
machine more replicas of a CPU-bound model add no capacity, so scaling out could not relieve load.
--real-model runs the embedded model instead (opt-in, not in CI): a 9-block KV pool, 12-token
prompts and 16-token outputs, 2.5 requests/s heavy and 0.25/s light, 60 s drains, and 300 s for
the first replica to load; how far it scales depends on the free cores.

--alerts also runs the chart's alerting live (iterserve/devcluster/monitoring.py): a Prometheus
that discovers the engine pods through the API server as the chart's PodMonitor says, the chart's
PrometheusRule with short `for` windows, and an Alertmanager with the chart's example config
delivering to a webhook sink; the summary lists alerts_fired and alerts_resolved as the sink saw
them (needs `make system-packages`).

A load phase lasts its set seconds and then goes on with the same load, at most 60 s more, until
the loop's answer to it can be seen (a second Ready replica; the retuned pod's measured window
after its last retune): a loaded machine starts pods later, and the checks judge the operator,
not the machine's speed. The log says when a phase went on, and the JSON's phases say how long.

Needs `make cluster-tools` (the control-plane binaries and helm in e2e/cluster/bin). Exits 1 if a
check fails. --quick is the CI run's shape (~2 min); without it the load lasts twice as long (~4 min).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `e2e` as a package when run as a script

from e2e.wholeloop.checks import evaluate  # noqa: E402
from e2e.wholeloop.disaggregated import DisaggregatedScenario  # noqa: E402
from e2e.wholeloop.disaggregated import evaluate as evaluate_disaggregated  # noqa: E402
from e2e.wholeloop.disaggregated import plot as plot_disaggregated  # noqa: E402
from e2e.wholeloop.plot import plot  # noqa: E402
from e2e.wholeloop.run import run  # noqa: E402
from e2e.wholeloop.scenario import Scenario  # noqa: E402
from iterserve.devcluster import LocalCluster  # noqa: E402
from iterserve.devcluster.monitoring import ChartAlerting  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the short CI shape")
    parser.add_argument("--json", type=Path, metavar="PATH", help="write timeline, decisions and summary here")
    parser.add_argument("--plot", type=Path, metavar="PNG", help="draw the timeline here")
    parser.add_argument("--real-model", action="store_true",
                        help="engines run the embedded SmolLM2-135M on CPU instead of --fake-model (slower, opt-in)")
    parser.add_argument("--alerts", action="store_true",
                        help="run Prometheus + Alertmanager on the chart's rules; list the alerts in the summary")
    parser.add_argument("--resolve-wait", type=float, default=90, metavar="S",
                        help="with --alerts: seconds to wait after the run for fired alerts to resolve")
    parser.add_argument("--disaggregated", action="store_true",
                        help="a prefill pool and a decode pool, each scaled on its own signal (fake model only)")
    parser.add_argument("--workdir", type=Path, help="cluster, operator and pod logs (default: a temp folder)")
    args = parser.parse_args(argv)
    if args.disaggregated and (args.real_model or args.alerts):
        parser.error("--disaggregated runs the fake model without --alerts (leave out --real-model and --alerts)")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.disaggregated:
        scenario = DisaggregatedScenario.quick() if args.quick else DisaggregatedScenario.full()
    elif args.real_model:
        scenario = Scenario.real(quick=args.quick)
    else:
        scenario = Scenario.quick() if args.quick else Scenario.full()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="whole-loop-"))
    print(f"whole loop: logs under {workdir}")
    with LocalCluster(workdir / "cluster") as cluster:
        print(f"control plane up in {cluster.startup_seconds:.1f} s")
        handle = cluster.cluster_handle()
        if args.alerts:
            with ChartAlerting(handle, workdir / "alerts") as alerting:
                result = run(handle, workdir / "run", scenario)
                # The sink stamps notifications with time.monotonic(); the timeline's t=0 is the
                # wall-clock started_at: count the alerts from that same origin, as the phases are.
                origin = time.monotonic() - (time.time() - result["started_at"])
                alerts = _settle_alerts(alerting, origin, args.resolve_wait)
        else:
            result = run(handle, workdir / "run", scenario)
    summary, checks = (evaluate_disaggregated if args.disaggregated else evaluate)(result)
    if args.alerts:
        summary.update(alerts)
    for check in checks:
        print(f"{'PASS' if check.ok else 'FAIL'} {check.name}: {check.detail}")
    print(json.dumps({k: v for k, v in summary.items() if k != "replicas_over_time"}, indent=2))
    if args.json:
        result.update(summary=summary, checks=[vars(c) for c in checks])
        args.json.write_text(json.dumps(result, indent=1))
    if args.plot:
        (plot_disaggregated if args.disaggregated else plot)(result, summary, args.plot)
        print(f"plot: {args.plot}")
    return 0 if all(c.ok for c in checks) else 1


def _settle_alerts(alerting, started: float, wait: float) -> dict:
    """Waits up to `wait` s for every fired alert to be resolved at the receiver; the summary, with
    each alert's first notification in seconds after `started` (the timeline's t=0)."""
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline and set(alerting.sink.fired()) - set(alerting.sink.resolved()):
        time.sleep(1)
    alerts = alerting.summary(since=started)
    for side in ("alerts_fired", "alerts_resolved"):
        print(f"{side}: " + (", ".join(f"{name} {info['pods']} at +{info['first_after_s']} s"
                                       for name, info in alerts[side].items()) or "none"))
    return alerts


if __name__ == "__main__":
    sys.exit(main())
