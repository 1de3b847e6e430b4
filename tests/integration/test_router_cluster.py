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
from prometheus_client.parser import text_string_to_metric_families

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
        # A pod with the engine labels, made Ready by hand (no scheduler or node touches it): labels
        # prove nothing, so the router must not route to it (before the controller-chain check it did).
        pod = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": "engine-0", "labels": selector_labels("chat")},
               "spec": {"schedulerName": "nobody", "containers": [{"name": "engine", "image": "iterserve/engine:test",
                                                                "ports": [{"name": "http", "containerPort": 8000}]}]}}
        apply(k8s_cluster, pod, namespace)
        _make_ready(k8s_cluster, namespace, "engine-0", "127.10.9.9")
        wait_for(lambda: "engine-0 (no_verified_deployment)" in (tmp_path / "router.log").read_text(), 15, 0.2,
                 what=lambda: f"the router to refuse the look-alike; log: {(tmp_path / 'router.log').read_text()[-2000:]}")
        assert endpoints() == set()
        # The InferenceService's own Deployment -> ReplicaSet -> pod: that pod is routed to.
        from tests import operator_fixture as fx

        fx.install_crd(k8s_cluster)
        service = fx.example("minimal.yaml")
        service["metadata"] = {"name": "chat", "namespace": namespace}
        created = json.loads(k8s_cluster.kubectl("create", "-o", "json", "-f", "-", input=yaml.safe_dump(service)).stdout)
        deployment = {"apiVersion": "apps/v1", "kind": "Deployment",
                      "metadata": {"name": "chat", "ownerReferences": [
                          {"apiVersion": created["apiVersion"], "kind": "InferenceService", "name": "chat",
                           "uid": created["metadata"]["uid"], "controller": True}]},
                      "spec": {"replicas": 1, "selector": {"matchLabels": selector_labels("chat")},
                               "template": {"metadata": {"labels": selector_labels("chat")}, "spec": pod["spec"]}}}
        apply(k8s_cluster, deployment, namespace)
        real = wait_for(lambda: [p for p in json.loads(k8s_cluster.kubectl(
            "get", "pods", "-n", namespace, "-o", "json").stdout)["items"] if p["metadata"].get("ownerReferences")],
            30, 0.2, what="the ReplicaSet's pod")[0]["metadata"]["name"]
        _make_ready(k8s_cluster, namespace, real, "127.10.9.10")
        wait_for(lambda: endpoints() == {"http://127.10.9.10:8000"}, 15, 0.2,
                 what=lambda: f"the router to list the pod; log: {(tmp_path / 'router.log').read_text()[-2000:]}")
        k8s_cluster.kubectl("delete", "pod", real, "-n", namespace, "--grace-period=0", "--force")
        wait_for(lambda: endpoints() == set(), 15, 0.2, what="the router to drop the deleted pod")
    finally:
        proc.terminate()
        proc.wait(10)


def _make_ready(cluster, namespace: str, pod: str, ip: str) -> None:
    status = {"status": {"podIP": ip, "podIPs": [{"ip": ip}], "phase": "Running",
                         "conditions": [{"type": "Ready", "status": "True"}]}}
    cluster.kubectl("patch", "pod", pod, "-n", namespace, "--subresource=status", "--type=merge", "-p", json.dumps(status))


def _up(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


# ------------------------------------------------------------------ the operator deploys routing


@pytest.fixture
def operated(k8s_cluster, tmp_path):
    """A local-runtime node, a namespace with the operator (exactly rbac.RULES) and the pod runtime."""
    from tests import operator_fixture as fx

    with fx.operated_namespace(k8s_cluster, tmp_path, prefix="rt") as (namespace, operator, api, runner, nodes):
        yield namespace, operator, api, tmp_path


def inference_service(name: str, replicas: int = 2) -> dict:
    from iterserve.devcluster.podrunner import local_runtime_scheduling

    return {"apiVersion": "iterserve.dev/v1alpha1", "kind": "InferenceService", "metadata": {"name": name},
            "spec": {"model": {"uri": "smollm2-135m"}, "replicas": replicas,
                     "engine": {"extraArgs": ["--fake-model"], "maxNumSeqs": 8, "startupSeconds": 60,
                                "drainSeconds": 2},
                     "scheduling": local_runtime_scheduling(),
                     "podTemplatePatch": {"spec": {"containers": [{
                         "name": "engine", "startupProbe": {"periodSeconds": 1, "failureThreshold": 60},
                         "readinessProbe": {"periodSeconds": 1}}]}}}}


def test_router_mode_end_to_end_and_mode_switches(k8s_cluster, operated):
    """Router (default): the operator's router Deployment becomes Ready on the local runtime, the
    Service selects it, and requests sent to the Service's endpoint reach both engines. Gateway
    without the InferencePool CRD: RoutingUnavailable; with it: the pool, condition cleared.
    None: the router objects are gone and the Service selects the engines."""
    from kubernetes import client

    from iterserve.operator.kube import Kube
    from iterserve.operator.models import GROUP, PLURAL, VERSION
    from iterserve.router.discovery import ready_urls
    from tests.operator_fixture import wait_for as wait

    namespace, operator, api, tmp = operated
    kube, custom = Kube(api), client.CustomObjectsApi(api)
    custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, inference_service("chat"))
    router = routing.router_name("chat")
    logs = lambda: f"operator:\n{operator.log_tail()}\npods: {tmp / 'pods'}"  # noqa: E731

    def condition(type_: str) -> dict:
        body = kube.get_inference_service(namespace, "chat") or {}
        return next((c for c in (body.get("status") or {}).get("conditions", []) if c["type"] == type_), {})

    def service_urls() -> list[str]:
        """What a kube-proxy would route the Service to: its selected pods that are Ready."""
        service = kube.get("Service", namespace, "chat")
        if service is None:
            return []
        selector = ",".join(f"{k}={v}" for k, v in service["spec"]["selector"].items())
        return ready_urls(kube.list_pods(namespace, selector), "http")

    wait(lambda: condition("Ready").get("status") == "True", 120, 0.5, lambda: f"Ready; {logs()}")
    assert kube.get("Service", namespace, "chat")["spec"]["selector"] == routing.router_labels("chat")
    assert condition(routing.ROUTING_UNAVAILABLE)["reason"] == "RouterDeployed"
    router_urls = wait(lambda: len(service_urls()) == routing.ROUTER_REPLICAS and service_urls(), 30, 0.5,
                       "the Service's ready endpoints (one per router replica)")
    router_pods = kube.list_pods(namespace, ",".join(f"{k}={v}" for k, v in routing.router_labels("chat").items()))
    assert set(router_urls) == {f"http://{p['status']['podIP']}:{routing.ROUTER_PORT}" for p in router_pods}
    router_url = router_urls[0]
    engines = ready_urls(kube.list_pods(namespace, selector_string_of("chat")), "http")
    assert len(engines) == 2

    def router_endpoints() -> set[str]:
        text = httpx.get(f"{router_url}/metrics", timeout=2).text
        return {line.split('"')[1] for line in text.splitlines() if line.startswith(names.ROUTER_ENDPOINT_IN_FLIGHT + "{")}

    wait(lambda: router_endpoints() == set(engines), 30, 0.5, "the router to list both engines")
    for i in range(12):
        response = httpx.post(f"{router_url}/v1/completions", timeout=30,
                              json={"model": "fake", "prompt": f"hello {i}", "max_tokens": 4})
        assert response.status_code == 200, response.text
    served = {url: _requests_served(url) for url in engines}
    assert sum(served.values()) >= 12 and all(served.values()), served

    # Gateway without the InferencePool CRD: the condition names the fix; the router objects go.
    crd = yaml.safe_load(CRD.read_text())
    k8s_cluster.kubectl("delete", "crd", crd["metadata"]["name"], "--ignore-not-found", "--wait=true", timeout=60)
    custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "chat",
                                          {"spec": {"routing": {"mode": "Gateway"}}})
    wait(lambda: condition(routing.ROUTING_UNAVAILABLE).get("status") == "True", 30, 0.5,
         lambda: f"RoutingUnavailable=True; {logs()}")
    unavailable = condition(routing.ROUTING_UNAVAILABLE)
    assert unavailable["reason"] == "InferencePoolCRDMissing" and "install the Gateway API" in unavailable["message"]
    wait(lambda: kube.get("Deployment", namespace, router) is None and kube.get("Role", namespace, router) is None
         and kube.get("ServiceAccount", namespace, router) is None, 30, 0.5, "the router objects deleted")
    assert kube.get("Service", namespace, "chat")["spec"]["selector"] == selector_labels("chat")
    wait(lambda: len(service_urls()) >= 1, 60, 0.5, lambda: f"the Service to select the engines; {logs()}")

    k8s_cluster.kubectl("apply", "-f", str(CRD))
    k8s_cluster.kubectl("wait", "--for=condition=Established", f"crd/{crd['metadata']['name']}", "--timeout=30s")
    wait(lambda: condition(routing.ROUTING_UNAVAILABLE).get("status") == "False", 60, 0.5,
         lambda: f"RoutingUnavailable cleared; {logs()}")
    pool = kube.get("InferencePool", namespace, "chat")
    assert pool["spec"]["endpointPickerRef"]["failureMode"] == "FailOpen"

    def labelled_for_the_picker() -> bool:  # the engines roll to pods carrying the endpoint picker's label
        pods = kube.list_pods(namespace, selector_string_of("chat"))
        return bool(pods) and all(p["metadata"]["labels"].get(routing.ENGINE_TYPE_LABEL) == routing.ENGINE_TYPE_VLLM
                                  for p in pods)

    wait(labelled_for_the_picker, 120, 0.5, "engine pods labelled for the endpoint picker")
    wait(lambda: len(ready_urls(kube.list_pods(namespace, selector_string_of("chat")), "http")) == 2, 60, 0.5,
         "two ready engines after the roll")

    # None: the pool goes, the Service keeps selecting the engines.
    custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "chat",
                                          {"spec": {"routing": {"mode": "None"}}})
    wait(lambda: kube.get("InferencePool", namespace, "chat") is None, 30, 0.5, lambda: f"pool deleted; {logs()}")
    assert condition(routing.ROUTING_UNAVAILABLE)["reason"] in ("ServiceSelectsEngines", "InferencePoolApplied")
    wait(lambda: condition(routing.ROUTING_UNAVAILABLE)["reason"] == "ServiceSelectsEngines", 30, 0.5, "condition")
    assert kube.get("Deployment", namespace, router) is None


def test_switching_router_to_none_removes_the_router(k8s_cluster, operated):
    """With spec.routing.tenantHeader both router replicas salt with the one key of Secret
    solo-tenant-salt: a tenant's prefix is cached across replicas, never across tenants. Then
    Router -> None removes the router objects."""
    from kubernetes import client

    from iterserve.operator.kube import Kube
    from iterserve.operator.models import GROUP, PLURAL, VERSION
    from iterserve.router.discovery import ready_urls
    from tests.operator_fixture import wait_for as wait

    namespace, operator, api, tmp = operated
    kube, custom = Kube(api), client.CustomObjectsApi(api)
    solo = inference_service("solo", replicas=1)
    solo["spec"]["routing"] = {"tenantHeader": "X-Tenant"}
    solo["spec"]["engine"]["extraArgs"] += ["--enable-prefix-caching"]
    custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, solo)
    router = routing.router_name("solo")
    wait(lambda: kube.get("Service", namespace, "solo") is not None and
         kube.get("Service", namespace, "solo")["spec"]["selector"] == routing.router_labels("solo"), 120, 0.5,
         lambda: f"the Service on the router; operator:\n{operator.log_tail()}")
    _one_tenant_salt_for_both_router_replicas(kube, namespace, ready_urls, wait)
    custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "solo",
                                          {"spec": {"routing": {"mode": "None"}}})
    wait(lambda: all(kube.get(kind, namespace, router) is None
                     for kind in ("Deployment", "Role", "RoleBinding", "ServiceAccount", "PodDisruptionBudget")), 30, 0.5,
         lambda: f"the router objects deleted; operator:\n{operator.log_tail()}")
    assert kube.get("Service", namespace, "solo")["spec"]["selector"] == selector_labels("solo")
    # and the router pod itself goes (the garbage collector / Deployment deletion)
    wait(lambda: not kube.list_pods(namespace, ",".join(f"{k}={v}" for k, v in routing.router_labels("solo").items())),
         60, 0.5, "the router pod gone")


def _one_tenant_salt_for_both_router_replicas(kube, namespace: str, ready_urls, wait) -> None:
    """Secret solo-tenant-salt, owned by the InferenceService, mounted in both router pods; a
    prompt sent through one replica for tenant a is a prefix-cache hit through the other for
    tenant a (the two salt alike), and a miss for tenant b."""
    secret = kube.get("Secret", namespace, "solo-tenant-salt")
    assert secret is not None and [o["kind"] for o in secret["metadata"]["ownerReferences"]] == ["InferenceService"]
    selector = ",".join(f"{k}={v}" for k, v in routing.router_labels("solo").items())
    urls = wait(lambda: len(ready_urls(kube.list_pods(namespace, selector), "http")) == routing.ROUTER_REPLICAS
                and sorted(ready_urls(kube.list_pods(namespace, selector), "http")), 60, 0.5, "both router replicas ready")
    for pod in kube.list_pods(namespace, selector):
        [volume] = [v for v in pod["spec"]["volumes"] if v["name"] == "tenant-salt"]
        assert volume["secret"]["secretName"] == "solo-tenant-salt"
        args = pod["spec"]["containers"][0]["args"]
        assert args[args.index("--tenant-salt-header") + 1] == "X-Tenant" and "--tenant-salt-key-file" in args
    [engine] = wait(lambda: ready_urls(kube.list_pods(namespace, selector_string_of("solo")), "http"), 60, 0.5,
                    "the engine ready")
    body = {"model": "fake", "prompt": [(7 * i) % 250 + 3 for i in range(64)], "max_tokens": 1}

    def hits_after(url: str, tenant: str) -> float:
        response = wait(lambda: (r := httpx.post(f"{url}/v1/completions", json=body, headers={"X-Tenant": tenant},
                                                 timeout=30)).status_code == 200 and r, 30, 0.5,
                        f"a completion through {url}")
        assert response.json()["usage"]["prompt_tokens"] == 64
        return _metric(engine, names.PREFIX_CACHE_HITS_TOTAL)

    before = _metric(engine, names.PREFIX_CACHE_HITS_TOTAL)
    first, other_replica, other_tenant = hits_after(urls[0], "a"), hits_after(urls[1], "a"), hits_after(urls[1], "b")
    assert first == before  # nothing cached yet
    assert other_replica >= first + 48  # the same tenant through the other replica: 3 full blocks hit
    assert other_tenant == other_replica  # another tenant, the same prompt: no hit


def _metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=2).text
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples if s.name == name)


def selector_string_of(name: str) -> str:
    return ",".join(f"{k}={v}" for k, v in selector_labels(name).items())


def _requests_served(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=2).text
    total = 0.0
    for family in text_string_to_metric_families(text):
        total += sum(s.value for s in family.samples if s.name == names.REQUESTS_TOTAL)
    return total


def test_disaggregated_pools_on_the_local_runtime(k8s_cluster, operated):
    """spec.disaggregation: the operator runs a prefill pool and a decode pool (roles, labels, KV
    transfer port at the pod IP) and the router's P/D flags; a prompt over the threshold sent to
    the Service's router is prefilled on the prefill pod and decoded on the decode pod."""
    from kubernetes import client

    from iterserve.operator import disaggregation
    from iterserve.operator.kube import Kube
    from iterserve.operator.models import GROUP, PLURAL, VERSION
    from iterserve.router.discovery import ROLE_LABEL, ready_urls
    from tests.operator_fixture import wait_for as wait

    namespace, operator, api, tmp = operated
    kube, custom = Kube(api), client.CustomObjectsApi(api)
    body = inference_service("pd", replicas=1)
    body["spec"]["disaggregation"] = {"enabled": True, "thresholdTokens": 8, "prefill": {"replicas": 1}}
    custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, body)
    wait(lambda: kube.get("Deployment", namespace, disaggregation.prefill_name("pd")) is not None, 30, 0.5,
         lambda: f"the prefill Deployment; operator:\n{operator.log_tail()}")

    def pool(role: str) -> list[str]:
        return ready_urls(kube.list_pods(namespace, f"{selector_string_of('pd')},{ROLE_LABEL}={role}"), "http")

    wait(lambda: pool("prefill") and pool("decode"), 120, 0.5, lambda: f"both pools ready; pods: {tmp / 'pods'}")
    def body_ready() -> bool:
        found = kube.get_inference_service(namespace, "pd") or {}
        return any(c["type"] == "Ready" and c["status"] == "True" for c in found.get("status", {}).get("conditions", []))

    wait(body_ready, 60, 0.5, lambda: f"Ready; operator:\n{operator.log_tail()}")
    # The status counts come from the operator's next pass over the pods, which can trail the
    # Ready condition by a pass on a loaded machine (a CI run saw 0 right after Ready).
    wait(lambda: (kube.get_inference_service(namespace, "pd") or {}).get("status", {}).get("prefillReadyReplicas") == 1,
         60, 0.5, lambda: f"prefillReadyReplicas 1; operator:\n{operator.log_tail()}")
    router = wait(lambda: ready_urls(kube.list_pods(namespace, ",".join(
        f"{k}={v}" for k, v in routing.router_labels("pd").items())), "http"), 30, 0.5, "the router pod")[0]

    def pd_remote() -> float:
        text = httpx.get(f"{router}/metrics", timeout=2).text
        return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
                   if s.name == names.ROUTER_PD_DECISIONS_TOTAL and s.labels.get("reason") == "remote")

    def prefill_known() -> bool:
        text = httpx.get(f"{router}/metrics", timeout=2).text
        return any(pool("prefill")[0] in line for line in text.splitlines())

    wait(prefill_known, 30, 0.5, "the router to see the prefill pod")
    prompt = " ".join(f"word{i}" for i in range(64))  # well over 8 tokens
    response = httpx.post(f"{router}/v1/completions", timeout=60,
                          json={"model": "fake", "prompt": prompt, "max_tokens": 4})
    assert response.status_code == 200, response.text
    assert pd_remote() >= 1, httpx.get(f"{router}/metrics", timeout=2).text[-3000:]
    assert _requests_served(pool("decode")[0]) >= 1
