"""The `k8s_cluster` fixture: one real control plane for the whole test session.

Local (default): etcd, kube-apiserver, kube-controller-manager, kube-scheduler and kwok built by
`make cluster-tools`, on loopback ports in a temporary folder. With ITERSERVE_TEST_KUBECONFIG
set, the tests use that cluster instead (e.g. kind on a machine with Docker; add_gpu_node then
needs kwok installed in it).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from iterserve.devcluster import ClusterHandle, LocalCluster

EXISTING_KUBECONFIG_ENV = "ITERSERVE_TEST_KUBECONFIG"


def _report(config: pytest.Config, line: str) -> None:
    """Writes past pytest's output capture, so the line shows even with -q."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    capture = config.pluginmanager.get_plugin("capturemanager")
    if reporter is None or capture is None:
        print(line)
        return
    with capture.global_and_fixture_disabled():
        reporter.write_line(line)


def _memory(cluster: LocalCluster) -> str:
    usage = cluster.memory_mb()
    parts = ", ".join(f"{name} {mb:.0f}" for name, mb in usage.items())
    return f"{sum(usage.values()):.0f} MB ({parts})"


@pytest.fixture(scope="session")
def k8s_cluster(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    existing = os.environ.get(EXISTING_KUBECONFIG_ENV)
    if existing:
        handle = ClusterHandle(Path(existing), tmp_path_factory.mktemp("k8s"))
        _report(request.config, f"\nk8s_cluster: using the existing cluster {handle.api_url} ({existing})")
        yield handle
        return
    cluster = LocalCluster(tmp_path_factory.mktemp("k8s"))
    cluster.start()
    try:
        handle = cluster.cluster_handle()
        _report(request.config, f"\nk8s_cluster: local control plane {cluster.api_url} up in "
                                f"{cluster.startup_seconds:.1f} s, memory {_memory(cluster)}")
        yield handle
        _report(request.config, f"\nk8s_cluster: memory at the end {_memory(cluster)}")
    finally:
        cluster.stop()
