"""The local control plane behaves like a real cluster in everything the operator relies on:
CRD schema and CEL validation, status and scale subresources, printer columns, garbage
collection, RBAC through a ServiceAccount token, and scheduling onto KWOK GPU nodes."""

from __future__ import annotations

import ipaddress
import json
import re
import subprocess
import uuid
from pathlib import Path

import pytest
import yaml

from iterserve.devcluster import tools
from iterserve.devcluster.waiting import wait_for

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[2]
LOOPBACK = ipaddress.ip_network("127.0.0.0/8")
GROUP = "test.iterserve.dev"

WIDGET_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": f"widgets.{GROUP}"},
    "spec": {
        "group": GROUP,
        "scope": "Namespaced",
        "names": {"plural": "widgets", "singular": "widget", "kind": "Widget", "shortNames": ["wdg"]},
        "versions": [{
            "name": "v1alpha1",
            "served": True,
            "storage": True,
            "subresources": {
                "status": {},
                "scale": {
                    "specReplicasPath": ".spec.replicas",
                    "statusReplicasPath": ".status.replicas",
                    "labelSelectorPath": ".status.selector",
                },
            },
            "additionalPrinterColumns": [
                {"name": "Model", "type": "string", "jsonPath": ".spec.model"},
                {"name": "Replicas", "type": "integer", "jsonPath": ".spec.replicas"},
                {"name": "Ready", "type": "integer", "jsonPath": ".status.replicas"},
                {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
            ],
            "schema": {"openAPIV3Schema": {
                "type": "object",
                "properties": {
                    "spec": {
                        "type": "object",
                        "required": ["model"],
                        "properties": {
                            "model": {"type": "string", "minLength": 1},
                            "replicas": {"type": "integer", "minimum": 0},
                            "minReplicas": {"type": "integer", "minimum": 0},
                            "maxReplicas": {"type": "integer", "minimum": 1},
                        },
                        "x-kubernetes-validations": [{
                            "rule": "self.minReplicas <= self.maxReplicas",
                            "message": "minReplicas must not exceed maxReplicas",
                            "fieldPath": ".minReplicas",
                        }],
                    },
                    "status": {
                        "type": "object",
                        "properties": {"replicas": {"type": "integer"}, "selector": {"type": "string"}},
                    },
                },
            }},
        }],
    },
}


def widget(name: str, **spec) -> dict:
    spec = {"model": "smollm2-135m", "replicas": 1, "minReplicas": 1, "maxReplicas": 4, **spec}
    return {"apiVersion": f"{GROUP}/v1alpha1", "kind": "Widget", "metadata": {"name": name}, "spec": spec}


@pytest.fixture(scope="module")
def cluster(k8s_cluster):
    return k8s_cluster


@pytest.fixture
def namespace(cluster):
    name = f"t-{uuid.uuid4().hex[:8]}"
    cluster.kubectl("create", "namespace", name)
    wait_for(lambda: cluster.kubectl("get", "serviceaccount", "default", "-n", name, check=False).returncode == 0,
             what=f"ServiceAccount default in {name}")
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture(scope="module")
def widget_crd(cluster):
    cluster.kubectl("apply", "-f", "-", input=json.dumps(WIDGET_CRD))
    cluster.kubectl("wait", "--for=condition=Established", f"crd/widgets.{GROUP}", "--timeout=30s")
    # Discovery can lag behind Established by a moment.
    wait_for(lambda: cluster.kubectl("get", "widgets", "-A", check=False).returncode == 0, what="widgets discovery")
    return WIDGET_CRD


@pytest.fixture(scope="module")
def gpu_nodes(cluster):
    names = [f"cluster-test-gpu-{i}" for i in range(2)]
    for name in names:
        cluster.add_gpu_node(name, gpus=8, labels={"iterserve.dev/pool": "cluster-test"})
    return names


def apply(cluster, obj: dict, namespace: str, check: bool = True):
    return cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(obj), check=check)


def get_json(cluster, *args: str) -> dict:
    return json.loads(cluster.kubectl("get", *args, "-o", "json").stdout)


def test_fixture_starts_within_a_minute(cluster):
    if cluster.startup_seconds is None:
        pytest.skip("using an existing cluster from ITERSERVE_TEST_KUBECONFIG")
    assert cluster.startup_seconds < 60
    assert ipaddress.ip_address(cluster.api_url.split("//")[1].rsplit(":", 1)[0]) in LOOPBACK


def test_cel_rule_rejects_invalid_object_naming_the_field(cluster, widget_crd, namespace):
    result = apply(cluster, widget("bad", minReplicas=5, maxReplicas=2), namespace, check=False)
    assert result.returncode != 0
    assert "spec.minReplicas" in result.stderr
    assert "minReplicas must not exceed maxReplicas" in result.stderr

    result = apply(cluster, widget("negative", replicas=-1), namespace, check=False)
    assert result.returncode != 0
    assert "spec.replicas" in result.stderr and "greater than or equal to 0" in result.stderr

    apply(cluster, widget("good"), namespace)
    assert get_json(cluster, "widget", "good", "-n", namespace)["spec"]["maxReplicas"] == 4


def test_printer_columns_status_and_scale_subresources(cluster, widget_crd, namespace):
    apply(cluster, widget("w1", replicas=2), namespace)
    cluster.kubectl("patch", "widget", "w1", "-n", namespace, "--subresource=status", "--type=merge",
                    "-p", json.dumps({"status": {"replicas": 2, "selector": "app=w1"}}))

    table = cluster.kubectl("get", "widgets", "-n", namespace).stdout.splitlines()
    assert table[0].split() == ["NAME", "MODEL", "REPLICAS", "READY", "AGE"]
    assert table[1].split()[:4] == ["w1", "smollm2-135m", "2", "2"]

    cluster.kubectl("scale", "widget", "w1", "-n", namespace, "--replicas=3")
    scale_url = f"/apis/{GROUP}/v1alpha1/namespaces/{namespace}/widgets/w1/scale"
    scale = json.loads(cluster.kubectl("get", "--raw", scale_url).stdout)
    assert scale["kind"] == "Scale"
    assert scale["spec"]["replicas"] == 3
    assert scale["status"] == {"replicas": 2, "selector": "app=w1"}
    assert get_json(cluster, "widget", "w1", "-n", namespace)["spec"]["replicas"] == 3

    # With the status subresource, a main-resource update cannot change status.
    cluster.kubectl("patch", "widget", "w1", "-n", namespace, "--type=merge", "-p", '{"status": {"replicas": 9}}')
    assert get_json(cluster, "widget", "w1", "-n", namespace)["status"]["replicas"] == 2


def test_gpu_deployment_gets_running_pods_with_loopback_ips_on_kwok_nodes(cluster, gpu_nodes, namespace):
    labels = {"app": "engine"}
    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": "engine"},
        "spec": {
            "replicas": 2,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "nodeSelector": {"iterserve.dev/pool": "cluster-test"},
                    "containers": [{
                        "name": "engine", "image": "iterserve/engine:test",
                        "resources": {"limits": {"nvidia.com/gpu": "1"}},
                    }],
                },
            },
        },
    }
    apply(cluster, deployment, namespace)

    def running_pods():
        pods = get_json(cluster, "pods", "-n", namespace, "-l", "app=engine")["items"]
        running = [p for p in pods if p["status"].get("phase") == "Running" and p["status"].get("podIP")]
        return running if len(running) == 2 else None

    pods = wait_for(running_pods, timeout=45, what="2 Running engine pods")
    for pod in pods:
        assert ipaddress.ip_address(pod["status"]["podIP"]) in LOOPBACK
        assert pod["spec"]["nodeName"] in gpu_nodes
    assert len({p["status"]["podIP"] for p in pods}) == 2
    wait_for(lambda: get_json(cluster, "deployment", "engine", "-n", namespace)["status"].get("readyReplicas") == 2,
             what="Deployment readyReplicas == 2")

    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "engine"},
               "spec": {"selector": labels, "ports": [{"port": 8000}]}}
    apply(cluster, service, namespace)
    cluster_ip = get_json(cluster, "service", "engine", "-n", namespace)["spec"]["clusterIP"]
    assert ipaddress.ip_address(cluster_ip) in LOOPBACK


def test_pod_asking_for_more_gpus_than_any_node_has_stays_pending(cluster, gpu_nodes, namespace):
    nodes = get_json(cluster, "nodes")["items"]
    most = max(int(n["status"].get("allocatable", {}).get("nvidia.com/gpu", 0)) for n in nodes)
    pod = {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "too-big"},
        "spec": {"containers": [{"name": "engine", "image": "iterserve/engine:test",
                                 "resources": {"limits": {"nvidia.com/gpu": str(most + 1)}}}]},
    }
    apply(cluster, pod, namespace)

    def unschedulable():
        status = get_json(cluster, "pod", "too-big", "-n", namespace)["status"]
        scheduled = next((c for c in status.get("conditions", []) if c["type"] == "PodScheduled"), None)
        return (status, scheduled) if scheduled and scheduled.get("reason") == "Unschedulable" else None

    status, scheduled = wait_for(unschedulable, what="the scheduler to mark the pod Unschedulable")
    assert status["phase"] == "Pending"
    assert "Insufficient nvidia.com/gpu" in scheduled["message"]


def test_service_account_kubeconfig_has_exactly_its_rbac(cluster, namespace):
    cluster.kubectl("create", "serviceaccount", "reader", "-n", namespace)
    cluster.kubectl("create", "role", "configmap-reader", "-n", namespace, "--verb=get,list", "--resource=configmaps")
    cluster.kubectl("create", "rolebinding", "reader", "-n", namespace, "--role=configmap-reader",
                    f"--serviceaccount={namespace}:reader")
    kubeconfig = cluster.service_account_kubeconfig("reader", namespace)

    whoami = json.loads(cluster.kubectl("auth", "whoami", "-o", "json", kubeconfig=kubeconfig).stdout)
    assert whoami["status"]["userInfo"]["username"] == f"system:serviceaccount:{namespace}:reader"
    assert cluster.kubectl("get", "configmaps", "-n", namespace, kubeconfig=kubeconfig).returncode == 0
    denied = cluster.kubectl("get", "secrets", "-n", namespace, kubeconfig=kubeconfig, check=False)
    assert denied.returncode != 0 and "Forbidden" in denied.stderr
    denied = cluster.kubectl("get", "configmaps", "-n", "default", kubeconfig=kubeconfig, check=False)
    assert denied.returncode != 0 and "Forbidden" in denied.stderr


INFSVC_CRD = REPO / "crds" / "inferenceservice.yaml"


@pytest.mark.skipif(not INFSVC_CRD.exists(), reason="crds/inferenceservice.yaml not written yet")
def test_inferenceservice_crd_validates_prints_and_scales(cluster, namespace):
    cluster.kubectl("apply", "-f", str(REPO / "crds"))
    crd = next(d for d in yaml.safe_load_all(INFSVC_CRD.read_text()) if d)
    cluster.kubectl("wait", "--for=condition=Established", f"crd/{crd['metadata']['name']}", "--timeout=30s")
    wait_for(lambda: cluster.kubectl("get", "infsvc", "-A", check=False).returncode == 0, what="infsvc discovery")

    samples = {}
    for path in sorted((REPO / "examples").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == "InferenceService":
                cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(doc))
                samples[doc["metadata"]["name"]] = doc
    assert samples, "examples/ has no InferenceService sample"

    columns = [c["name"].upper() for c in crd["spec"]["versions"][0]["additionalPrinterColumns"]]
    header = cluster.kubectl("get", "infsvc", "-n", namespace, "-o", "wide").stdout.splitlines()[0]
    assert re.match(r"NAME\s+" + r"\s+".join(map(re.escape, columns)) + r"$", header), (columns, header)

    name = next(iter(samples))
    cluster.kubectl("scale", "infsvc", name, "-n", namespace, "--replicas=3")
    assert get_json(cluster, "infsvc", name, "-n", namespace)["spec"]["replicas"] == 3

    invalid = json.loads(json.dumps(samples[name]))
    invalid["metadata"]["name"] = "invalid"
    invalid["spec"]["autoscaling"] = {"minReplicas": 5, "maxReplicas": 2}
    result = cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(invalid), check=False)
    assert result.returncode != 0
    assert "spec.autoscaling.minReplicas" in result.stderr


def test_helm_binary_works():
    helm = tools.tool("helm")
    result = subprocess.run([str(helm), "version", "--short"], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("v4.3.")


# Last among the Widget tests: the older the CRD, the sooner the garbage collector knows it.
def test_deleting_owner_garbage_collects_owned_objects(cluster, widget_crd, namespace):
    apply(cluster, widget("owner"), namespace)
    owner = get_json(cluster, "widget", "owner", "-n", namespace)
    owned = {
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": "owned", "ownerReferences": [{
            "apiVersion": owner["apiVersion"], "kind": "Widget", "name": "owner",
            "uid": owner["metadata"]["uid"], "controller": True, "blockOwnerDeletion": True,
        }]},
        "data": {"k": "v"},
    }
    apply(cluster, owned, namespace)
    apply(cluster, {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "unowned"}}, namespace)

    cluster.kubectl("delete", "widget", "owner", "-n", namespace)
    # The garbage collector rediscovers API resources every 30 s (fixed in the controller
    # manager), so for a CRD this young collection can take that long plus a retry backoff.
    wait_for(lambda: cluster.kubectl("get", "configmap", "owned", "-n", namespace, check=False).returncode != 0,
             timeout=90, what="garbage collection of the owned ConfigMap")
    assert cluster.kubectl("get", "configmap", "unowned", "-n", namespace).returncode == 0
