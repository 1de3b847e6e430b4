"""One autoscaler tick against the real API server: the operator's reconcile, then the autoscaler
hook exactly as the operator's timer runs them, authenticated as a ServiceAccount holding only
operator/rbac.py's rules. The engine pod (a KWOK pod with a 127.10/16 address) is backed by a
real `iterserve serve --fake-model` listening on that address, kept busy (40 long requests, max_num_seqs 4) so its queue is above
target. External mode writes nothing; Builtin mode patches spec.replicas and the Deployment
follows, with an Event and a scalingHistory entry carrying the numbers."""

from __future__ import annotations

import base64
import logging
import os
import socket
import subprocess
import time
import uuid

import httpx
import pytest
from kubernetes import client

from iterserve.engine import metrics as names
from iterserve.operator.autoscaling.hook import AutoscalerHook
from iterserve.operator.handlers import TickContext
from iterserve.operator.kube import Kube
from iterserve.operator.models import GROUP, PLURAL, VERSION
from iterserve.operator.reconcile import Reconciler
from iterserve.operator.resources import ENGINE_PORT, secret_name, selector_string
from tests.operator_fixture import OperatorProcess, install_crd, operator_namespace, wait_for
from tests.server_fixture import iterserve_command

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def _service(name: str, node_label: str, mode: str) -> dict:
    return {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "InferenceService", "metadata": {"name": name},
        "spec": {
            "model": {"uri": "smollm2-135m"},
            "engine": {"maxNumSeqs": 4},
            "replicas": 1,
            "autoscaling": {"mode": mode, "minReplicas": 1, "maxReplicas": 3, "targetWaitingPerReplica": 2,
                            "warmupSeconds": 0, "intervalSeconds": 1},
            "scheduling": {"nodeSelector": {"iterserve.dev/pool": node_label}},
        },
    }


def _ready_pods(core: client.CoreV1Api, namespace: str, name: str) -> list:
    pods = core.list_namespaced_pod(namespace, label_selector=selector_string(name)).items
    return [p for p in pods if p.status.pod_ip and any(
        c.type == "Ready" and c.status == "True" for c in p.status.conditions or [])]


def test_a_tick_scales_in_builtin_mode_and_writes_nothing_in_external_mode(k8s_cluster, tmp_path):
    install_crd(k8s_cluster)
    pool = f"autoscaler-{uuid.uuid4().hex[:6]}"
    k8s_cluster.add_gpu_node(f"{pool}-node", gpus=8, labels={"iterserve.dev/pool": pool})
    namespace, kubeconfig = operator_namespace(k8s_cluster, prefix="as")
    admin_api = k8s_cluster.api_client()
    custom, core = client.CustomObjectsApi(admin_api), client.CoreV1Api(admin_api)
    kube = Kube(k8s_cluster.api_client(kubeconfig))  # the operator's identity: rbac.RULES only
    reconciler = Reconciler(kube)
    hook = AutoscalerHook()
    name = "scaled"
    custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, _service(name, pool, "External"))

    def tick():
        time.sleep(1.1)  # the hook acts at most every intervalSeconds
        outcome = reconciler.reconcile(namespace, name)
        hook(TickContext(namespace, name, outcome.body, outcome.spec, reconciler, kube, logging.getLogger("test")))
        return custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)

    reconciler.reconcile(namespace, name)
    (pod,) = wait_for(lambda: _ready_pods(core, namespace, name), 60, what="the engine pod Ready with an IP")
    engine, load = _busy_engine_behind(pod, core, namespace, name, tmp_path)
    try:

        # External: an HPA or KEDA owns spec.replicas. The tick reads metrics and writes none of it.
        before = custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
        after = tick()
        assert after["spec"]["replicas"] == 1
        assert after["metadata"]["generation"] == before["metadata"]["generation"]
        metrics_available = _condition(after, "MetricsAvailable")
        assert metrics_available["status"] == "True", metrics_available
        assert not (after["status"].get("scalingHistory") or [])
        assert after["status"]["waitingRequests"] >= 6

        # Builtin: the same queue (>= 10 waiting, target 2) asks for 5+, bounded to maxReplicas 3.
        custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name,
                                              {"spec": {"autoscaling": {"mode": "Builtin"}}})
        after = tick()
        assert after["spec"]["replicas"] == 3
        status = after["status"]
        (record,) = status["scalingHistory"]
        assert (record["action"], record["fromReplicas"], record["toReplicas"]) == ("ScaleUp", 1, 3)
        assert record["reason"] == "waiting_above_target" and "target 2/replica" in record["message"]
        # The numbers as fields survive the CRD's structural schema (the API server prunes unknown ones).
        assert (record["signal"], record["target"]) == ("WaitingRequests", 2) and record["metricReplicas"] >= 5
        assert status["desiredReplicas"] == 3 and status.get("lastScaleTime")
        limited = _condition(after, "ScalingLimited")
        assert (limited["status"], limited["reason"]) == ("True", "TooManyReplicas")

        reconciler.reconcile(namespace, name)  # what the update event triggers in the operator
        deployment = client.AppsV1Api(admin_api).read_namespaced_deployment(name, namespace)
        assert deployment.spec.replicas == 3
        wait_for(lambda: len(core.list_namespaced_pod(namespace, label_selector=selector_string(name)).items) == 3,
                 30, what="3 engine pods")
        events = core.list_namespaced_event(namespace, field_selector=f"involvedObject.name={name}").items
        scale_up = [e for e in events if e.reason == "ScaleUp"]
        assert scale_up and "1 -> 3" in scale_up[0].message

        # The next tick: two new pods loading, so no further scale-up whatever the queue says.
        again = tick()
        assert again["spec"]["replicas"] == 3
    finally:
        for process in (load, engine):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait()
        admin_api.close()


def _busy_engine_behind(pod, core, namespace: str, name: str, workdir):
    """A real engine on the KWOK pod's address with the admin token from the operator's Secret,
    and a load that keeps >= 10 requests waiting on it for ~40 s (max_num_seqs 4, 40 long requests)."""
    secret = core.read_namespaced_secret(secret_name(name), namespace)
    token = base64.b64decode(secret.data["token"]).decode()
    engine_url = f"http://{pod.status.pod_ip}:{ENGINE_PORT}"
    with socket.socket() as probe:  # KWOK hands out the same addresses in every cluster
        if probe.connect_ex((pod.status.pod_ip, ENGINE_PORT)) == 0:
            raise RuntimeError(f"another process already listens on {pod.status.pod_ip}:{ENGINE_PORT} "
                               f"(a concurrent run on this machine?)")
    engine = subprocess.Popen(
        [*iterserve_command(), "serve", "--fake-model", "--host", pod.status.pod_ip, "--port", str(ENGINE_PORT),
         "--max-num-seqs", "4"], cwd=workdir, env={**os.environ, "ITERSERVE_ADMIN_TOKEN": token},
        stdout=(workdir / "engine.log").open("wb"), stderr=subprocess.STDOUT)
    load = None
    try:
        def ready():
            if engine.poll() is not None:
                raise RuntimeError(f"the engine exited: {(workdir / 'engine.log').read_text()[-1500:]}")
            return _get_ok(f"{engine_url}/ready")
        wait_for(ready, 60, what=f"the engine on {engine_url}")
        load = subprocess.Popen(
            [*iterserve_command(), "loadgen", "--url", engine_url, "--requests", "40", "--concurrency", "40",
             "--max-tokens", "2000", "--output-dist", "fixed"],
            cwd=workdir, stdout=(workdir / "loadgen.log").open("wb"), stderr=subprocess.STDOUT)
        wait_for(lambda: _metric(engine_url, names.WAITING_REQUESTS) >= 10, 30, what="a queue on the engine")
    except BaseException:
        for process in (load, engine):
            if process is not None:
                process.kill()
        raise
    return engine, load


def test_the_operators_timer_scales_a_busy_service(k8s_cluster, tmp_path):
    """The same, end to end through `iterserve operator run`: its kopf timer runs the tick."""
    install_crd(k8s_cluster)
    pool = f"autoscaler-{uuid.uuid4().hex[:6]}"
    k8s_cluster.add_gpu_node(f"{pool}-node", gpus=8, labels={"iterserve.dev/pool": pool})
    namespace, kubeconfig = operator_namespace(k8s_cluster, prefix="as")
    _wait_for_rbac(k8s_cluster, kubeconfig, namespace)
    operator = OperatorProcess(kubeconfig, namespace, tmp_path / "operator.log", resync_seconds=1).start()
    admin_api = k8s_cluster.api_client()
    custom, core = client.CustomObjectsApi(admin_api), client.CoreV1Api(admin_api)
    name = "timed"
    custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, _service(name, pool, "Builtin"))
    engine = load = None
    try:
        (pod,) = wait_for(lambda: _ready_pods(core, namespace, name), 60,
                          what=f"the engine pod Ready with an IP (operator log:\n{operator.log_tail()})")
        engine, load = _busy_engine_behind(pod, core, namespace, name, tmp_path)

        def scaled():
            body = custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
            return body if body["spec"]["replicas"] == 3 else None
        body = wait_for(scaled, 30, what=f"spec.replicas 3 (operator log:\n{operator.log_tail()})")
        wait_for(lambda: client.AppsV1Api(admin_api).read_namespaced_deployment(name, namespace).spec.replicas == 3,
                 15, what="the Deployment at 3 replicas")
        history = wait_for(lambda: custom.get_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, name)["status"].get("scalingHistory"), 10, what="scalingHistory")
        assert (history[0]["action"], history[0]["fromReplicas"], history[0]["toReplicas"]) == ("ScaleUp", 1, 3)
        assert body["metadata"]["generation"] >= 2
        text = operator.metrics()
        assert f'{names.AUTOSCALER_DESIRED_REPLICAS}{{inferenceservice="{name}",namespace="{namespace}"}} 3.0' in text
        assert f'{names.AUTOSCALER_DECISIONS_TOTAL}{{direction="up"' in text
    finally:
        for process in (load, engine):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait()
        operator.stop()
        admin_api.close()
    forbidden = [line for line in (tmp_path / "operator.log").read_text().splitlines()
                 if "Forbidden" in line or "(403)" in line]
    assert not forbidden, "\n".join(forbidden)


def _wait_for_rbac(cluster, kubeconfig, namespace: str) -> None:
    """A new RoleBinding reaches the API server's authorizer a moment after it is created."""
    with cluster.api_client(kubeconfig) as api:
        custom = client.CustomObjectsApi(api)

        def allowed():
            try:
                custom.list_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL)
                return True
            except client.ApiException as error:
                if error.status != 403:
                    raise
                return False
        wait_for(allowed, 15, 0.1, what="the operator's RBAC to take effect")


def _get_ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def _metric(url: str, name: str) -> float:
    from iterserve.operator.autoscaling.metrics_source import parse_engine_metrics

    field = {names.WAITING_REQUESTS: "waiting"}[name]
    try:
        return parse_engine_metrics(httpx.get(f"{url}/metrics", timeout=2).text)[field]
    except httpx.HTTPError:
        return -1


def _condition(body: dict, type_: str) -> dict:
    return next(c for c in body["status"]["conditions"] if c["type"] == type_)
