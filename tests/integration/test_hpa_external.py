"""`autoscaling.mode: External` driven by a real HorizontalPodAutoscaler: the operator (as the
chart's ServiceAccount) runs an InferenceService whose engine pods the local runtime runs; a real
Prometheus scrapes them as the chart's PodMonitor says; a real prometheus-adapter (built from its Go
module, registered with the API server's aggregation layer) serves their waiting requests as the
external metric `iterserve_waiting_requests`; the chart's HPA (externalScaling.hpa) scales the
InferenceService through its scale subresource: up under load, down after. The operator never
writes spec.replicas (its managed fields). The timeline is printed and written to
$ITERSERVE_HPA_TIMELINE when set (docs/operator.md)."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from e2e.wholeloop.endpoints import ReadyEndpoints
from e2e.wholeloop.stack import Stack
from iterserve.devcluster.adapter import PrometheusAdapter
from iterserve.devcluster.monitoring import CHART, ChartAlerting, render_chart
from iterserve.devcluster.podrunner import local_runtime_scheduling
from iterserve.operator.kube import FIELD_MANAGER
from iterserve.operator.models import GROUP, PLURAL, VERSION
from tests.operator_fixture import wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

NAME = "chat"
MAX_REPLICAS = 3
TARGET_WAITING = 8
MAX_NUM_SEQS = 4
CONCURRENCY = 40  # 40 long requests on max_num_seqs 4: ~36 waiting, desired ceil(36 / 8) -> capped at 3
PROMPT = "hello " * 20  # 120 tokens of the fake tokenizer
MAX_TOKENS = 1000  # + the prompt: within the engine's 2048-token context (else every request is a 400)
STEP_TIME_SCALE = 5  # the fake model 5x slower: ~60 tokens/s a sequence, a request lasts ~16 s
METRIC = "iterserve_waiting_requests"


def inference_service() -> dict:
    return {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "InferenceService", "metadata": {"name": NAME},
        "spec": {
            "model": {"uri": "smollm2-135m"},
            "engine": {"maxNumSeqs": MAX_NUM_SEQS, "drainSeconds": 5, "startupSeconds": 60,
                       "extraArgs": ["--fake-model", "--fake-step-time-scale", str(STEP_TIME_SCALE),
                                     "--max-waiting-requests", "1000"],
                       "resources": {"limits": {"nvidia.com/gpu": 1}}},
            "replicas": 1,
            "autoscaling": {"mode": "External", "minReplicas": 1, "maxReplicas": MAX_REPLICAS},
            "scheduling": local_runtime_scheduling(),
            # The load goes straight to the engines (the Service selects them), so their queues are
            # what the HPA sees; the default router in front would answer 429 past its own small
            # queue. HPA + router: e2e/autoscaling_modes.py (routing as the whole loop sets it).
            "routing": {"mode": "None"},
            "podTemplatePatch": {"spec": {"containers": [{
                "name": "engine", "startupProbe": {"periodSeconds": 1, "failureThreshold": 60},
                "readinessProbe": {"periodSeconds": 1, "failureThreshold": 1}}]}},
        },
    }


def hpa(namespace: str) -> dict:
    sets = ("externalScaling.hpa.enabled=true", f"externalScaling.targets[0].name={NAME}",
            f"externalScaling.targets[0].namespace={namespace}", f"externalScaling.targets[0].maxReplicas={MAX_REPLICAS}",
            f"externalScaling.targetWaitingPerReplica={TARGET_WAITING}",
            "externalScaling.hpa.behavior.scaleDown.stabilizationWindowSeconds=10")
    [obj] = [o for o in render_chart(sets) if o["kind"] == "HorizontalPodAutoscaler"]
    return obj


class Load:
    """CONCURRENCY long streaming completions spread over the ready endpoints, until stop().
    Refused requests are counted by status (a refused request never queues: the last run's load
    was 400s that the HPA could not see)."""

    def __init__(self, endpoints: ReadyEndpoints):
        self.endpoints, self._stop = endpoints, threading.Event()
        self.refused: dict[int, int] = {}
        self.completed = 0
        self.thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    async def _one(self, client: httpx.AsyncClient, index: int) -> None:
        body = {"model": "fake", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True}
        while not self._stop.is_set():
            urls = self.endpoints()
            if not urls:
                await asyncio.sleep(0.2)
                continue
            try:
                async with client.stream("POST", f"{urls[index % len(urls)]}/v1/completions", json=body) as response:
                    if response.status_code != 200:
                        self.refused[response.status_code] = self.refused.get(response.status_code, 0) + 1
                        await asyncio.sleep(0.2)
                        continue
                    async for _ in response.aiter_lines():
                        if self._stop.is_set():
                            return
                    self.completed += 1
            except httpx.HTTPError:
                await asyncio.sleep(0.2)

    async def _run(self) -> None:
        async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5)) as client:
            tasks = [asyncio.create_task(self._one(client, i)) for i in range(CONCURRENCY)]
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


@pytest.fixture(scope="module")
def timeline(k8s_cluster, tmp_path_factory):
    from kubernetes import client

    workdir = tmp_path_factory.mktemp("hpa-external")
    rules = yaml.safe_load((CHART / "examples" / "prometheus-adapter.yaml").read_text())
    with Stack(k8s_cluster, workdir / "stack", log=lambda *a: None) as stack, \
            ChartAlerting(k8s_cluster, workdir / "monitoring", namespace=f"{stack.namespace}-mon") as monitoring, \
            PrometheusAdapter(k8s_cluster, workdir, monitoring.prometheus.url, rules,
                              namespace=f"{stack.namespace}-mon") as adapter:
        namespace = stack.namespace
        custom = client.CustomObjectsApi(stack.api)
        custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, inference_service())
        endpoints = ReadyEndpoints(stack.api, namespace, NAME).start()
        try:
            wait_for(endpoints, 120, 0.5, "a ready engine")
            k8s_cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(hpa(namespace)))
            rows: list[dict] = []
            started = time.monotonic()

            def sample(phase: str) -> dict:
                obj = custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, NAME)
                scaler = json.loads(k8s_cluster.kubectl("-n", namespace, "get", "hpa", NAME, "-o", "json").stdout)
                current = (scaler.get("status", {}).get("currentMetrics") or [{}])[0]
                waiting = current.get("external", {}).get("current", {}).get("averageValue")
                engines = monitoring.prometheus.query(f'sum(llm_scheduler_waiting_requests{{namespace="{namespace}"}})')
                row = {"t": round(time.monotonic() - started, 1), "phase": phase,
                       "spec_replicas": obj["spec"].get("replicas"),
                       "ready_replicas": obj.get("status", {}).get("readyReplicas"),
                       "hpa_desired": scaler.get("status", {}).get("desiredReplicas"),
                       "hpa_average_waiting": quantity(waiting),
                       "engines_waiting": float(engines[0]["value"][1]) if engines else None,
                       "ready_endpoints": len(endpoints())}
                rows.append(row)
                return row

            def until(phase: str, predicate, timeout: float) -> None:
                deadline = time.monotonic() + timeout
                while time.monotonic() < deadline:
                    if predicate(sample(phase)):
                        return
                    time.sleep(1)
                raise AssertionError(f"{phase}: not reached in {timeout:.0f} s; timeline {rows[-10:]}; "
                                     f"requests refused by status {load.refused if load else None}; "
                                     f"adapter log {adapter.log}")

            load: Load | None = None

            until("idle", lambda r: r["hpa_average_waiting"] is not None, 90)  # the metric reached the HPA
            load = Load(endpoints).start()
            load_started = rows[-1]["t"]
            try:
                until("heavy", lambda r: (r["spec_replicas"] or 0) >= 2 and (r["ready_replicas"] or 0) >= 2, 150)
                external = adapter.value(namespace, METRIC, f"inferenceservice%3D{NAME}")
            finally:
                load.stop()
            load_stopped = rows[-1]["t"]
            refused, completed = load.refused, load.completed
            until("after", lambda r: r["spec_replicas"] == 1, 150)
            managed = custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, NAME)["metadata"]["managedFields"]
        finally:
            endpoints.stop()
            k8s_cluster.kubectl("-n", namespace, "delete", "hpa", NAME, "--wait=false", check=False)
    result = {"rows": rows, "load_started": load_started, "load_stopped": load_stopped, "external": external,
              "managed": managed, "refused": refused, "completed": completed}
    if os.environ.get("ITERSERVE_HPA_TIMELINE"):
        Path(os.environ["ITERSERVE_HPA_TIMELINE"]).write_text(json.dumps(result, indent=1))
    return result


def quantity(value: str | None) -> float | None:
    """A Kubernetes quantity as the HPA status writes averageValue ("36", "12500m")."""
    if value is None:
        return None
    return float(value[:-1]) / 1000 if value.endswith("m") else float(value)


def test_the_load_queues_on_the_engine(timeline):
    assert timeline["refused"] == {}, f"the engines refused requests: {timeline['refused']}"
    heavy = [r for r in timeline["rows"] if r["phase"] == "heavy"]
    assert max(r["engines_waiting"] or 0 for r in heavy) > TARGET_WAITING, heavy
    assert max(r["hpa_average_waiting"] or 0 for r in heavy) > TARGET_WAITING, heavy


def test_the_external_metric_is_served_through_the_aggregation_layer(timeline):
    [item] = timeline["external"]
    assert item["metricName"] == METRIC and item["metricLabels"]["inferenceservice"] == NAME
    assert float(item["value"].rstrip("m")) > 0


def test_the_hpa_scales_up_under_load_and_down_after(timeline, capsys):
    rows = timeline["rows"]
    up = next(r for r in rows if r["phase"] == "heavy" and (r["spec_replicas"] or 0) >= 2)
    down = next(r for r in rows if r["phase"] == "after" and r["spec_replicas"] == 1)
    with capsys.disabled():
        print(f"\nhpa external: load at {timeline['load_started']} s, spec.replicas 1 -> {up['spec_replicas']} at "
              f"{up['t']} s (+{up['t'] - timeline['load_started']:.1f} s), peak "
              f"{max(r['spec_replicas'] or 0 for r in rows)}; load stopped at {timeline['load_stopped']} s, "
              f"back to 1 at {down['t']} s (+{down['t'] - timeline['load_stopped']:.1f} s)")
    assert max(r["spec_replicas"] or 0 for r in rows) <= MAX_REPLICAS
    assert up["hpa_desired"] >= 2 and all(r["spec_replicas"] == 1 for r in rows if r["t"] < timeline["load_started"])


def test_the_operator_never_writes_replicas(timeline):
    for entry in timeline["managed"]:
        if entry["manager"] == FIELD_MANAGER:
            assert "f:replicas" not in json.dumps(entry.get("fieldsV1", {}).get("f:spec", {})), entry
    scale_writers = {e["manager"] for e in timeline["managed"] if e.get("subresource") == "scale"}
    assert scale_writers and FIELD_MANAGER not in scale_writers, scale_writers
