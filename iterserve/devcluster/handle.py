"""A handle on a running cluster, local or not: its admin kubeconfig plus the helpers tests
and people need (kubectl, KWOK GPU nodes, a kubeconfig for a ServiceAccount)."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

from iterserve.devcluster import tools
from iterserve.devcluster.kubeconfig import current_cluster, token_user, write_kubeconfig
from iterserve.devcluster.nodes import gpu_node_manifest, is_schedulable


class ClusterHandle:
    def __init__(self, kubeconfig: Path, workdir: Path, startup_seconds: float | None = None):
        self.kubeconfig = Path(kubeconfig)
        self.startup_seconds = startup_seconds  # None for a cluster this process did not start
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._cluster = current_cluster(self.kubeconfig)
        self.api_url: str = self._cluster["server"]

    def api_client(self, kubeconfig: Path | None = None):
        from kubernetes import config

        return config.new_client_from_config(config_file=str(kubeconfig or self.kubeconfig))

    def kubectl(self, *args: str, input: str | None = None, check: bool = True, timeout: float = 60,
                kubeconfig: Path | None = None) -> subprocess.CompletedProcess:
        """Runs kubectl against this cluster; on failure with check=True raises with its stderr."""
        cmd = [str(_kubectl()), "--kubeconfig", str(kubeconfig or self.kubeconfig), *args]
        result = subprocess.run(cmd, input=input, capture_output=True, text=True, timeout=timeout)
        if check and result.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args)} failed ({result.returncode}): {result.stderr.strip()}")
        return result

    def add_gpu_node(self, name: str, gpus: int = 8, labels: dict[str, str] | None = None,
                     taints: list[dict] | None = None, wait: float = 30, **resources) -> dict:
        """Creates a KWOK GPU node and waits until pods can be scheduled onto it."""
        from kubernetes import client

        manifest = gpu_node_manifest(name, gpus, labels, taints, **resources)
        with self.api_client() as api:
            core = client.CoreV1Api(api)
            core.create_node(manifest)
            deadline = time.monotonic() + wait
            while not is_schedulable(core.read_node(name)):
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"KWOK node {name} not Ready within {wait:.0f} s: is kwok running and "
                        f"managing nodes annotated kwok.x-k8s.io/node=fake?"
                    )
                time.sleep(0.2)
        return manifest

    def service_account_kubeconfig(self, name: str, namespace: str = "default",
                                   expiration_seconds: int = 3600, path: Path | None = None) -> Path:
        """A kubeconfig that authenticates as ServiceAccount namespace/name with a token from the
        TokenRequest API, so it has exactly the RBAC permissions bound to that ServiceAccount."""
        from kubernetes import client

        with self.api_client() as api:
            request = client.AuthenticationV1TokenRequest(
                spec=client.V1TokenRequestSpec(audiences=[], expiration_seconds=expiration_seconds)
            )
            token = client.CoreV1Api(api).create_namespaced_service_account_token(name, namespace, request)
        path = path or self.workdir / f"sa-{namespace}-{name}.kubeconfig"
        return write_kubeconfig(path, self._cluster, token_user(token.status.token), f"{namespace}-{name}")


def _kubectl() -> Path:
    try:
        return tools.tool("kubectl")
    except tools.MissingToolsError:
        found = shutil.which("kubectl")
        if found is None:
            raise
        return Path(found)

