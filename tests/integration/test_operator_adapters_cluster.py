"""spec.adapters on the real control plane, with real-model engine pods run by the local pod
runtime: the adapters in the spec are in every replica's /v1/models; one added to the spec is
loaded on the running pods (same pod UIDs and start times: no restart), one removed is unloaded,
and status.adapters and the Events say so; one whose source is bad fails to load, and the
ConfigMap new pods start from leaves it out."""

from __future__ import annotations

import httpx
import pytest

from iterserve.operator.adapters import FAILED, LOADED, UNLOADED
from iterserve.operator.models import GROUP, PLURAL, VERSION
from iterserve.operator.resources import selector_string
from tests.lora_fixture import write_adapter
from tests.operator_fixture import wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


@pytest.fixture
def operated(k8s_cluster, tmp_path):
    """A local-runtime node, a namespace with the operator (exactly rbac.RULES) and the pod runtime."""
    from tests import operator_fixture as fx

    with fx.operated_namespace(k8s_cluster, tmp_path, prefix="lora") as (namespace, operator, api, runner, nodes):
        yield namespace, operator, api, tmp_path


def test_adapters_in_the_spec_are_served_by_every_replica_and_follow_the_spec_live(operated):
    from kubernetes import client

    from iterserve.devcluster.podrunner import local_runtime_scheduling
    from iterserve.operator.kube import Kube

    namespace, operator, api, tmp = operated
    for i in range(2):
        write_adapter(tmp / f"ad{i}", 4, ("q_proj", "v_proj"), seed=i)
    kube, custom = Kube(api), client.CustomObjectsApi(api)
    spec = {"model": {"uri": "smollm2-135m"}, "replicas": 2, "routing": {"mode": "None"},
            "adapters": [{"name": "ad0", "source": str(tmp / "ad0")}],
            "engine": {"maxModelLen": 128, "maxNumSeqs": 4, "kvCacheMemory": "64MiB", "startupSeconds": 300,
                       "drainSeconds": 2, "extraArgs": ["--dtype", "float32", "--max-lora-rank", "8"]},
            "scheduling": local_runtime_scheduling(),
            "podTemplatePatch": {"spec": {"containers": [{
                "name": "engine", "startupProbe": {"periodSeconds": 1, "failureThreshold": 300},
                "readinessProbe": {"periodSeconds": 1}}]}}}
    custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, {
        "apiVersion": f"{GROUP}/{VERSION}", "kind": "InferenceService", "metadata": {"name": "tuned"}, "spec": spec})
    logs = lambda: f"operator:\n{operator.log_tail()}\npods: {tmp / 'pods'}"  # noqa: E731

    def pods() -> dict[str, tuple[str, str, str]]:
        """Ready engine pods: name -> (uid, start time, base URL)."""
        out = {}
        for pod in kube.list_pods(namespace, selector_string("tuned")):
            status = pod.get("status") or {}
            ready = any(c["type"] == "Ready" and c["status"] == "True" for c in status.get("conditions") or [])
            if ready and status.get("podIP") and not pod["metadata"].get("deletionTimestamp"):
                out[pod["metadata"]["name"]] = (pod["metadata"]["uid"], status.get("startTime"),
                                                f"http://{status['podIP']}:8000")
        return out

    def adapters_served() -> dict[str, set[str]]:
        return {name: {m["id"] for m in httpx.get(f"{url}/v1/models", timeout=5).json()["data"]
                       if m.get("parent")} for name, (_, _, url) in pods().items()}

    def status_entries() -> list[dict]:
        body = kube.get_inference_service(namespace, "tuned") or {}
        return (body.get("status") or {}).get("adapters") or []

    def status_adapters() -> dict[str, list[str]]:
        return {e["pod"]: e["loaded"] for e in status_entries()}

    def events() -> list[str]:
        listed = client.CoreV1Api(api).list_namespaced_event(namespace, field_selector="involvedObject.name=tuned")
        return [e.reason for e in listed.items]

    started = wait_for(lambda: len(pods()) == 2 and pods(), 300, 1, lambda: f"two ready engines; {logs()}")
    assert adapters_served() == {name: {"ad0"} for name in started}  # from --lora-modules at start
    wait_for(lambda: status_adapters() == {name: ["ad0"] for name in started}, 30, 0.5,
             lambda: f"status.adapters {status_adapters()}; {logs()}")

    spec["adapters"].append({"name": "ad1", "source": str(tmp / "ad1")})
    custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "tuned", {"spec": spec})
    wait_for(lambda: adapters_served() == {name: {"ad0", "ad1"} for name in started}, 60, 0.5,
             lambda: f"ad1 on every pod: {adapters_served()}; {logs()}")
    assert pods() == started  # same pods, same start times: loaded live, nothing restarted
    wait_for(lambda: status_adapters() == {name: ["ad0", "ad1"] for name in started}, 30, 0.5,
             lambda: f"status.adapters {status_adapters()}")
    wait_for(lambda: LOADED in events(), 30, 0.5, lambda: f"an {LOADED} Event: {events()}")
    configmap = kube.get("ConfigMap", namespace, "tuned-engine")
    assert configmap["data"]["lora_modules"] == f"ad0={tmp / 'ad0'} ad1={tmp / 'ad1'}"  # what new pods start with

    spec["adapters"] = [{"name": "ad1", "source": str(tmp / "ad1")}]
    custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "tuned", {"spec": spec})
    wait_for(lambda: adapters_served() == {name: {"ad1"} for name in started}, 60, 0.5,
             lambda: f"ad0 unloaded everywhere: {adapters_served()}; {logs()}")
    assert pods() == started
    wait_for(lambda: status_adapters() == {name: ["ad1"] for name in started}, 30, 0.5,
             lambda: f"status.adapters {status_adapters()}")
    wait_for(lambda: UNLOADED in events(), 30, 0.5, lambda: f"an {UNLOADED} Event: {events()}")
    # a bad source: the load fails on the running pods, and new pods would start without it
    spec["adapters"].append({"name": "bad", "source": str(tmp / "nowhere")})
    custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "tuned", {"spec": spec})
    wait_for(lambda: {e["pod"]: e.get("failed") for e in status_entries()} == {name: ["bad"] for name in started},
             30, 0.5, lambda: f"the failed load in status: {status_entries()}; {logs()}")
    assert all("adapter_config.json" in e["error"] for e in status_entries())
    wait_for(lambda: FAILED in events(), 30, 0.5, lambda: f"an {FAILED} Event: {events()}")
    assert kube.get("ConfigMap", namespace, "tuned-engine")["data"]["lora_modules"] == f"ad1={tmp / 'ad1'}"
    assert pods() == started and adapters_served() == {name: {"ad1"} for name in started}
    url = next(iter(started.values()))[2]
    answer = httpx.post(f"{url}/v1/completions", timeout=120,
                        json={"model": "ad1", "prompt": "Hello", "max_tokens": 2, "temperature": 0})
    assert answer.status_code == 200, answer.text
