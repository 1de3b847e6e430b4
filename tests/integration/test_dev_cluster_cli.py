"""`iterserve dev-cluster up/down`: a background cluster with two KWOK GPU nodes that outlives
the command and stops cleanly."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from iterserve.devcluster import stop_in, tools
from iterserve.devcluster.cluster import process_alive, running_pids

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def iterserve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "iterserve.cli", *args], capture_output=True, text=True,
                          timeout=120)


def test_up_writes_a_working_kubeconfig_and_down_stops_everything(tmp_path: Path):
    workdir = tmp_path / "c"
    try:
        up = iterserve("dev-cluster", "up", "--dir", str(workdir))
        assert up.returncode == 0, up.stderr
        assert f"export KUBECONFIG={workdir / 'kubeconfig'}" in up.stdout
        pids = running_pids(workdir)
        assert set(pids) == {"etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok"}

        nodes = subprocess.run(
            [str(tools.tool("kubectl")), "--kubeconfig", str(workdir / "kubeconfig"), "get", "nodes", "-o", "json"],
            capture_output=True, text=True, timeout=30, check=True,
        )
        items = json.loads(nodes.stdout)["items"]
        assert sorted(n["metadata"]["name"] for n in items) == ["gpu-node-0", "gpu-node-1"]
        for node in items:
            assert node["status"]["allocatable"]["nvidia.com/gpu"] == "8"
            ready = next(c for c in node["status"]["conditions"] if c["type"] == "Ready")
            assert ready["status"] == "True"

        again = iterserve("dev-cluster", "up", "--dir", str(workdir))
        assert again.returncode == 1 and "already running" in again.stderr

        down = iterserve("dev-cluster", "down", "--dir", str(workdir))
        assert down.returncode == 0, down.stderr
        assert running_pids(workdir) == {}
        for pid in pids.values():
            assert not process_alive(pid)
    finally:
        stop_in(workdir)
