"""The local pod runtime against the real control plane: a pod that asks for it on a labelled
KWOK node becomes a real `iterserve serve` process on its 127.10.x.y IP, Ready only while /ready
passes, restarted (restartCount, lastState) when the process dies, and on deletion drained
(preStop, SIGTERM) with the pod object removed only after the process has exited."""

from __future__ import annotations

import ipaddress
import json
import os
import re
import signal
import subprocess
import threading
import time
import uuid

import httpx
import pytest
import yaml

from iterserve.devcluster.cluster import process_alive
from iterserve.devcluster.podrunner import (
    PodRunner,
    add_local_runtime_node,
    local_runtime_scheduling,
)
from tests.operator_fixture import wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

POD = "engine-0"
TOKEN = "admin-token-for-tests"


def pod_manifest(namespace: str) -> dict:
    return {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": POD, "namespace": namespace},
        "spec": {
            **local_runtime_scheduling(),
            "terminationGracePeriodSeconds": 30,
            "containers": [{
                "name": "engine", "image": "ghcr.io/iterserve/engine:0.1.0", "command": ["iterserve", "serve"],
                "args": ["--fake-model", "--host", "0.0.0.0", "--port", "8000", "--max-num-seqs", "$(SEQS)",
                         "--served-model-name", "$(MODEL_NAME)", "--drain-timeout", "20"],
                "ports": [{"name": "http", "containerPort": 8000}],
                "envFrom": [{"configMapRef": {"name": "engine-env"}}],
                "env": [{"name": "SEQS", "valueFrom": {"configMapKeyRef": {"name": "engine", "key": "max_num_seqs"}}},
                        {"name": "ITERSERVE_ADMIN_TOKEN",
                         "valueFrom": {"secretKeyRef": {"name": "engine-admin", "key": "token"}}}],
                "readinessProbe": {"httpGet": {"path": "/ready", "port": "http"}, "periodSeconds": 1,
                                   "failureThreshold": 1},
                "lifecycle": {"preStop": {"sleep": {"seconds": 1}}},
            }],
        },
    }


@pytest.fixture(scope="module")
def runtime(k8s_cluster, tmp_path_factory):
    from kubernetes import client

    namespace = f"pods-{uuid.uuid4().hex[:6]}"
    node = f"local-{uuid.uuid4().hex[:6]}"
    add_local_runtime_node(k8s_cluster, node, gpus=2)
    k8s_cluster.kubectl("create", "namespace", namespace)
    objects = [
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "engine"}, "data": {"max_num_seqs": "7"}},
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "engine-env"}, "data": {"MODEL_NAME": "tiny-fake"}},
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "engine-admin"}, "stringData": {"token": TOKEN}},
    ]
    k8s_cluster.kubectl("-n", namespace, "apply", "-f", "-", input=yaml.safe_dump_all(objects))
    logs = tmp_path_factory.mktemp("pod-logs")
    api = k8s_cluster.api_client()
    runner = PodRunner(k8s_cluster.api_client(), logs, namespaces=[namespace]).start()
    core = client.CoreV1Api(api)
    core.create_namespaced_pod(namespace, pod_manifest(namespace))
    try:
        yield core, namespace, runner, logs
    finally:
        runner.stop()
        k8s_cluster.kubectl("delete", "namespace", namespace, "--wait=false")
        k8s_cluster.kubectl("delete", "node", node, "--wait=false")
        api.close()


def read_pod(core, namespace):
    return core.read_namespaced_pod(POD, namespace)


def pod_when(core, namespace, predicate):
    """A waiter: the pod, once predicate(pod) holds."""
    def check():
        pod = read_pod(core, namespace)
        return pod if predicate(pod) else None
    return check


def is_ready(pod) -> bool:
    return any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])


def container_pid(pod) -> int:
    return int(pod.status.container_statuses[0].container_id.removeprefix("local://"))


def admin(pod, method: str, path: str) -> httpx.Response:
    return httpx.request(method, f"http://{pod.status.pod_ip}:8000{path}",
                         headers={"Authorization": f"Bearer {TOKEN}"}, timeout=5)


def test_pod_becomes_a_ready_engine_process_on_its_pod_ip(runtime):
    core, namespace, _, logs = runtime
    pod = wait_for(pod_when(core, namespace, is_ready), 90, 0.3, "the pod Ready")
    assert ipaddress.ip_address(pod.status.pod_ip) in ipaddress.ip_network("127.10.0.0/16")
    assert pod.status.phase == "Running"
    pid = container_pid(pod)
    cmdline = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
    assert b"serve" in cmdline and pod.status.pod_ip.encode() in cmdline
    # env from a configMapKeyRef expanded into args, envFrom, and the secretKeyRef'd admin token all reached it
    assert admin(pod, "GET", "/admin/config").json()["max_num_seqs"] == 7
    models = httpx.get(f"http://{pod.status.pod_ip}:8000/v1/models", timeout=5).json()
    assert [m["id"] for m in models["data"]] == ["tiny-fake"]
    assert "--served-model-name tiny-fake" in (logs / f"{namespace}_{POD}_engine.log").read_text()


def test_ready_follows_the_real_readiness_probe(runtime):
    core, namespace, _, _ = runtime
    pod = read_pod(core, namespace)
    assert admin(pod, "POST", "/admin/drain").status_code == 202  # the engine's /ready turns false
    pod = wait_for(pod_when(core, namespace, lambda p: not is_ready(p)), 15, 0.2, "Ready=False")
    assert pod.status.phase == "Running" and process_alive(container_pid(pod))
    assert pod.status.container_statuses[0].ready is False


def test_process_death_restarts_the_container(runtime):
    core, namespace, _, _ = runtime
    old_pid = container_pid(read_pod(core, namespace))
    os.kill(old_pid, signal.SIGKILL)

    def restarted_and_ready(pod):
        return pod.status.container_statuses[0].restart_count == 1 and is_ready(pod)

    pod = wait_for(pod_when(core, namespace, restarted_and_ready), 90, 0.3, "a restart and Ready again")
    status = pod.status.container_statuses[0]
    assert status.last_state.terminated.exit_code == 137
    assert container_pid(pod) != old_pid and not process_alive(old_pid)
    assert admin(pod, "GET", "/admin/config").json()["draining"] is False


def test_a_foreign_not_ready_mark_is_put_right(runtime):
    """The node lifecycle controller marks pods unready when their node misses heartbeats; the
    runtime, like a kubelet, writes its own view back while the probe still passes."""
    core, namespace, _, _ = runtime
    core.patch_namespaced_pod_status(POD, namespace, {"status": {"conditions": [
        {"type": "Ready", "status": "False", "reason": "NodeNotReady"}]}})
    pod = wait_for(pod_when(core, namespace, is_ready), 10, 0.2, "Ready=True again")
    assert pod.status.container_statuses[0].restart_count == 1  # nothing was restarted for it


def waiting_state(pod):
    statuses = pod.status.container_statuses or []
    return statuses[0].state.waiting if statuses and statuses[0].state.waiting else None


@pytest.mark.parametrize("case", ["crd-writes-a-file", "pythonpath"])
def test_a_pod_that_would_run_other_code_is_refused(runtime, k8s_cluster, tmp_path, case):
    """`iterserve crd -o FILE` would write a file of the pod's choosing; PYTHONPATH would make the
    engine import code of the pod's choosing. Neither starts; the status says why."""
    core, namespace, runner, _ = runtime
    target, planted = tmp_path / "written-by-the-pod.yaml", tmp_path / "planted"
    planted.mkdir()
    (planted / "sitecustomize.py").write_text(f"open({str(tmp_path / 'imported')!r}, 'w').write('x')\n")
    manifest = pod_manifest(namespace)
    name = manifest["metadata"]["name"] = f"evil-{case}"
    container = manifest["spec"]["containers"][0]
    if case == "crd-writes-a-file":
        container["command"], container["args"] = ["iterserve", "crd", "-o", str(target)], []
        expected = "only runs `iterserve serve`"
    else:
        container["env"].append({"name": "PYTHONPATH", "value": str(planted)})
        expected = "env PYTHONPATH: the local runtime refuses"
    core.create_namespaced_pod(namespace, manifest)
    try:
        def refused():
            state = waiting_state(core.read_namespaced_pod(name, namespace))
            return state if state is not None and state.reason != "ContainerCreating" else None

        state = wait_for(refused, 30, 0.2, "the refusal in the container status")
        assert expected in state.message and state.reason in ("RunContainerError", "CreateContainerConfigError")
        time.sleep(1.5)  # the worker retries every second: still refused, nothing ran
        worker = runner.worker_for(namespace, name)
        assert worker is not None and worker.process is None
        assert not target.exists() and not (tmp_path / "imported").exists()
        assert core.read_namespaced_pod(name, namespace).status.phase == "Pending"
    finally:
        core.delete_namespaced_pod(name, namespace, grace_period_seconds=0)


def test_pods_of_other_namespaces_are_left_alone(runtime, k8s_cluster):
    core, namespace, runner, _ = runtime
    other = f"{namespace}-other"
    k8s_cluster.kubectl("create", "namespace", other)
    try:
        for ns in (namespace, other):
            k8s_cluster.kubectl("-n", ns, "apply", "-f", "-", input=yaml.safe_dump_all([
                {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "engine"}, "data": {"max_num_seqs": "7"}},
                {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "engine-env"},
                 "data": {"MODEL_NAME": "tiny-fake"}},
                {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "engine-admin"},
                 "stringData": {"token": TOKEN}}]))
        manifest = pod_manifest(other)
        core.create_namespaced_pod(other, manifest)
        wait_for(lambda: core.read_namespaced_pod(POD, other).spec.node_name, 30, 0.2, "the pod scheduled")
        time.sleep(3)
        assert runner.worker_for(other, POD) is None
        pod = core.read_namespaced_pod(POD, other)
        assert not pod.status.container_statuses and pod.status.phase == "Pending"
    finally:
        core.delete_namespaced_pod(POD, other, grace_period_seconds=0)
        k8s_cluster.kubectl("delete", "namespace", other, "--wait=false")


def test_deletion_drains_in_flight_requests_and_removes_the_pod_only_after_exit(runtime):
    from kubernetes.client.exceptions import ApiException

    core, namespace, _, _ = runtime
    pod = read_pod(core, namespace)
    pid, url = container_pid(pod), f"http://{pod.status.pod_ip}:8000"
    outcome: dict = {}

    def long_request():
        body = {"model": "tiny-fake", "prompt": "hi", "max_tokens": 1500, "ignore_eos": True, "stream": True}
        tokens, outcome["done"] = 0, False
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
            outcome["status"] = response.status_code
            for line in response.iter_lines():
                if line.startswith("data:") and line != "data: [DONE]":
                    tokens += 1
                if line == "data: [DONE]":
                    outcome["done"] = True
        outcome["tokens"], outcome["ended"] = tokens, time.monotonic()

    client = threading.Thread(target=long_request)
    client.start()
    running = re.compile(r"^llm_scheduler_running_seqs(\{[^}]*\})? 1(\.0)?$", re.M)
    wait_for(lambda: running.search(httpx.get(f"{url}/metrics", timeout=5).text), 10, 0.1, "the request running")
    core.delete_namespaced_pod(POD, namespace)
    exited = gone = None
    deadline = time.monotonic() + 60
    while gone is None and time.monotonic() < deadline:
        if exited is None and not process_alive(pid):
            exited = time.monotonic()
        try:
            pod = read_pod(core, namespace)
            assert exited is not None or pod.metadata.deletion_timestamp is not None
        except ApiException as error:
            assert error.status == 404
            gone = time.monotonic()
        time.sleep(0.05)
    client.join(30)
    assert gone is not None, "the pod object was never removed"
    assert exited is not None and exited <= gone, "the pod object went before its process exited"
    assert outcome["status"] == 200 and outcome["done"] and outcome["tokens"] >= 1500, outcome
    assert outcome["ended"] <= exited + 0.5  # the request finished inside the drain, before the exit


@pytest.mark.image
def test_container_mode_runs_the_pods_image_with_exec_probes_prestop_and_cleanup(k8s_cluster, tmp_path):
    """--container-runtime podman: the pod is `podman run` of its image; an exec readiness probe and
    an exec preStop run inside it (`podman exec`), SIGTERM reaches it at deletion, and the container
    is removed with the pod (the emptyDir folder keeps what the preStop wrote)."""
    from kubernetes import client

    from iterserve.devcluster import podman
    from iterserve.devcluster.podrunner.container import container_name
    from tests.image_fixture import built_image

    image = built_image("the container-mode pod test")
    namespace, node = f"ctr-{uuid.uuid4().hex[:6]}", f"ctr-{uuid.uuid4().hex[:6]}"
    add_local_runtime_node(k8s_cluster, node, gpus=1)
    k8s_cluster.kubectl("create", "namespace", namespace)
    manifest = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": POD}, "spec": {
        **local_runtime_scheduling(), "terminationGracePeriodSeconds": 20, "automountServiceAccountToken": False,
        "securityContext": {"runAsUser": 10001, "runAsGroup": 10001, "runAsNonRoot": True},
        "containers": [{
            "name": "engine", "image": image, "command": ["iterserve", "serve"],
            "args": ["--fake-model", "--port", "8000", "--drain-timeout", "5"],
            "ports": [{"name": "http", "containerPort": 8000}],
            "readinessProbe": {"exec": {"command": ["cat", "/tmp/ready-flag"]}, "periodSeconds": 1},
            "lifecycle": {"preStop": {"exec": {"command": ["touch", "/tmp/prestop-ran"]}}},
            "securityContext": {"readOnlyRootFilesystem": True, "allowPrivilegeEscalation": False,
                                "capabilities": {"drop": ["ALL"]}},
            "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}]}],
        "volumes": [{"name": "tmp", "emptyDir": {}}]}}
    api = k8s_cluster.api_client()
    core = client.CoreV1Api(api)
    runner = PodRunner(k8s_cluster.api_client(), tmp_path / "logs", namespaces=[namespace],
                       work_dir=tmp_path / "work", container_runtime="podman").start()
    name = None
    try:
        core.create_namespaced_pod(namespace, manifest)
        pod = wait_for(pod_when(core, namespace, lambda p: p.status.container_statuses
                                and p.status.container_statuses[0].state.running), 60, 0.3, "the container running")
        name = container_name({"metadata": {"namespace": namespace, "name": POD, "uid": pod.metadata.uid}})
        assert json.loads(subprocess.run(["podman", "inspect", name], capture_output=True, env=podman.podman_env(),
                                         timeout=30, check=True).stdout)[0]["ImageName"] == image

        def answering():
            try:
                return httpx.get(f"http://{pod.status.pod_ip}:8000/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(answering, 120, 0.5, "the engine in the container answering")
        time.sleep(2)
        assert not is_ready(read_pod(core, namespace)), "Ready before the exec probe could pass"
        subprocess.run(["podman", "exec", name, "touch", "/tmp/ready-flag"], check=True, env=podman.podman_env(),
                       timeout=30)
        wait_for(pod_when(core, namespace, is_ready), 30, 0.3, "Ready once the exec probe passes")
        core.delete_namespaced_pod(POD, namespace)
        wait_for(lambda: not core.list_namespaced_pod(namespace).items, 60, 0.3, "the pod object removed")
        assert (tmp_path / "work" / f"{namespace}_{POD}" / "volumes" / "tmp" / "prestop-ran").exists()
        assert "drained" in (tmp_path / "logs" / f"{namespace}_{POD}_engine.log").read_text()  # SIGTERM reached it
        exists = subprocess.run(["podman", "container", "exists", name], env=podman.podman_env(), timeout=30)
        assert exists.returncode == 1, "the container outlived its pod"
    finally:
        runner.stop()
        k8s_cluster.kubectl("delete", "namespace", namespace, "--wait=false")
        k8s_cluster.kubectl("delete", "node", node, "--wait=false")
        api.close()
