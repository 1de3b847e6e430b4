"""Helpers for tests that run the real operator against the `k8s_cluster` control plane:
install the generated CRD, make a namespace whose ServiceAccount holds exactly the RBAC rules
in operator/rbac.py, and run `iterserve operator run` as a subprocess under it."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import urllib.request
import uuid
from pathlib import Path

import yaml

from iterserve.devcluster.waiting import free_port, wait_for  # noqa: F401  (re-exported to tests)
from iterserve.operator import rbac
from iterserve.operator.crd import CRD_NAME

REPO = Path(__file__).resolve().parents[1]
CRD_FILE = REPO / "crds" / "inferenceservice.yaml"
EXAMPLES = REPO / "examples"



def install_crd(cluster) -> None:
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD_FILE))
    cluster.kubectl("wait", "--for=condition=established", f"crd/{CRD_NAME}", "--timeout=60s")
    wait_for(lambda: "inferenceservices" in cluster.kubectl("api-resources", "--api-group=iterserve.dev",
                                                            "-o", "name").stdout, 30, 0.5, "CRD discovery")


def ensure_node(cluster, name: str = "operator-test-node") -> None:
    """A KWOK node for engine pods (kwok marks them Running and Ready), shared by the tests."""
    from kubernetes import client

    with cluster.api_client() as api:
        try:
            client.CoreV1Api(api).read_node(name)
            return
        except client.exceptions.ApiException as exc:
            if exc.status != 404:
                raise
    cluster.add_gpu_node(name)


def example(name: str, **spec_overrides) -> dict:
    doc = yaml.safe_load((EXAMPLES / name).read_text())
    doc["spec"].update(spec_overrides)
    return doc


def operator_namespace(cluster, prefix: str = "op") -> tuple[str, Path]:
    """A fresh namespace, and a kubeconfig for a ServiceAccount in it bound to a Role with exactly
    rbac.RULES: an operator running under it fails on any API call the list forgot."""
    namespace = f"{prefix}-{uuid.uuid4().hex[:6]}"
    role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
            "metadata": {"name": "iterserve-operator", "namespace": namespace},
            "rules": rbac.policy_rules()}
    binding = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
               "metadata": {"name": "iterserve-operator", "namespace": namespace},
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "iterserve-operator"},
               "subjects": [{"kind": "ServiceAccount", "name": "iterserve-operator", "namespace": namespace}]}
    cluster.kubectl("create", "namespace", namespace)
    cluster.kubectl("-n", namespace, "create", "serviceaccount", "iterserve-operator")
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all([role, binding]))
    return namespace, cluster.service_account_kubeconfig("iterserve-operator", namespace)


class OperatorProcess:
    """`iterserve operator run -n NAMESPACE` in a subprocess, logging to a file."""

    def __init__(self, kubeconfig: Path, namespace: str, log_path: Path, resync_seconds: float = 2.0):
        self.kubeconfig, self.namespace, self.log_path = kubeconfig, namespace, log_path
        self.resync_seconds = resync_seconds
        self.liveness_port, self.metrics_port = free_port(), free_port()
        self.process: subprocess.Popen | None = None

    def start(self, wait: bool = True) -> OperatorProcess:
        cmd = [sys.executable, "-m", "iterserve.cli", "operator", "run", "-n", self.namespace,
               "--kubeconfig", str(self.kubeconfig), "--resync-seconds", str(self.resync_seconds),
               "--liveness", f"http://127.0.0.1:{self.liveness_port}/healthz",
               "--metrics-host", "127.0.0.1", "--metrics-port", str(self.metrics_port)]
        log = open(self.log_path, "a")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        log.close()
        if wait:
            wait_for(self.alive, 60, 0.2, f"the operator's liveness endpoint ({self.log_path})")
        return self

    def alive(self) -> bool:
        if self.process is None or self.process.poll() is not None:
            raise RuntimeError(f"the operator exited ({self.process and self.process.returncode}):\n{self.log_tail()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.liveness_port}/healthz", timeout=1) as response:
                return response.status == 200
        except OSError:
            return False

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=2) as response:
            return response.read().decode()

    def kill(self) -> None:
        """SIGKILL: no cleanup, as when a node dies mid-reconcile."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(10)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return "(no log)"


@contextlib.contextmanager
def operated_namespace(cluster, tmp_path: Path, prefix: str, nodes: int = 1):
    """Local-runtime nodes, a namespace with the operator (exactly rbac.RULES) and the pod runtime;
    yields (namespace, operator, api, runner, node names), then deletes it all and fails if the
    operator hit an RBAC denial."""
    from iterserve.devcluster.podrunner import PodRunner, add_local_runtime_node

    install_crd(cluster)
    names = [f"{prefix}-node-{uuid.uuid4().hex[:6]}" for _ in range(nodes)]
    for node in names:
        add_local_runtime_node(cluster, node, gpus=2)
    namespace, kubeconfig = operator_namespace(cluster, prefix=prefix)
    operator = OperatorProcess(kubeconfig, namespace, tmp_path / "operator.log", resync_seconds=1).start()
    runner = PodRunner(cluster.api_client(), tmp_path / "pods", namespaces=[namespace],
                       work_dir=tmp_path / "pod-workdirs").start()
    api = cluster.api_client()
    try:
        yield namespace, operator, api, runner, names
    finally:
        cluster.kubectl("-n", namespace, "delete", "inferenceservices", "--all", "--wait=true", "--timeout=60s",
                        check=False, timeout=90)
        operator.stop()
        runner.stop()
        api.close()
        cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)
        for node in names:
            cluster.kubectl("delete", "node", node, "--wait=false", check=False)
    forbidden = [line for line in (tmp_path / "operator.log").read_text().splitlines() if "Forbidden" in line]
    assert not forbidden, "the operator hit RBAC denials; add the rule to operator/rbac.py:\n" + "\n".join(forbidden)
