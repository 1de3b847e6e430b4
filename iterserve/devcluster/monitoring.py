"""Prometheus and Alertmanager beside a cluster, configured as the Prometheus Operator would
configure them from the chart's objects; and the Prometheus Operator's own CRDs, to install into a
cluster that has no operator. Alertmanager is the Debian package's; Prometheus is built from its Go
module by `make cluster-tools` (e2e/cluster/prometheus/), because the Debian package's Prometheus is
built without kubernetes_sd_configs.

In: the chart's rendered PodMonitor and PrometheusRule, a kubeconfig. Out: a Prometheus that finds
the engine pods through the API server (`kubernetes_sd_configs`, role pod, with the relabeling the
Prometheus Operator generates for a PodMonitor plus the PodMonitor's own relabelings), evaluates
the PrometheusRule's groups and sends to an Alertmanager whose webhook receiver is an AlertSink
in this process, which records every notification.

    crds = prometheus_operator_crds()               # the pinned upstream manifests (Go module cache)
    with AlertSink() as sink, Alertmanager(dir, sink.url) as am, \\
         Prometheus(dir, [scrape_config(podmonitor, kubeconfig)], rules, am.address) as prom:
        ...  sink.notifications()
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import yaml

from iterserve.devcluster import tools
from iterserve.devcluster.waiting import free_port, stop_process, wait_for

PROMETHEUS_OPERATOR_MODULE = "github.com/prometheus-operator/prometheus-operator"
# The newest version of the root module the Go module proxy lists; its CRDs are what
# kube-prometheus-stack installs for this operator version.
PROMETHEUS_OPERATOR_VERSION = "v0.85.0"
CRD_FOLDER = "example/prometheus-operator-crd"
KEDA_MODULE = "github.com/kedacore/keda/v2"
KEDA_VERSION = "v2.21.0"  # for its ScaledObject CRD only (the chart's externalScaling.keda example)
PACKAGES_HINT = "run `make system-packages` (Debian packages prometheus and prometheus-alertmanager)"


class MissingMonitoringToolError(RuntimeError):
    pass


def binary(*names: str) -> str:
    for name in names:
        found = shutil.which(name)
        if found:
            return found
    raise MissingMonitoringToolError(f"{' or '.join(names)} not found: {PACKAGES_HINT}")


def module_files(module: str, version: str, folder: str) -> list[Path]:
    """The YAML files in `folder` of Go module `module`@`version`, from the Go module cache
    (`go mod download` fetches the module from the Go proxy the first time)."""
    go = shutil.which("go") or ("/usr/local/go/bin/go" if os.access("/usr/local/go/bin/go", os.X_OK) else None)
    if go is None:
        raise MissingMonitoringToolError(f"go not found: the CRDs come from the Go module {module}")
    result = subprocess.run([go, "mod", "download", "-json", f"{module}@{version}"],
                            capture_output=True, text=True, timeout=600, cwd="/")
    info = json.loads(result.stdout or "{}")
    if result.returncode != 0 or "Dir" not in info:
        raise MissingMonitoringToolError(f"go mod download {module}@{version} failed: "
                                         f"{info.get('Error') or result.stderr.strip()}")
    files = sorted((Path(info["Dir"]) / folder).glob("*.yaml"))
    if not files:
        raise MissingMonitoringToolError(f"no YAML files in {Path(info['Dir']) / folder}")
    return files


def prometheus_operator_crds(version: str = PROMETHEUS_OPERATOR_VERSION) -> list[Path]:
    """The Prometheus Operator's CRD manifests (example/prometheus-operator-crd) at `version`."""
    return module_files(PROMETHEUS_OPERATOR_MODULE, version, CRD_FOLDER)


def keda_scaledobject_crd(version: str = KEDA_VERSION) -> Path:
    """KEDA's ScaledObject CRD (config/crd/bases) at `version`."""
    [crd] = [p for p in module_files(KEDA_MODULE, version, "config/crd/bases") if p.name == "keda.sh_scaledobjects.yaml"]
    return crd


# --- the Prometheus Operator's translation of a PodMonitor -----------------------------------------

def _snake(key: str) -> str:
    return re.sub(r"(?<!^)([A-Z])", r"_\1", key).lower()


def _meta(label: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", label)


def scrape_config(podmonitor: dict, kubeconfig: Path, interval: str | None = None) -> dict:
    """The scrape job the Prometheus Operator generates for the first endpoint of `podmonitor`
    (pkg/prometheus/promcfg.go: keep by selector and port, drop finished pods, namespace/pod/
    container labels, then the PodMonitor's relabelings), discovering pods with `kubeconfig`."""
    meta, spec = podmonitor["metadata"], podmonitor["spec"]
    [endpoint] = spec["podMetricsEndpoints"][:1]
    sd: dict = {"role": "pod", "kubeconfig_file": str(kubeconfig)}
    names = (spec.get("namespaceSelector") or {}).get("matchNames")
    if names and not spec["namespaceSelector"].get("any"):
        sd["namespaces"] = {"names": list(names)}
    relabel: list[dict] = [{"source_labels": ["job"], "target_label": "__tmp_prometheus_job_name"}]
    for label, value in sorted((spec.get("selector") or {}).get("matchLabels", {}).items()):
        relabel.append({"action": "keep", "regex": f"({re.escape(value)});true",
                        "source_labels": [f"__meta_kubernetes_pod_label_{_meta(label)}",
                                          f"__meta_kubernetes_pod_labelpresent_{_meta(label)}"]})
    relabel += [
        {"action": "keep", "source_labels": ["__meta_kubernetes_pod_container_port_name"],
         "regex": str(endpoint["port"])},
        {"action": "drop", "source_labels": ["__meta_kubernetes_pod_phase"], "regex": "(Failed|Succeeded)"},
        {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
        {"source_labels": ["__meta_kubernetes_pod_container_name"], "target_label": "container"},
        {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
        {"target_label": "job", "replacement": f"{meta.get('namespace', 'default')}/{meta['name']}"},
        {"target_label": "endpoint", "replacement": str(endpoint["port"])},
    ]
    relabel += [{_snake(key): value for key, value in rule.items()} for rule in endpoint.get("relabelings") or []]
    return {
        "job_name": f"podMonitor/{meta.get('namespace', 'default')}/{meta['name']}/0",
        "honor_labels": bool(endpoint.get("honorLabels", False)),
        "metrics_path": endpoint.get("path", "/metrics"),
        "scrape_interval": interval or endpoint.get("interval", "30s"),
        "kubernetes_sd_configs": [sd],
        "relabel_configs": relabel,
    }


# --- the receiver ---------------------------------------------------------------------------------

@dataclass
class Notification:
    """One alert as a webhook notification carried it."""
    at: float  # time.monotonic() when it arrived
    status: str  # firing | resolved
    labels: dict[str, str]
    annotations: dict[str, str]

    @property
    def alertname(self) -> str:
        return self.labels.get("alertname", "")


@dataclass
class AlertSink:
    """Alertmanager's webhook receiver: an HTTP server on loopback that records notifications."""
    port: int = field(default_factory=free_port)
    _seen: list[Notification] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/alerts"

    def __enter__(self) -> AlertSink:
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                now = time.monotonic()
                with sink._lock:
                    for alert in body.get("alerts", []):
                        sink._seen.append(Notification(now, alert.get("status", ""), alert.get("labels") or {},
                                                       alert.get("annotations") or {}))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args):
                pass

        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self._server.serve_forever, name="alert sink", daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def notifications(self) -> list[Notification]:
        with self._lock:
            return list(self._seen)

    def fired(self, namespace: str | None = None) -> dict[str, list[Notification]]:
        return _by_name(n for n in self.notifications() if n.status == "firing"
                        and namespace in (None, n.labels.get("namespace")))

    def resolved(self, namespace: str | None = None) -> dict[str, list[Notification]]:
        return _by_name(n for n in self.notifications() if n.status == "resolved"
                        and namespace in (None, n.labels.get("namespace")))


def _by_name(notifications) -> dict[str, list[Notification]]:
    out: dict[str, list[Notification]] = {}
    for notification in notifications:
        out.setdefault(notification.alertname, []).append(notification)
    return out


# --- the two servers ------------------------------------------------------------------------------

class _Server:
    name = ""

    def __init__(self, workdir: Path):
        self.workdir = Path(workdir) / self.name
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.url = f"http://{self.address}"
        self.log = self.workdir / f"{self.name}.log"
        self.proc: subprocess.Popen | None = None

    def _start(self, argv: list[str]) -> None:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         cwd=self.workdir)

    def wait_ready(self, timeout: float = 30) -> None:
        import urllib.request

        def ready() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as response:
                    return response.status == 200
            except OSError:
                return False

        wait_for(ready, timeout, 0.2, f"{self.name} ready")

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self):
        raise NotImplementedError

    def stop(self) -> None:
        stop_process(self.proc)


def alertmanager_config(example: dict, receiver_url: str, group_wait: str = "1s", group_interval: str = "2s") -> dict:
    """`example` (an Alertmanager config with routes, grouping and inhibition) with every receiver
    sent to `receiver_url` and short timings, so a test sees notifications within seconds."""
    config = json.loads(json.dumps(example))
    config["receivers"] = [{"name": r["name"], "webhook_configs": [{"url": receiver_url, "send_resolved": True}]}
                           for r in config["receivers"]]

    def shorten(route: dict) -> None:
        route.update({"group_wait": group_wait, "group_interval": group_interval})
        for child in route.get("routes") or []:
            shorten(child)

    shorten(config["route"])
    return config


class Alertmanager(_Server):
    name = "alertmanager"

    def __init__(self, workdir: Path, config: dict):
        super().__init__(workdir)
        self.config = config

    def start(self) -> Alertmanager:
        path = self.workdir / "alertmanager.yml"
        path.write_text(yaml.safe_dump(self.config, sort_keys=False))
        self._start([binary("prometheus-alertmanager", "alertmanager"), f"--config.file={path}",
                     f"--storage.path={self.workdir / 'data'}", f"--web.listen-address={self.address}",
                     "--cluster.listen-address=", "--log.level=warn"])
        self.wait_ready()
        return self


class Prometheus(_Server):
    """Scrapes `scrape_configs`, evaluates `rule_groups` (a PrometheusRule's spec) every
    `evaluation_interval`, and sends alerts to the Alertmanager at `alertmanager` (host:port)."""
    name = "prometheus"

    def __init__(self, workdir: Path, scrape_configs: list[dict], rules: dict, alertmanager: str,
                 evaluation_interval: str = "1s"):
        super().__init__(workdir)
        self.scrape_configs, self.rules, self.alertmanager = scrape_configs, rules, alertmanager
        self.evaluation_interval = evaluation_interval

    def start(self) -> Prometheus:
        rules = self.workdir / "rules.yml"
        rules.write_text(yaml.safe_dump(self.rules, sort_keys=False))
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": self.evaluation_interval},
            "rule_files": [str(rules)],
            "alerting": {"alertmanagers": [{"static_configs": [{"targets": [self.alertmanager]}]}]},
            "scrape_configs": self.scrape_configs,
        }
        path = self.workdir / "prometheus.yml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        self._start([str(tools.tool("prometheus")), f"--config.file={path}", f"--storage.tsdb.path={self.workdir / 'data'}",
                     f"--web.listen-address={self.address}", "--rules.alert.resend-delay=1s", "--log.level=warn"])
        self.wait_ready()
        return self

    def query(self, expr: str) -> list[dict]:
        import urllib.parse
        import urllib.request

        url = f"{self.url}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"
        with urllib.request.urlopen(url, timeout=5) as response:
            return json.loads(response.read())["data"]["result"]

    def rule_health(self) -> list[tuple[str, str, str]]:
        import urllib.request

        with urllib.request.urlopen(f"{self.url}/api/v1/rules", timeout=5) as response:
            groups = json.loads(response.read())["data"]["groups"]
        return [(r["name"], r.get("health", ""), r.get("lastError", "")) for g in groups for r in g["rules"]]

    def targets(self) -> list[dict]:
        import urllib.request

        with urllib.request.urlopen(f"{self.url}/api/v1/targets", timeout=5) as response:
            return json.loads(response.read())["data"]["activeTargets"]


def prometheus_rbac(namespace: str, name: str = "prometheus") -> list[dict]:
    """A ServiceAccount that may discover pods, as a Prometheus in the cluster would have."""
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": name, "namespace": namespace}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole", "metadata": {"name": f"{namespace}-{name}"},
         "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
         "metadata": {"name": f"{namespace}-{name}"},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": f"{namespace}-{name}"},
         "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": namespace}]},
    ]


# --- the chart's alerting, live ----------------------------------------------------------------

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "iterserve"
EXAMPLE_ALERTMANAGER_CONFIG = CHART / "examples" / "alertmanager.yaml"
# Short `for` and rate windows so alerts fire and resolve within a minute; the thresholds stay the
# shipped ones (waiting > 50, > 1 preemption a minute, KV > 0.95).
SHORT_ALERT_SETS = ("alerts.schedulerBacklog.for=5s", "alerts.preemptionStorm.for=5s",
                    "alerts.preemptionStorm.rateWindow=30s", "alerts.kvCacheNearExhaustion.for=5s")


def render_chart(sets: tuple[str, ...] = ()) -> list[dict]:
    """`helm template` of the chart with its PodMonitor and PrometheusRule on."""
    args = [str(tools.tool("helm")), "template", "iterserve", str(CHART), "--namespace", "iterserve-system",
            "--set", "monitoring.podMonitor.enabled=true", "--set", "monitoring.prometheusRule.enabled=true"]
    for item in sets:
        args += ["--set", item]
    env = {**os.environ, "HELM_CACHE_HOME": "/tmp/iterserve-helm/cache",
           "HELM_CONFIG_HOME": "/tmp/iterserve-helm/config", "HELM_DATA_HOME": "/tmp/iterserve-helm/data"}
    out = subprocess.run(args, capture_output=True, text=True, timeout=120, env=env, check=True).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


class ChartAlerting:
    """The chart's alerting against a cluster: its PodMonitor as a Prometheus scrape job that
    discovers engine pods through the API server (as ServiceAccount `prometheus` of `namespace`,
    allowed to list pods), its PrometheusRule rendered with `sets`, and the chart's example
    Alertmanager config delivering to an AlertSink.

        with ChartAlerting(cluster, workdir) as alerting:
            ...  alerting.sink.fired(), alerting.summary()
    """

    def __init__(self, cluster, workdir: Path, sets: tuple[str, ...] = SHORT_ALERT_SETS,
                 namespace: str = "iterserve-monitoring", scrape_interval: str = "1s"):
        self.cluster, self.workdir, self.sets, self.namespace = cluster, Path(workdir), sets, namespace
        self.scrape_interval = scrape_interval
        self.sink = AlertSink()
        self.alertmanager: Alertmanager | None = None
        self.prometheus: Prometheus | None = None
        self.rules: dict = {}

    def __enter__(self) -> ChartAlerting:
        try:
            self._up()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _up(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        objects = render_chart(self.sets)
        [podmonitor] = [o for o in objects if o["kind"] == "PodMonitor"]
        [rule] = [o for o in objects if o["kind"] == "PrometheusRule"]
        self.rules = rule["spec"]
        self.cluster.kubectl("create", "namespace", self.namespace, check=False)
        self.cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(prometheus_rbac(self.namespace)))
        kubeconfig = self.cluster.service_account_kubeconfig("prometheus", self.namespace,
                                                             path=self.workdir / "prometheus.kubeconfig")
        self.sink.__enter__()
        example = yaml.safe_load(EXAMPLE_ALERTMANAGER_CONFIG.read_text())
        self.alertmanager = Alertmanager(self.workdir, alertmanager_config(example, self.sink.url)).start()
        self.prometheus = Prometheus(self.workdir, [scrape_config(podmonitor, kubeconfig, self.scrape_interval)],
                                     self.rules, self.alertmanager.address).start()

    def __exit__(self, *exc) -> None:
        for server in (self.prometheus, self.alertmanager):
            if server is not None:
                server.stop()
        if getattr(self.sink, "_server", None) is not None:
            self.sink.__exit__()
        self.cluster.kubectl("delete", "-f", "-", "--wait=false", input=yaml.safe_dump_all(prometheus_rbac(self.namespace)),
                             check=False)
        self.cluster.kubectl("delete", "namespace", self.namespace, "--wait=false", check=False)

    def summary(self, since: float = 0.0) -> dict:
        """alerts_fired / alerts_resolved: alert name -> the pods (or InferenceServices) it named, as
        the receiver saw them, with the seconds after `since` (time.monotonic()) of the first one."""
        def side(by_name: dict[str, list[Notification]]) -> dict:
            return {name: {"first_after_s": round(min(n.at for n in notes) - since, 1) if since else None,
                           "pods": sorted({n.labels.get("pod") or n.labels.get("inferenceservice", "") for n in notes})}
                    for name, notes in sorted(by_name.items())}
        return {"alerts_fired": side(self.sink.fired()), "alerts_resolved": side(self.sink.resolved())}


def main(argv: list[str] | None = None) -> int:
    """`python -m iterserve.devcluster.monitoring crds`: fetch the pinned Prometheus Operator CRDs
    and KEDA's ScaledObject CRD into the Go module cache (what `make monitoring-crds` runs) and
    print their paths."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m iterserve.devcluster.monitoring", description=main.__doc__)
    parser.add_argument("what", choices=["crds"])
    parser.parse_args(argv)
    for path in [*prometheus_operator_crds(), keda_scaledobject_crd()]:
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
