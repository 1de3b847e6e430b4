"""The chart's alerts, live: a real Prometheus (Debian package) discovers engine pods through the
local API server with the chart's PodMonitor turned into kubernetes_sd_configs, evaluates the
chart's PrometheusRule (rendered with short `for` windows, thresholds as shipped), and sends to a
real Alertmanager running the chart's example config, whose receiver is a webhook sink here.

Two engine pods of InferenceService `chat`, run by the local pod runtime, each loaded so that
exactly the alerts meant for it fire:
- chat-a, the queueing replica: 90 concurrent long requests on max_num_seqs 16 (74 wait: backlog
  > 50) and a pool big enough for all 16 (usage < 0.5, no preemption).
- chat-b, the replica whose pool is forced full: 64 blocks, max_num_seqs 64 and a queue that is
  never empty (capped at 40 by --max-waiting-requests: never a backlog), requests of random length
  so they do not finish together. A finished request's blocks go to the next waiting one in the
  next step, growth preempts the youngest (1-2 blocks): usage stays >= 62/64 and preemption is
  continuous. (The first version forced a 16-block pool with 6 requests of 200 tokens: every
  preemption freed a quarter of it, so usage crossed 0.95 in only ~30% of scrapes and never for
  5 s, while chat-a's 48-block pool thrashed by 16 running sequences sat above 0.95 for
  stretches: the KV alert fired on chat-a, not on the replica forced full.)
The backlog, preemption and KV alerts must reach the sink with namespace, inferenceservice, pod
and a runbook URL naming a section of docs/runbooks.md, each for its replica only, and resolve
once the load stops."""

from __future__ import annotations

import asyncio
import random
import threading
import time
import uuid
from urllib.parse import urlparse

import httpx
import pytest
import yaml

from iterserve.devcluster.monitoring import (
    EXAMPLE_ALERTMANAGER_CONFIG,
    ChartAlerting,
    alertmanager_config,
    binary,
)
from iterserve.devcluster.podrunner import (
    PodRunner,
    add_local_runtime_node,
    local_runtime_scheduling,
)
from tests.operator_fixture import wait_for
from tests.unit.test_chart_alerts import RUNBOOKS, github_anchors

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

BACKLOG, PREEMPTION, KV = "IterserveSchedulerBacklog", "IterservePreemptionStorm", "IterserveKVCacheNearExhaustion"
LIVE = (BACKLOG, PREEMPTION, KV)
EXAMPLE_CONFIG = EXAMPLE_ALERTMANAGER_CONFIG
SERVICE = "chat"
QUEUEING, FORCED_FULL = "chat-a", "chat-b"
# The fake model's step time x5 / x10: the same queue and pool behaviour at a fraction of the CPU.
ENGINES = {
    QUEUEING: ["--max-num-seqs", "16", "--num-kv-blocks", "1024", "--max-model-len", "512",
               "--fake-step-time-scale", "5"],
    FORCED_FULL: ["--max-num-seqs", "64", "--num-kv-blocks", "64", "--max-model-len", "64",
                  "--fake-step-time-scale", "10", "--max-waiting-requests", "40"],
}
LOAD = {QUEUEING: 90, FORCED_FULL: 60}  # concurrent requests, each sent again as soon as it ends
MAX_TOKENS = {QUEUEING: (200, 200), FORCED_FULL: (10, 58)}  # + the 5-token prompt: within max-model-len


def engine_pod(name: str, args: list[str]) -> dict:
    labels = {"app.kubernetes.io/name": "iterserve-engine", "app.kubernetes.io/managed-by": "iterserve-operator",
              "app.kubernetes.io/instance": SERVICE}
    return {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels},
        "spec": {**local_runtime_scheduling(), "terminationGracePeriodSeconds": 5, "containers": [{
            "name": "engine", "image": "ghcr.io/iterserve/engine:0.1.0", "command": ["iterserve", "serve"],
            "args": ["--fake-model", "--port", "8000", "--block-size", "16", "--max-waiting-requests", "1000",
                     "--drain-timeout", "1", *args],  # a later --max-waiting-requests in args wins
            "ports": [{"name": "http", "containerPort": 8000}],
            "readinessProbe": {"httpGet": {"path": "/ready", "port": "http"}, "periodSeconds": 1},
        }]},
    }


class Load:
    """Keeps LOAD[pod] completions in flight against each engine until stop(), counting the
    answers by status (chat-b's 429s are its queue bound at work; anything else is a failure)."""

    def __init__(self, urls: dict[str, str]):
        self.urls, self._stop = urls, threading.Event()
        self.statuses: dict[str, dict[int, int]] = {pod: {} for pod in urls}
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    async def _one(self, client: httpx.AsyncClient, pod: str, rng: random.Random) -> None:
        url, statuses = self.urls[pod], self.statuses[pod]
        while not self._stop.is_set():
            body = {"model": "fake", "prompt": "hello", "max_tokens": rng.randint(*MAX_TOKENS[pod]),
                    "ignore_eos": True}
            try:
                response = await client.post(f"{url}/v1/completions", json=body)
                statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
                if response.status_code != 200:
                    await asyncio.sleep(0.5)
            except httpx.HTTPError:
                await asyncio.sleep(0.2)

    async def _run(self) -> None:
        async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5),
                                     limits=httpx.Limits(max_connections=200)) as client:
            tasks = [asyncio.create_task(self._one(client, pod, random.Random(i)))
                     for pod, n in LOAD.items() for i in range(n)]
            while not self._stop.is_set():
                await asyncio.sleep(0.2)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def start(self) -> Load:
        self.thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(30)


def report(capsys, line: str) -> None:
    with capsys.disabled():
        print(line)


@pytest.fixture(scope="module")
def stack(k8s_cluster, tmp_path_factory):
    from kubernetes import client

    workdir = tmp_path_factory.mktemp("alerts-live")
    suffix = uuid.uuid4().hex[:6]
    namespace, node = f"alerts-{suffix}", f"alerts-{suffix}"
    add_local_runtime_node(k8s_cluster, node, gpus=2)
    k8s_cluster.kubectl("create", "namespace", namespace)
    api = k8s_cluster.api_client()
    core = client.CoreV1Api(api)
    runner = PodRunner(k8s_cluster.api_client(), workdir / "pods", namespaces=[namespace]).start()
    try:
        with ChartAlerting(k8s_cluster, workdir, namespace=f"alerts-monitoring-{suffix}") as alerting:
            for name, args in ENGINES.items():
                core.create_namespaced_pod(namespace, engine_pod(name, args))

            def ready_ips():
                pods = core.list_namespaced_pod(namespace).items
                ready = {p.metadata.name: p.status.pod_ip for p in pods
                         if any(c.type == "Ready" and c.status == "True" for c in p.status.conditions or [])}
                return ready if set(ready) == set(ENGINES) else None

            ips = wait_for(ready_ips, 120, 0.5, "both engine pods Ready")
            yield namespace, alerting.prometheus, alerting.sink, {pod: f"http://{ip}:8000" for pod, ip in ips.items()}
    finally:
        runner.stop()
        k8s_cluster.kubectl("delete", "namespace", namespace, "--wait=false")
        k8s_cluster.kubectl("delete", "node", node, "--wait=false")
        api.close()


@pytest.fixture(scope="module")
def run(stack):
    """Discovery, then the load until the three alerts arrived, then the wait for them to resolve."""
    namespace, prometheus, sink, urls = stack

    def discovered():
        targets = [t for t in prometheus.targets() if t["health"] == "up" and t["labels"]["namespace"] == namespace]
        return targets if len(targets) == len(ENGINES) else None

    targets = wait_for(discovered, 60, 0.5, lambda: f"two engine targets up (have {prometheus.targets()})")
    started = time.monotonic()
    load = Load(urls).start()
    try:
        wait_for(lambda: set(LIVE) <= set(sink.fired(namespace)), 150, 0.5,
                 lambda: f"{LIVE} at the receiver (have {sorted(sink.fired(namespace))}; Prometheus ALERTS "
                         f"{prometheus.query('ALERTS')}; waiting {prometheus.query('llm_scheduler_waiting_requests')}; "
                         f"rules {prometheus.rule_health()})")
        peak = {expr: prometheus.query(f'max_over_time({expr}{{namespace="{namespace}"}}[1m])')
                for expr in ("llm_scheduler_waiting_requests", "llm_gpu_kv_cache_usage_fraction")}
    finally:
        load_stopped = time.monotonic()
        load.stop()
    def pairs(by_name: dict) -> set[tuple[str, str]]:
        return {(name, n.labels.get("pod", "")) for name, notes in by_name.items() for n in notes if name in LIVE}

    wait_for(lambda: pairs(sink.fired(namespace)) <= pairs(sink.resolved(namespace)), 150, 0.5,
             lambda: f"{LIVE} resolved at the receiver (have {sorted(sink.resolved(namespace))})")
    return {"namespace": namespace, "targets": targets, "sink": sink, "peak": peak, "started": started,
            "load_stopped": load_stopped, "statuses": load.statuses}


def test_prometheus_discovers_the_engine_pods_through_the_api_server(run):
    for target in run["targets"]:
        labels = target["labels"]
        assert labels["job"] == "iterserve-engine" and labels["inferenceservice"] == SERVICE
        assert labels["namespace"] == run["namespace"] and labels["pod"] in ENGINES
        assert urlparse(target["scrapeUrl"]).hostname.startswith("127.10.")
        assert target["discoveredLabels"]["__meta_kubernetes_pod_name"] == labels["pod"]


def test_backlog_preemption_and_kv_alerts_fire_with_labels_and_runbooks(run, capsys):
    sink, sections = run["sink"], github_anchors(RUNBOOKS.read_text())
    fired = sink.fired(run["namespace"])
    for name in LIVE:
        for note in fired[name]:
            assert note.labels["namespace"] == run["namespace"], note
            assert note.labels["inferenceservice"] == SERVICE and note.labels["pod"] in ENGINES, note
            url = urlparse(note.annotations["runbook_url"])
            assert url.path.endswith("/docs/runbooks.md") and url.fragment == name.lower(), note.annotations
            assert url.fragment in sections, f"docs/runbooks.md has no section #{url.fragment}"
        report(capsys, f"\nalerts live: {name} fired for {sorted({n.labels['pod'] for n in fired[name]})} "
                       f"{min(n.at for n in fired[name]) - run['started']:.1f} s after the load started")
    # Each alert names exactly the replica whose state it describes.
    assert {n.labels["pod"] for n in fired[BACKLOG]} == {QUEUEING}  # chat-b's queue is capped at 40
    assert {n.labels["pod"] for n in fired[KV]} == {FORCED_FULL}  # chat-a's pool holds all 16 sequences
    assert {n.labels["pod"] for n in fired[PREEMPTION]} == {FORCED_FULL}
    waiting = {s["metric"]["pod"]: float(s["value"][1]) for s in run["peak"]["llm_scheduler_waiting_requests"]}
    usage = {s["metric"]["pod"]: float(s["value"][1]) for s in run["peak"]["llm_gpu_kv_cache_usage_fraction"]}
    assert waiting[QUEUEING] > 50 and waiting[FORCED_FULL] <= 40, waiting
    assert usage[FORCED_FULL] > 0.95 and usage[QUEUEING] < 0.95, usage


def test_the_engines_answered_every_request(run):
    statuses = run["statuses"]
    assert set(statuses[QUEUEING]) <= {200} and set(statuses[FORCED_FULL]) <= {200, 429}, statuses
    assert statuses[QUEUEING].get(200) and statuses[FORCED_FULL].get(200), statuses


def test_the_alerts_resolve_after_the_load(run, capsys):
    resolved = run["sink"].resolved(run["namespace"])
    for name in LIVE:
        after = min(n.at for n in resolved[name]) - run["load_stopped"]
        report(capsys, f"\nalerts live: {name} resolved {after:.1f} s after the load stopped")
        assert after > 0
        assert {n.labels["pod"] for n in resolved[name]} >= {n.labels["pod"] for n in run["sink"].fired(run["namespace"])[name]}


def test_the_example_alertmanager_config_is_valid(tmp_path):
    import subprocess

    result = subprocess.run([binary("amtool"), "check-config", str(EXAMPLE_CONFIG)], capture_output=True, text=True,
                            timeout=30)
    assert result.returncode == 0 and "2 inhibit rules" in result.stdout, result.stdout + result.stderr
    path = tmp_path / "rewritten.yml"
    path.write_text(yaml.safe_dump(alertmanager_config(yaml.safe_load(EXAMPLE_CONFIG.read_text()), "http://127.0.0.1:1/x")))
    result = subprocess.run([binary("amtool"), "check-config", str(path)], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stdout + result.stderr
