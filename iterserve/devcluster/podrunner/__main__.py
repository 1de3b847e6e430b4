"""`python -m iterserve.devcluster.podrunner --kubeconfig K --log-dir D --namespace NS [--namespace NS2]`:
run the local pod runtime for the pods of those namespaces, in the foreground until Ctrl-C (e.g.
beside `iterserve dev-cluster up`)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
from pathlib import Path

from iterserve.devcluster.podrunner.runner import CONTAINER_RUNTIMES, PodRunner


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m iterserve.devcluster.podrunner", description=__doc__)
    parser.add_argument("--kubeconfig", required=True, help="admin kubeconfig of the cluster")
    parser.add_argument("--log-dir", type=Path, required=True, help="one log file per pod container goes here")
    parser.add_argument("--namespace", action="append", required=True, dest="namespaces", metavar="NS",
                        help="run the pods of this namespace (repeat for more); no other namespace is watched")
    parser.add_argument("--threads", type=int, default=1, help="OMP/MKL threads per engine (default 1)")
    parser.add_argument("--container-runtime", choices=CONTAINER_RUNTIMES,
                        default=os.environ.get("ITERSERVE_CONTAINER_RUNTIME", "process"),
                        help="process: each container as a local `iterserve` process (default); podman: the "
                             "pod's image with podman + runc (docs/image.md). Env: ITERSERVE_CONTAINER_RUNTIME")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from kubernetes import config

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with PodRunner(config.new_client_from_config(config_file=args.kubeconfig), args.log_dir, namespaces=args.namespaces,
                   threads=args.threads, container_runtime=args.container_runtime):
        try:
            stop.wait()
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
