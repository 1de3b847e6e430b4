"""prometheus-adapter (built from its Go module by `make cluster-tools`) as the cluster's external
metrics API: a local process registered with the API server's aggregation layer.

In: a Prometheus URL, the adapter's rules (charts/iterserve/examples/prometheus-adapter.yaml).
Out: `external.metrics.k8s.io/v1beta1` served through the API server, which is what an
autoscaling/v2 HorizontalPodAutoscaler with an External metric reads.

How the API server reaches it: an APIService names a Service; here that Service is of type
ExternalName `localhost`, so the aggregator dials https://localhost:PORT (a ClusterIP Service
would need Endpoints, and the API refuses loopback addresses in them). The aggregator proxies with
the front-proxy client certificate (pki.py); the adapter trusts it through the
extension-apiserver-authentication ConfigMap the API server publishes.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import yaml

from iterserve.devcluster import tools
from iterserve.devcluster.waiting import free_port, stop_process, wait_for

GROUP_VERSION = "external.metrics.k8s.io/v1beta1"
APISERVICE = "v1beta1.external.metrics.k8s.io"
BINARY = "prometheus-adapter"


def registration(namespace: str, port: int, name: str = BINARY) -> list[dict]:
    return [
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": namespace},
         "spec": {"type": "ExternalName", "externalName": "localhost", "ports": [{"name": "https", "port": port}]}},
        {"apiVersion": "apiregistration.k8s.io/v1", "kind": "APIService", "metadata": {"name": APISERVICE},
         "spec": {"group": "external.metrics.k8s.io", "version": "v1beta1", "groupPriorityMinimum": 100,
                  "versionPriority": 100, "insecureSkipTLSVerify": True,  # the adapter's self-signed serving cert
                  "service": {"name": name, "namespace": namespace, "port": port}}},
    ]


class PrometheusAdapter:
    """`with PrometheusAdapter(cluster, workdir, prometheus_url, rules, namespace) as adapter:`"""

    def __init__(self, cluster, workdir: Path, prometheus_url: str, rules: dict, namespace: str,
                 relist_seconds: int = 2):
        self.cluster, self.workdir = cluster, Path(workdir) / "prometheus-adapter"
        self.prometheus_url, self.rules, self.namespace = prometheus_url, rules, namespace
        self.relist_seconds = relist_seconds
        self.port = free_port()
        self.log = self.workdir / "prometheus-adapter.log"
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> PrometheusAdapter:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> PrometheusAdapter:
        self.workdir.mkdir(parents=True, exist_ok=True)
        config = self.workdir / "rules.yaml"
        config.write_text(yaml.safe_dump(self.rules, sort_keys=False))
        kubeconfig = str(self.cluster.kubeconfig)
        argv = [str(tools.tool(BINARY)), f"--secure-port={self.port}", "--bind-address=127.0.0.1",
                f"--cert-dir={self.workdir / 'certs'}", f"--lister-kubeconfig={kubeconfig}",
                f"--authentication-kubeconfig={kubeconfig}", f"--authorization-kubeconfig={kubeconfig}",
                f"--prometheus-url={self.prometheus_url}", f"--metrics-relist-interval={self.relist_seconds}s",
                f"--config={config}", "--v=2"]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         cwd=self.workdir)
        self.cluster.kubectl("create", "namespace", self.namespace, check=False)
        self.cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(registration(self.namespace, self.port)))
        wait_for(self._available, 90, 0.5, lambda: f"APIService {APISERVICE} Available ({self._condition()}; "
                                                 f"adapter log {self.log})")
        return self

    def _condition(self) -> str:
        out = self.cluster.kubectl("get", "apiservice", APISERVICE, "-o", "json", check=False).stdout
        conditions = json.loads(out or "{}").get("status", {}).get("conditions", [])
        return "; ".join(f"{c['type']}={c['status']} {c.get('reason', '')} {c.get('message', '')}" for c in conditions)

    def _available(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"prometheus-adapter exited {self.proc.returncode}: {self.log.read_text()[-3000:]}")
        return "Available=True" in self._condition()

    def value(self, namespace: str, metric: str, selector: str) -> list[dict]:
        """The metric's items, read through the API server as the HPA controller reads them."""
        path = f"/apis/{GROUP_VERSION}/namespaces/{namespace}/{metric}?labelSelector={selector}"
        return json.loads(self.cluster.kubectl("get", "--raw", path).stdout)["items"]

    def stop(self) -> None:
        self.cluster.kubectl("delete", "apiservice", APISERVICE, "--wait=false", check=False)
        stop_process(self.proc)
