"""Scale to zero and back through `iterserve operator run` on the real API server, under
operator/rbac.py's rules only. The engine pod (KWOK, a 127.10/16 address) is backed by a real
`iterserve serve --fake-model` on that address; idle for scaleToZeroAfterSeconds, the
InferenceService goes to zero. A real `iterserve router` on a router pod's address (the
activator: --hold-timeout) then holds a request; the operator reads its held-request gauge and
brings one replica back, and the held request completes once an engine answers."""

from __future__ import annotations

import os
import socket
import subprocess
import threading
import uuid

import httpx
import pytest
from kubernetes import client

from iterserve.devcluster.waiting import free_port
from iterserve.engine import metrics as names
from iterserve.operator.models import GROUP, PLURAL, VERSION
from iterserve.operator.resources import ENGINE_PORT, selector_string
from iterserve.operator.routing import ROUTER_PORT, router_labels
from tests.integration.test_autoscaler_cluster import _get_ok, _wait_for_rbac
from tests.integration.test_router import metric
from tests.operator_fixture import OperatorProcess, install_crd, operator_namespace, wait_for
from tests.server_fixture import iterserve_command

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def _service(name: str, node_label: str) -> dict:
    return {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "InferenceService", "metadata": {"name": name},
        "spec": {
            "model": {"uri": "smollm2-135m"},
            "replicas": 1,
            "autoscaling": {"mode": "Builtin", "minReplicas": 0, "maxReplicas": 2, "scaleToZeroAfterSeconds": 4,
                            "warmupSeconds": 0, "intervalSeconds": 1},
            "scheduling": {"nodeSelector": {"iterserve.dev/pool": node_label}},
        },
    }


def _ready_ips(core: client.CoreV1Api, namespace: str, selector: str) -> list[str]:
    pods = core.list_namespaced_pod(namespace, label_selector=selector).items
    return [p.status.pod_ip for p in pods if p.status.pod_ip and not p.metadata.deletion_timestamp and any(
        c.type == "Ready" and c.status == "True" for c in p.status.conditions or [])]


def _free(ip: str, port: int) -> None:
    with socket.socket() as probe:  # KWOK hands out the same addresses in every cluster
        if probe.connect_ex((ip, port)) == 0:
            raise RuntimeError(f"another process already listens on {ip}:{port} (a concurrent run on this machine?)")


def _start(command: list[str], log, workdir) -> subprocess.Popen:
    return subprocess.Popen(command, cwd=workdir, env=dict(os.environ), stdout=log.open("wb"),
                            stderr=subprocess.STDOUT)


def test_an_idle_service_goes_to_zero_and_a_held_request_brings_a_replica_back(k8s_cluster, tmp_path):
    install_crd(k8s_cluster)
    pool = f"zero-{uuid.uuid4().hex[:6]}"
    k8s_cluster.add_gpu_node(f"{pool}-node", gpus=8, labels={"iterserve.dev/pool": pool})
    namespace, kubeconfig = operator_namespace(k8s_cluster, prefix="zero")
    _wait_for_rbac(k8s_cluster, kubeconfig, namespace)
    operator = OperatorProcess(kubeconfig, namespace, tmp_path / "operator.log", resync_seconds=1).start()
    admin_api = k8s_cluster.api_client()
    custom, core = client.CustomObjectsApi(admin_api), client.CoreV1Api(admin_api)
    name = "idle"
    custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, _service(name, pool))
    processes: list[subprocess.Popen] = []

    def replicas() -> int:
        return custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)["spec"]["replicas"]

    def history_reasons() -> list[str]:
        body = custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
        return [h["reason"] for h in (body.get("status") or {}).get("scalingHistory") or []]

    try:
        (engine_ip,) = wait_for(lambda: _ready_ips(core, namespace, selector_string(name)), 60,
                                what=f"the engine pod Ready (operator log:\n{operator.log_tail()})")
        _free(engine_ip, ENGINE_PORT)
        engine = _start([*iterserve_command(), "serve", "--fake-model", "--host", engine_ip, "--port",
                         str(ENGINE_PORT)], tmp_path / "engine.log", tmp_path)
        processes.append(engine)
        wait_for(lambda: _get_ok(f"http://{engine_ip}:{ENGINE_PORT}/ready"), 60, what="the engine up")

        # Idle: no request for scaleToZeroAfterSeconds -> zero.
        wait_for(lambda: replicas() == 0, 60, what=f"spec.replicas 0 (operator log:\n{operator.log_tail()})")
        wait_for(lambda: "idle_scale_to_zero" in history_reasons(), 15, what="the decision in scalingHistory")
        engine.kill()
        engine.wait()
        wait_for(lambda: not _ready_ips(core, namespace, selector_string(name)), 30, what="no engine pod")

        # A request at zero: held by a router on a router pod's address, whose gauge the operator reads.
        router_selector = ",".join(f"{k}={v}" for k, v in router_labels(name).items())
        router_ip = wait_for(lambda: _ready_ips(core, namespace, router_selector), 60, what="a router pod")[0]
        _free(router_ip, ROUTER_PORT)
        upstream_port = free_port()  # where the engine will answer (the router's static endpoint)
        router = _start([*iterserve_command(), "router", "--host", router_ip, "--port", str(ROUTER_PORT),
                         "--endpoints", f"http://127.0.0.1:{upstream_port}", "--hold-timeout", "120"],
                        tmp_path / "router.log", tmp_path)
        processes.append(router)
        router_url = f"http://{router_ip}:{ROUTER_PORT}"
        wait_for(lambda: _get_ok(f"{router_url}/health"), 30, what="the router up")
        answer: dict[str, httpx.Response] = {}
        body = {"model": "fake", "prompt": [101] * 8, "max_tokens": 4, "ignore_eos": True}
        held = threading.Thread(target=lambda: answer.setdefault(
            "r", httpx.post(f"{router_url}/v1/completions", json=body, timeout=150)))
        held.start()
        wait_for(lambda: metric(router_url, names.ROUTER_HELD_REQUESTS) == 1, 20, what="the request held")

        wait_for(lambda: replicas() == 1, 30, what=f"spec.replicas 1 (operator log:\n{operator.log_tail()})")
        wait_for(lambda: "held_requests" in history_reasons(), 15, what="the decision in scalingHistory")
        wait_for(lambda: _ready_ips(core, namespace, selector_string(name)), 60, what="an engine pod again")
        processes.append(_start([*iterserve_command(), "serve", "--fake-model", "--host", "127.0.0.1", "--port",
                                 str(upstream_port)], tmp_path / "engine2.log", tmp_path))
        held.join(120)
        assert answer["r"].status_code == 200, answer["r"].text
        assert metric(router_url, names.ROUTER_HOLDS_TOTAL, outcome="forwarded") == 1
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
        operator.stop()
        admin_api.close()
    forbidden = [line for line in (tmp_path / "operator.log").read_text().splitlines()
                 if "Forbidden" in line or "(403)" in line]
    assert not forbidden, "\n".join(forbidden)
