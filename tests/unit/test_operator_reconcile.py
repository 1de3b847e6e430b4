"""The drift check the reconcile uses to decide whether to write at all, and the order it applies
the wanted objects in."""

from iterserve.operator.reconcile import first_difference, wanted_objects
from iterserve.operator.resources import Owner
from iterserve.operator.validation import parse_spec

LIVE = {
    "metadata": {"name": "llm", "labels": {"a": "1", "added-by-someone": "x"}, "resourceVersion": "7"},
    "spec": {"replicas": 2, "template": {"spec": {
        "containers": [{"name": "engine", "image": "img:1", "resources": {"limits": {"memory": "2Gi"}},
                        "terminationMessagePath": "/dev/termination-log"},
                       {"name": "sidecar", "image": "s"}],
        "tolerations": [{"key": "k", "operator": "Exists"}]}}},
}


def desired(**changes):
    spec = {"replicas": 2, "template": {"spec": {
        "containers": [{"name": "engine", "image": "img:1", "resources": {"limits": {"memory": "2Gi"}}}],
        "tolerations": [{"key": "k", "operator": "Exists"}]}}}
    spec.update(changes)
    return {"metadata": {"name": "llm", "labels": {"a": "1"}}, "spec": spec}


def test_server_defaults_and_foreign_additions_are_not_drift():
    assert first_difference(desired(), LIVE) is None


def test_changed_field_is_named():
    assert first_difference(desired(replicas=3), LIVE) == ".spec.replicas"
    want = desired()
    want["spec"]["template"]["spec"]["containers"][0]["image"] = "img:2"
    assert first_difference(want, LIVE) == ".spec.template.spec.containers[engine].image"


def test_missing_object_parts_and_list_items_are_drift():
    want = desired()
    want["spec"]["template"]["spec"]["tolerations"].append({"key": "gpu", "operator": "Exists"})
    assert first_difference(want, LIVE) == ".spec.template.spec.tolerations"
    assert first_difference({"data": {"x": "1"}}, {"metadata": {}}) == ".data"


def test_numbers_written_as_strings_match():
    assert first_difference({"limits": {"nvidia.com/gpu": 1}}, {"limits": {"nvidia.com/gpu": "1"}}) is None


class ConflictingKube:
    """Answers the first status patch with 409, as when the autoscaler wrote status meanwhile."""

    def __init__(self):
        self.fresh = {"metadata": {"namespace": "ns", "name": "llm", "resourceVersion": "2"},
                      "status": {"conditions": [{"type": "MetricsAvailable", "status": "True"}]}}
        self.patches = []

    def patch_status(self, namespace, name, status, resource_version):
        from kubernetes.client.exceptions import ApiException

        self.patches.append((resource_version, status))
        if len(self.patches) == 1:
            raise ApiException(status=409, reason="Conflict")
        return {"metadata": {**self.fresh["metadata"], "resourceVersion": "3"}, "status": status}

    def get_inference_service(self, namespace, name):
        return self.fresh


def test_status_conflict_is_retried_with_fresh_state():
    from iterserve.operator.reconcile import Reconciler

    kube = ConflictingKube()
    stale = {"metadata": {"namespace": "ns", "name": "llm", "resourceVersion": "1"}, "status": {}}
    seen = []

    def compute(previous):
        seen.append(previous)
        return {"replicas": 1, "conditions": [*previous.get("conditions", []), {"type": "Ready", "status": "True"}]}

    body, wrote = Reconciler(kube).write_status(stale, compute)
    assert wrote and [rv for rv, _ in kube.patches] == ["1", "2"]
    assert seen[1] == kube.fresh["status"]  # recomputed from what the other writer left
    assert [c["type"] for c in kube.patches[1][1]["conditions"]] == ["MetricsAvailable", "Ready"]


def test_status_already_current_is_not_written():
    from iterserve.operator.reconcile import Reconciler

    kube = ConflictingKube()
    body = {"metadata": {"namespace": "ns", "name": "llm", "resourceVersion": "5"}, "status": {"replicas": 1}}
    assert Reconciler(kube).write_status(body, lambda prev: {"replicas": 1}) == (body, False)
    assert kube.patches == []


def test_the_wanted_objects_come_in_apply_order():
    """The ConfigMap before the pods that read it, the NetworkPolicy before any pod, the router
    before the Service that may select it, and the prefill pool last."""
    spec = parse_spec({"model": {"uri": "m"}, "routing": {"mode": "Router"}, "disaggregation": {"enabled": True}})
    objects = wanted_objects(Owner("llm", "ns", "uid-1"), spec, 16, router_serving=False, pool_served=True)
    kinds = [(o["kind"], o["metadata"]["name"]) for o in objects]
    assert kinds[0] == ("ConfigMap", "llm-engine")
    assert kinds[-3:] == [("Service", "llm"), ("Deployment", "llm"), ("Deployment", "llm-prefill")]
    router = kinds.index(("Deployment", "llm-router"))
    assert kinds.index(("Role", "llm-router")) < kinds.index(("RoleBinding", "llm-router")) < router
    assert all(kinds.index(k) < router for k in kinds if k[0] == "NetworkPolicy")
    aggregated = wanted_objects(Owner("llm", "ns", "uid-1"), parse_spec({"model": {"uri": "m"}}), 16, False, True)
    assert "llm-prefill" not in [o["metadata"]["name"] for o in aggregated]
