"""The chart's roles grant exactly the API calls listed in operator/rbac.py: nothing missing,
nothing more, no wildcards, in both watch modes and with or without peering. The aggregated
ClusterRoles give Kubernetes' default edit/admin and view roles the InferenceService verbs."""

from __future__ import annotations

import pytest

from iterserve.operator import rbac
from tests.unit.chart_tools import of_kind, render

pytestmark = pytest.mark.cluster  # needs helm from `make cluster-tools`


def granted(role: dict) -> set[tuple[str, str, str]]:
    triples = set()
    for rule in role["rules"]:
        assert not rule.get("nonResourceURLs") and not rule.get("resourceNames"), rule
        for field in ("apiGroups", "resources", "verbs"):
            assert "*" not in rule[field], f"wildcard in {role['kind']} {role['metadata']['name']}: {rule}"
        triples |= {(group, resource, verb) for group in rule["apiGroups"]
                    for resource in rule["resources"] for verb in rule["verbs"]}
    return triples


AGGREGATE = "rbac.authorization.k8s.io/aggregate-to-"


def operator_cluster_roles(objects: list[dict]) -> list[dict]:
    return [r for r in of_kind(objects, "ClusterRole")
            if not any(key.startswith(AGGREGATE) for key in r["metadata"].get("labels", {}))]


def test_chart_cluster_role_grants_exactly_the_operator_calls():
    objects = render()
    [role] = operator_cluster_roles(objects)
    assert granted(role) == rbac.permissions()
    assert not of_kind(objects, "Role")
    [binding] = of_kind(objects, "ClusterRoleBinding")
    [account] = of_kind(objects, "ServiceAccount")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account["metadata"]["name"],
                                    "namespace": "iterserve-system"}]


def test_chart_cluster_role_with_peering_adds_only_cluster_peering():
    [role] = operator_cluster_roles(render(sets=("operator.peering.enabled=true", "operator.replicas=2")))
    assert granted(role) == rbac.permissions() | rbac.permissions(rbac.CLUSTER_PEERING_RULES)


@pytest.mark.parametrize("peering", [False, True])
def test_chart_namespaced_roles_grant_exactly_the_operator_calls(peering):
    sets = ("operator.watch.mode=namespaced", "operator.watch.namespaces={team-a,team-b}",
            f"operator.peering.enabled={str(peering).lower()}")
    objects = render(sets=sets)
    assert not operator_cluster_roles(objects) and not of_kind(objects, "ClusterRoleBinding")
    roles = of_kind(objects, "Role")
    assert sorted(role["metadata"]["namespace"] for role in roles) == ["team-a", "team-b"]
    expected = rbac.permissions() | (rbac.permissions(rbac.PEERING_RULES) if peering else set())
    for role in roles:
        assert granted(role) == expected, role["metadata"]["namespace"]


def test_chart_rbac_can_be_left_to_the_user():
    objects = render(sets=("rbac.create=false", "serviceAccount.create=false", "serviceAccount.name=mine"))
    assert {obj["kind"] for obj in objects} == {"Deployment", "ValidatingAdmissionPolicy",
                                                 "ValidatingAdmissionPolicyBinding"}
    [deployment] = of_kind(objects, "Deployment")
    assert deployment["spec"]["template"]["spec"]["serviceAccountName"] == "mine"


def test_chart_aggregates_inference_service_verbs_into_the_default_roles():
    roles = {r["metadata"]["name"]: r for r in of_kind(render(), "ClusterRole")}
    edit, view = roles["iterserve-edit"], roles["iterserve-view"]
    assert edit["metadata"]["labels"][f"{AGGREGATE}edit"] == "true"
    assert edit["metadata"]["labels"][f"{AGGREGATE}admin"] == "true"
    assert view["metadata"]["labels"][f"{AGGREGATE}view"] == "true"
    assert ("iterserve.dev", "inferenceservices", "create") in granted(edit)
    assert ("iterserve.dev", "inferenceservices/scale", "patch") in granted(edit)
    assert ("iterserve.dev", "inferenceservices/status", "patch") not in granted(edit)  # the operator's
    assert {verb for _, _, verb in granted(view)} == {"get", "list", "watch"}
    none = render(sets=("rbac.aggregateToDefaultRoles=false",))
    assert {r["metadata"]["name"] for r in of_kind(none, "ClusterRole")} == {"iterserve"}
