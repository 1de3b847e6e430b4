"""spec.routing through the reconcile (on an in-memory Kube): what each mode applies, what a mode
switch deletes, the Service's selector, the RoutingUnavailable condition, and never adopting."""

from __future__ import annotations

import copy

from iterserve.operator import routing
from iterserve.operator.reconcile import Reconciler
from iterserve.operator.resources import selector_labels
from tests.unit.test_operator_value_flow import MemoryKube

ROUTER_OBJECTS = {("ServiceAccount", "llm-router"), ("Role", "llm-router"), ("RoleBinding", "llm-router"),
                  ("Deployment", "llm-router"), ("PodDisruptionBudget", "llm-router")}


def kube_for(mode: str | None) -> MemoryKube:
    spec = {"model": {"uri": "m"}, "replicas": 1,
            "scheduling": {"nodeSelector": {"pool": "gpu"}, "tolerations": [{"key": "gpu", "operator": "Exists"}]}}
    if mode is not None:
        spec["routing"] = {"mode": mode}
    return MemoryKube(spec)


def condition(kube: MemoryKube, type_: str) -> dict:
    return next(c for c in kube.body["status"]["conditions"] if c["type"] == type_)


def set_mode(kube: MemoryKube, mode: str) -> None:
    kube.body["spec"]["routing"] = {"mode": mode}
    kube.body["metadata"]["generation"] += 1


def test_router_mode_deploys_the_router_and_the_service_moves_to_it_once_it_is_ready():
    kube = kube_for(None)  # Router is the default
    reconciler = Reconciler(kube)
    reconciler.reconcile("ns", "llm")
    assert ROUTER_OBJECTS <= set(kube.objects)
    # the router was not ready when the Service was written: it still selects the engines
    assert kube.objects[("Service", "llm")]["spec"]["selector"] == selector_labels("llm")
    assert kube.writes.index(("Deployment", "llm-router")) < kube.writes.index(("Deployment", "llm"))
    router = kube.objects[("Deployment", "llm-router")]
    pod = router["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "llm-router" and pod["nodeSelector"] == {"pool": "gpu"}
    assert pod["tolerations"] == [{"key": "gpu", "operator": "Exists"}]
    assert kube.objects[("Role", "llm-router")]["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
        {"apiGroups": ["apps"], "resources": ["replicasets"], "verbs": ["list"]},
        {"apiGroups": ["apps"], "resources": ["deployments"], "verbs": ["get"], "resourceNames": ["llm", "llm-prefill"]},
        {"apiGroups": ["apps"], "resources": ["statefulsets", "controllerrevisions"], "verbs": ["list"]},
        {"apiGroups": ["leaderworkerset.x-k8s.io"], "resources": ["leaderworkersets"], "verbs": ["get"],
         "resourceNames": ["llm", "llm-prefill"]}]

    reconciler.reconcile("ns", "llm")  # MemoryKube's Deployments are ready at once
    assert kube.objects[("Service", "llm")]["spec"]["selector"] == routing.router_labels("llm")
    assert condition(kube, "RoutingUnavailable")["status"] == "False"
    assert condition(kube, "Ready")["status"] == "True"
    kube.writes.clear()
    reconciler.reconcile("ns", "llm")
    assert kube.writes == []  # level-triggered: nothing to do


def test_ready_waits_for_a_router_pod():
    kube = kube_for("Router")
    reconciler = Reconciler(kube)
    reconciler.reconcile("ns", "llm")
    kube.objects[("Deployment", "llm-router")]["status"] = {"replicas": 1, "readyReplicas": 0}
    reconciler.reconcile("ns", "llm")
    ready = condition(kube, "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "RouterNotReady")


def test_switching_router_to_none_moves_the_service_first_then_deletes_the_router_objects():
    kube = kube_for("Router")
    reconciler = Reconciler(kube)
    reconciler.reconcile("ns", "llm")
    reconciler.reconcile("ns", "llm")
    set_mode(kube, "None")
    kube.writes.clear()
    moved = reconciler.reconcile("ns", "llm")
    # First the Service moves to the engines; the router keeps serving what it holds ...
    assert kube.objects[("Service", "llm")]["spec"]["selector"] == selector_labels("llm")
    assert ROUTER_OBJECTS <= set(kube.objects) and not [c for c in moved.changes if c.startswith("deleted")]
    # ... and only a later pass, which finds the Service moved already, removes it (it drains).
    outcome = reconciler.reconcile("ns", "llm")
    assert not ROUTER_OBJECTS & set(kube.objects)
    written = [w for w, _ in kube.writes]
    assert written.index("Service") < written.index("delete Deployment")
    assert {c for c in outcome.changes if c.startswith("deleted")} == {
        f"deleted {kind} {name} (spec.routing.mode is None)" for kind, name in ROUTER_OBJECTS}
    assert "Deleted" in kube.events
    assert condition(kube, "RoutingUnavailable")["reason"] == "ServiceSelectsEngines"


def test_gateway_without_the_crd_says_so_and_with_it_applies_the_pool():
    kube = kube_for("Gateway")
    reconciler = Reconciler(kube)
    reconciler.reconcile("ns", "llm")
    missing = condition(kube, "RoutingUnavailable")
    assert (missing["status"], missing["reason"]) == ("True", "InferencePoolCRDMissing")
    assert "install the Gateway API Inference Extension" in missing["message"]
    assert "spec.routing.mode" in missing["message"] and kube.events.count("InferencePoolCRDMissing") == 1
    assert ("InferencePool", "llm") not in kube.objects and not ROUTER_OBJECTS & set(kube.objects)
    labels = kube.objects[("Deployment", "llm")]["spec"]["template"]["metadata"]["labels"]
    assert labels[routing.ENGINE_TYPE_LABEL] == routing.ENGINE_TYPE_VLLM
    assert kube.objects[("Service", "llm")]["spec"]["selector"] == selector_labels("llm")

    kube.served = True  # the CRD got installed
    reconciler.reconcile("ns", "llm")
    pool = kube.objects[("InferencePool", "llm")]
    assert pool["spec"]["endpointPickerRef"]["failureMode"] == "FailOpen"
    cleared = condition(kube, "RoutingUnavailable")
    assert (cleared["status"], cleared["reason"]) == ("False", "InferencePoolApplied")
    assert "RoutingAvailable" in kube.events

    set_mode(kube, "None")
    reconciler.reconcile("ns", "llm")
    assert ("InferencePool", "llm") not in kube.objects
    labels = kube.objects[("Deployment", "llm")]["spec"]["template"]["metadata"]["labels"]
    assert routing.ENGINE_TYPE_LABEL not in labels


def test_a_router_deployment_that_is_not_ours_is_never_adopted_nor_deleted():
    kube = kube_for("Router")
    foreign = {"apiVersion": "apps/v1", "kind": "Deployment",
               "metadata": {"name": "llm-router", "namespace": "ns", "resourceVersion": "1", "uid": "other"},
               "spec": {"replicas": 3}}
    kube.objects[("Deployment", "llm-router")] = copy.deepcopy(foreign)
    outcome = Reconciler(kube).reconcile("ns", "llm")
    assert outcome.result == "conflict" and "Deployment ns/llm-router" in outcome.changes[0]
    assert kube.objects[("Deployment", "llm-router")] == foreign
    set_mode(kube, "None")  # not wanted and not ours: left alone
    assert Reconciler(kube).reconcile("ns", "llm").result == "applied"
    assert kube.objects[("Deployment", "llm-router")] == foreign


def test_router_queue_settings_reach_the_router_flags_and_the_pod_runtime_accepts_them(tmp_path):
    from iterserve.devcluster.podrunner.launch import build_launch
    from iterserve.operator.models import InferenceServiceSpec
    from iterserve.operator.resources import Owner

    owner = Owner("llm", "ns", "u1")
    plain = routing.build_router_deployment(owner, InferenceServiceSpec.model_validate({"model": {"uri": "m"}}))
    assert "--max-queue" not in plain["spec"]["template"]["spec"]["containers"][0]["args"]  # the router's default
    spec = InferenceServiceSpec.model_validate({"model": {"uri": "m"},
                                                "routing": {"maxQueue": 1000, "queueTimeoutSeconds": 60}})
    deployment = routing.build_router_deployment(owner, spec)
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--max-queue") + 1] == "1000" and args[args.index("--queue-timeout") + 1] == "60"
    pod = {"metadata": {"name": "llm-router-x", "namespace": "ns", "uid": "p1"},
           "spec": deployment["spec"]["template"]["spec"], "status": {"podIP": "127.10.0.9"}}
    launch = build_launch(pod, lambda *a: None, lambda *a: None, tmp_path,
                          token_kubeconfig=lambda p, sa, folder: folder / f"{sa}.kubeconfig")
    assert launch.argv[5] == "router" and launch.argv[-1] == str(tmp_path / "llm-router.kubeconfig")
