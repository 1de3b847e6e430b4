"""Routing on the real control plane: the rendered InferencePool is accepted by the API server,
and `iterserve router --infsvc` finds an InferenceService's Ready pods with nothing more than the
Role operator/routing.py gives it (get/list/watch pods in its namespace)."""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from pathlib import Path

import httpx
import pytest
import yaml

from iterserve.devcluster.waiting import free_port, wait_for
from iterserve.engine import metrics as names
from iterserve.operator import routing
from iterserve.operator.models import InferenceServiceSpec
from iterserve.operator.resources import Owner, selector_labels
from tests.server_fixture import iterserve_command

pytestmark = [pytest.mark.cluster, pytest.mark.slow]
# A stand-in written for these tests (see its header); ITERSERVE_INFERENCEPOOL_CRD: the upstream one.
CRD = Path(os.environ.get("ITERSERVE_INFERENCEPOOL_CRD", Path(__file__).with_name("inferencepool_crd.yaml")))


@pytest.fixture
def namespace(k8s_cluster):
    name = f"r-{uuid.uuid4().hex[:8]}"
    k8s_cluster.kubectl("create", "namespace", name)
    wait_for(lambda: k8s_cluster.kubectl("get", "serviceaccount", "default", "-n", name, check=False).returncode == 0,
             what=f"ServiceAccount default in {name}")
    yield name
    k8s_cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


def apply(cluster, obj: dict, namespace: str, check: bool = True):
    return cluster.kubectl("apply", "--server-side", "-n", namespace, "-f", "-", input=json.dumps(obj), check=check)


def spec(mode: str) -> InferenceServiceSpec:
    return InferenceServiceSpec.model_validate({"model": {"uri": "smollm2-135m"}, "routing": {"mode": mode}})


def test_rendered_inference_pool_is_accepted(k8s_cluster, namespace):
    crd = yaml.safe_load(CRD.read_text())
    k8s_cluster.kubectl("apply", "-f", str(CRD))
    k8s_cluster.kubectl("wait", "--for=condition=Established", f"crd/{crd['metadata']['name']}", "--timeout=30s")
    wait_for(lambda: k8s_cluster.kubectl("get", "inferencepools", "-A", check=False).returncode == 0,
             what="inferencepools discovery")
    owner = Owner("chat", namespace, "uid-1")
    (pool,) = routing.build_routing(owner, spec("Gateway"))
    pool["metadata"].pop("ownerReferences")  # no real owner object in this test
    apply(k8s_cluster, pool, namespace)
    stored = json.loads(k8s_cluster.kubectl("get", "inferencepool", "chat", "-n", namespace, "-o", "json").stdout)
    assert stored["spec"]["endpointPickerRef"]["failureMode"] == "FailOpen"
    assert stored["spec"]["selector"]["matchLabels"] == selector_labels("chat")
    bad = json.loads(json.dumps(pool))
    bad["metadata"]["name"] = "bad"
    bad["spec"]["endpointPickerRef"]["failureMode"] = "Sometimes"
    refused = apply(k8s_cluster, bad, namespace, check=False)
    assert refused.returncode != 0 and "failureMode" in refused.stderr


def test_router_discovers_ready_pods_with_its_own_role(k8s_cluster, namespace, tmp_path):
    owner = Owner("chat", namespace, "uid-1")
    for obj in routing.build_router_rbac(owner):
        obj["metadata"].pop("ownerReferences")
        apply(k8s_cluster, obj, namespace)
    kubeconfig = k8s_cluster.service_account_kubeconfig(routing.router_name("chat"), namespace)
    denied = k8s_cluster.kubectl("get", "pods", "-n", "default", kubeconfig=kubeconfig, check=False)
    assert denied.returncode != 0 and "Forbidden" in denied.stderr

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with open(tmp_path / "router.log", "wb") as log:
        proc = subprocess.Popen([*iterserve_command(), "router", "--infsvc", "chat", "-n", namespace,
                                 "--kubeconfig", str(kubeconfig), "--port", str(port)],
                                stdout=log, stderr=subprocess.STDOUT, cwd="/")
    try:
        def endpoints() -> set[str]:
            try:
                text = httpx.get(f"{url}/metrics", timeout=2).text
            except httpx.HTTPError:
                return set()
            return {line.split('"')[1] for line in text.splitlines()
                    if line.startswith(names.ROUTER_ENDPOINT_IN_FLIGHT + "{")}

        wait_for(lambda: proc.poll() is not None or _up(url), 30, 0.2, what="router up")
        assert proc.poll() is None, (tmp_path / "router.log").read_text()
        assert endpoints() == set()
        # A pod with the engine labels, made Ready by hand (no scheduler or node touches it): the
        # watch must see it.
        pod = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": "engine-0", "labels": selector_labels("chat")},
               "spec": {"schedulerName": "nobody", "containers": [{"name": "engine", "image": "iterserve/engine:test",
                                                                "ports": [{"name": "http", "containerPort": 8000}]}]}}
        apply(k8s_cluster, pod, namespace)
        status = {"status": {"podIP": "127.10.9.9", "podIPs": [{"ip": "127.10.9.9"}], "phase": "Running",
                             "conditions": [{"type": "Ready", "status": "True"}]}}
        k8s_cluster.kubectl("patch", "pod", "engine-0", "-n", namespace, "--subresource=status", "--type=merge",
                            "-p", json.dumps(status))
        wait_for(lambda: endpoints() == {"http://127.10.9.9:8000"}, 15, 0.2,
                 what=lambda: f"the router to list the pod; log: {(tmp_path / 'router.log').read_text()[-2000:]}")
        k8s_cluster.kubectl("delete", "pod", "engine-0", "-n", namespace, "--grace-period=0", "--force")
        wait_for(lambda: endpoints() == set(), 15, 0.2, what="the router to drop the deleted pod")
    finally:
        proc.terminate()
        proc.wait(10)


def _up(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
