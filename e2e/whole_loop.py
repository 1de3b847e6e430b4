"""The whole autoscaling loop on one machine, for people: a local Kubernetes control plane with a
KWOK GPU node whose pods run as real `iterserve serve` processes, the operator as the Helm chart's
ServiceAccount, one InferenceService with Builtin autoscaling (min 1, max 3) and a small KV pool,
and load in phases idle -> heavy -> light. It checks that replicas rose under load without
runaway, that a replica under KV pressure got a lower max_num_seqs and preempted less after, that
replicas came back to min with no failed request, and that every decision is an Event and a
scalingHistory record.

    python e2e/whole_loop.py [--quick] [--real-model] [--json PATH] [--plot PNG]

Engines run with --fake-model: the real scheduler, KV pool, metrics and admin API, with a modelled
step time. The embedded SmolLM2-135M does ~35 tokens/s on one shared CPU core, and on a two-core
machine more replicas of a CPU-bound model add no capacity, so scaling out could not relieve load.
--real-model runs the embedded model instead (opt-in, not in CI): a 9-block KV pool, 12-token
prompts and 16-token outputs, 2.5 requests/s heavy and 0.25/s light, 60 s drains, and 300 s for
the first replica to load; how far it scales depends on the free cores.

Needs `make cluster-tools` (the control-plane binaries and helm in e2e/cluster/bin). Exits 1 if a
check fails. --quick is the CI run's shape (~2 min); without it the load lasts twice as long (~4 min).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `e2e` as a package when run as a script

from e2e.wholeloop.checks import evaluate  # noqa: E402
from e2e.wholeloop.plot import plot  # noqa: E402
from e2e.wholeloop.run import run  # noqa: E402
from e2e.wholeloop.scenario import Scenario  # noqa: E402
from iterserve.devcluster import LocalCluster  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the short CI shape")
    parser.add_argument("--json", type=Path, metavar="PATH", help="write timeline, decisions and summary here")
    parser.add_argument("--plot", type=Path, metavar="PNG", help="draw the timeline here")
    parser.add_argument("--real-model", action="store_true",
                        help="engines run the embedded SmolLM2-135M on CPU instead of --fake-model (slower, opt-in)")
    parser.add_argument("--workdir", type=Path, help="cluster, operator and pod logs (default: a temp folder)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.real_model:
        scenario = Scenario.real(quick=args.quick)
    else:
        scenario = Scenario.quick() if args.quick else Scenario.full()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="whole-loop-"))
    print(f"whole loop: logs under {workdir}")
    with LocalCluster(workdir / "cluster") as cluster:
        print(f"control plane up in {cluster.startup_seconds:.1f} s")
        result = run(cluster.cluster_handle(), workdir / "run", scenario)
    summary, checks = evaluate(result)
    for check in checks:
        print(f"{'PASS' if check.ok else 'FAIL'} {check.name}: {check.detail}")
    print(json.dumps({k: v for k, v in summary.items() if k != "replicas_over_time"}, indent=2))
    if args.json:
        result.update(summary=summary, checks=[vars(c) for c in checks])
        args.json.write_text(json.dumps(result, indent=1))
    if args.plot:
        plot(result, summary, args.plot)
        print(f"plot: {args.plot}")
    return 0 if all(c.ok for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
