"""`iterserve dev-cluster up|down --dir DIR`: a local control plane with two KWOK GPU nodes,
running in the background until `down`."""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from iterserve.devcluster import tools
from iterserve.devcluster.cluster import ClusterStartError, LocalCluster, running_pids, stop_in
from iterserve.devcluster.tools import MissingToolsError


def configure(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    up = actions.add_parser("up", help="start the cluster in the background and write DIR/kubeconfig")
    up.add_argument("--dir", type=Path, required=True, help="folder for certificates, data, logs and kubeconfig")
    up.add_argument("--gpu-nodes", type=int, default=2, help="KWOK GPU nodes to add (default 2)")
    up.add_argument("--gpus-per-node", type=int, default=8, help="nvidia.com/gpu capacity of each node (default 8)")
    up.add_argument("--timeout", type=float, default=90, help="seconds to wait for a healthy cluster")
    down = actions.add_parser("down", help="stop the cluster started in DIR")
    down.add_argument("--dir", type=Path, required=True)
    status = actions.add_parser("status", help="say whether a cluster runs in DIR")
    status.add_argument("--dir", type=Path, required=True)


def run(args: argparse.Namespace) -> int:
    return {"up": _up, "down": _down, "status": _status}[args.action](args)


def _up(args: argparse.Namespace) -> int:
    cluster = LocalCluster(args.dir, detach=True)
    try:
        cluster.start(timeout=args.timeout)
    except (MissingToolsError, ClusterStartError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    try:
        handle = cluster.cluster_handle()
        for index in range(args.gpu_nodes):
            handle.add_gpu_node(f"gpu-node-{index}", gpus=args.gpus_per_node)
    except BaseException:
        cluster.stop()
        raise
    kubeconfig = cluster.kubeconfig
    print(f"cluster up in {cluster.startup_seconds:.1f} s: {cluster.api_url}, "
          f"{args.gpu_nodes} KWOK GPU nodes with {args.gpus_per_node} x nvidia.com/gpu each")
    print(f"logs: {cluster.logs}")
    kubectl = shutil.which("kubectl") or tools.bin_dir() / "kubectl"
    print(f"\n  export KUBECONFIG={kubeconfig}\n  {kubectl} get nodes\n")
    print(f"stop it with: iterserve dev-cluster down --dir {args.dir}")
    return 0


def _down(args: argparse.Namespace) -> int:
    stopped = stop_in(args.dir)
    if not stopped:
        print(f"no cluster running in {args.dir}")
        return 0
    print(f"stopped {', '.join(stopped)}")
    return 0


def _status(args: argparse.Namespace) -> int:
    pids = running_pids(args.dir)
    if not pids:
        print(f"no cluster running in {args.dir}")
        return 1
    for name, pid in pids.items():
        print(f"{name}\tpid {pid}")
    return 0
