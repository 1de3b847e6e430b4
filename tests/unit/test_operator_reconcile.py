"""The drift check the reconcile uses to decide whether to write at all."""

from iterserve.operator.reconcile import first_difference

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
