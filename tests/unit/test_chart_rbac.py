"""The chart's roles grant exactly the API calls listed in operator/rbac.py: nothing missing,
nothing more, no wildcards, in both watch modes and with or without peering."""

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


def test_chart_cluster_role_grants_exactly_the_operator_calls():
    objects = render()
    [role] = of_kind(objects, "ClusterRole")
    assert granted(role) == rbac.permissions()
    assert not of_kind(objects, "Role")
    [binding] = of_kind(objects, "ClusterRoleBinding")
    [account] = of_kind(objects, "ServiceAccount")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account["metadata"]["name"],
                                    "namespace": "iterserve-system"}]


def test_chart_cluster_role_with_peering_adds_only_cluster_peering():
    [role] = of_kind(render(sets=("operator.peering.enabled=true", "operator.replicas=2")), "ClusterRole")
    assert granted(role) == rbac.permissions() | rbac.permissions(rbac.CLUSTER_PEERING_RULES)


@pytest.mark.parametrize("peering", [False, True])
def test_chart_namespaced_roles_grant_exactly_the_operator_calls(peering):
    sets = ("operator.watch.mode=namespaced", "operator.watch.namespaces={team-a,team-b}",
            f"operator.peering.enabled={str(peering).lower()}")
    objects = render(sets=sets)
    assert not of_kind(objects, "ClusterRole") and not of_kind(objects, "ClusterRoleBinding")
    roles = of_kind(objects, "Role")
    assert sorted(role["metadata"]["namespace"] for role in roles) == ["team-a", "team-b"]
    expected = rbac.permissions() | (rbac.permissions(rbac.PEERING_RULES) if peering else set())
    for role in roles:
        assert granted(role) == expected, role["metadata"]["namespace"]


def test_chart_rbac_can_be_left_to_the_user():
    objects = render(sets=("rbac.create=false", "serviceAccount.create=false", "serviceAccount.name=mine"))
    assert {obj["kind"] for obj in objects} == {"Deployment"}
    [deployment] = objects
    assert deployment["spec"]["template"]["spec"]["serviceAccountName"] == "mine"
