"""Everything the run needs on top of a bare control plane: a KWOK GPU node for the local pod
runtime, the CRD, the Helm chart's ServiceAccount and RBAC (rendered by helm, watching one
namespace), the operator as a local process authenticated as that ServiceAccount, and the pod
runtime that makes the engine pods real processes."""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.request
import uuid
from pathlib import Path

import yaml

from iterserve.devcluster import ClusterHandle, tools
from iterserve.devcluster.podrunner import PodRunner, add_local_runtime_node
from iterserve.devcluster.waiting import free_port, wait_for

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "iterserve"
CRD_FILE = REPO / "crds" / "inferenceservice.yaml"
SERVICE_ACCOUNT = "iterserve"  # the chart's fullname for release "iterserve"


def helm_rbac(namespace: str, operator_namespace: str, workdir: Path) -> str:
    """The chart's ServiceAccount, Role and RoleBinding for an operator watching `namespace`."""
    env = {**os.environ, **{f"HELM_{kind}_HOME": str(workdir / "helm" / kind.lower())
                            for kind in ("CACHE", "CONFIG", "DATA")}}
    result = subprocess.run(
        [str(tools.tool("helm")), "template", "iterserve", str(CHART), "--namespace", operator_namespace,
         "--set", "operator.watch.mode=namespaced", "--set", f"operator.watch.namespaces={{{namespace}}}",
         "--show-only", "templates/serviceaccount.yaml", "--show-only", "templates/rbac.yaml"],
        capture_output=True, text=True, env=env, timeout=120)
    if result.returncode != 0:
        raise RuntimeError(f"helm template failed: {result.stderr}")
    kinds = [doc["kind"] for doc in yaml.safe_load_all(result.stdout) if doc]
    if sorted(kinds) != ["Role", "RoleBinding", "ServiceAccount"]:
        raise RuntimeError(f"expected the chart's ServiceAccount, Role and RoleBinding, got {kinds}")
    return result.stdout


class OperatorProcess:
    """`iterserve operator run -n NAMESPACE` under a ServiceAccount kubeconfig, logging to a file."""

    def __init__(self, kubeconfig: Path, namespace: str, log_path: Path, workdir: Path):
        self.kubeconfig, self.namespace, self.log_path, self.workdir = kubeconfig, namespace, log_path, workdir
        self.liveness_port, self.metrics_port = free_port(), free_port()
        self.process: subprocess.Popen | None = None

    def start(self) -> OperatorProcess:
        cmd = [sys.executable, "-m", "iterserve.cli", "operator", "run", "-n", self.namespace,
               "--kubeconfig", str(self.kubeconfig), "--resync-seconds", "1",
               "--liveness", f"http://127.0.0.1:{self.liveness_port}/healthz",
               "--metrics-host", "127.0.0.1", "--metrics-port", str(self.metrics_port)]
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir,
                                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
        wait_for(self._alive, 90, what=f"the operator's liveness endpoint (log {self.log_path})")
        return self

    def _alive(self) -> bool:
        if self.process.poll() is not None:
            raise RuntimeError(f"the operator exited with {self.process.returncode}; log {self.log_path}:\n"
                               + self.log_tail())
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.liveness_port}/healthz", timeout=1) as response:
                return response.status == 200
        except OSError:
            return False

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def forbidden_lines(self) -> list[str]:
        return [line for line in self.log_path.read_text(errors="replace").splitlines()
                if " 403" in line or "Forbidden" in line]

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


class Stack:
    """`with Stack(cluster, workdir) as stack:` sets everything up; leaving tears it down."""

    def __init__(self, cluster: ClusterHandle, workdir: Path, log=print):
        self.cluster, self.workdir, self.log = cluster, Path(workdir), log
        suffix = uuid.uuid4().hex[:6]
        self.namespace = f"loop-{suffix}"
        self.operator_namespace = f"loop-operator-{suffix}"
        self.node = f"loop-gpu-{suffix}"
        self.operator: OperatorProcess | None = None
        self.runner: PodRunner | None = None
        self.api = None

    def __enter__(self) -> Stack:
        try:
            self._up()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _up(self) -> None:
        cluster, workdir = self.cluster, self.workdir
        workdir.mkdir(parents=True, exist_ok=True)
        add_local_runtime_node(cluster, self.node, gpus=4)
        cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD_FILE))
        wait_for(lambda: "inferenceservices" in cluster.kubectl(
            "api-resources", "--api-group=iterserve.dev", "-o", "name", check=False).stdout, 60, 0.5, "the CRD served")
        for namespace in (self.namespace, self.operator_namespace):
            cluster.kubectl("create", "namespace", namespace)
        cluster.kubectl("apply", "-f", "-", input=helm_rbac(self.namespace, self.operator_namespace, workdir))
        kubeconfig = cluster.service_account_kubeconfig(SERVICE_ACCOUNT, self.operator_namespace,
                                                        path=workdir / "operator.kubeconfig")
        self.log(f"operator: ServiceAccount {self.operator_namespace}/{SERVICE_ACCOUNT} (chart RBAC), "
                 f"watching {self.namespace}")
        self.operator = OperatorProcess(kubeconfig, self.namespace, workdir / "operator.log", workdir).start()
        self.runner = PodRunner(cluster.api_client(), workdir / "pods", namespaces=[self.namespace],
                                work_dir=workdir / "pod-workdirs").start()
        self.api = cluster.api_client()

    def __exit__(self, *exc) -> None:
        if self.api is not None:
            self._delete_services()
        if self.operator is not None:
            self.operator.stop()
        if self.runner is not None:
            self.runner.stop()
        for namespace in (self.namespace, self.operator_namespace):
            self.cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)
        self.cluster.kubectl("delete", "node", self.node, "--wait=false", check=False)
        if self.api is not None:
            self.api.close()

    def _delete_services(self) -> None:
        """Delete the InferenceServices while the operator still runs (it removes its finalizer)."""
        self.cluster.kubectl("-n", self.namespace, "delete", "inferenceservices", "--all", "--wait=true",
                             "--timeout=60s", check=False, timeout=90)
