"""The engines' NetworkPolicy (operator/network_policy.py) as built and as the reconcile applies
it: in Router mode the HTTP port only from the router pods and the configured peers, the KV ports
(one per rank of tensor x pipeline) only from the same InferenceService's decode pods, other ports closed; open HTTP where clients reach the
engines directly; none (and the old one deleted) with --no-network-policy; peers parsed strictly."""

from __future__ import annotations

import copy

import pytest

from iterserve.operator import network_policy as np
from iterserve.operator.reconcile import Reconciler
from iterserve.operator.resources import Owner
from iterserve.operator.validation import parse_spec
from tests.unit.test_operator_value_flow import MemoryKube

OWNER = Owner("llm", "ns", "u1")
OPERATOR = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "iterserve-system"}},
            "podSelector": {"matchLabels": {"app.kubernetes.io/name": "iterserve"}}}
SETTINGS = np.NetworkPolicySettings(True, (OPERATOR,))
ENGINES = {"app.kubernetes.io/name": "iterserve-engine", "app.kubernetes.io/instance": "llm"}


def _build(**spec):
    return np.build_for(OWNER, parse_spec({"model": {"uri": "m"}, **spec}), SETTINGS)


def test_in_router_mode_http_is_open_only_to_the_router_and_the_peers():
    [policy] = _build()
    assert policy["kind"] == "NetworkPolicy" and policy["metadata"]["name"] == "llm-engines"
    assert policy["metadata"]["ownerReferences"][0]["uid"] == "u1"
    assert policy["spec"]["podSelector"] == {"matchLabels": ENGINES}
    assert policy["spec"]["policyTypes"] == ["Ingress"]  # every port not listed is closed
    [http] = policy["spec"]["ingress"]
    assert http["ports"] == [{"protocol": "TCP", "port": 8000}]
    assert http["from"] == [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "iterserve-router",
                                                             "app.kubernetes.io/instance": "llm"}}}, OPERATOR]


@pytest.mark.parametrize("mode", ["None", "Gateway"])
def test_where_clients_reach_the_engines_directly_http_stays_open(mode):
    [policy] = _build(routing={"mode": mode})
    [http] = policy["spec"]["ingress"]
    assert "from" not in http and http["ports"] == [{"protocol": "TCP", "port": 8000}]


def test_the_kv_port_is_open_only_to_the_decode_pods_of_the_same_service():
    [policy] = _build(disaggregation={"enabled": True, "kvTransferPort": 8100})
    kv = policy["spec"]["ingress"][1]
    assert kv == {"from": [{"podSelector": {"matchLabels": {**ENGINES, "iterserve.dev/role": "decode"}}}],
                  "ports": [{"protocol": "TCP", "port": 8100}]}


def test_the_kv_range_is_one_port_per_rank_of_tensor_x_pipeline():
    """Rank r of a TP=2 x PP=3 engine (six ranks, whichever stage) listens on kvTransferPort + r."""
    [policy] = _build(engine={"parallelism": {"tensor": 2, "pipeline": 3}},
                      disaggregation={"enabled": True, "kvTransferPort": 8100})
    kv = policy["spec"]["ingress"][1]
    assert kv["ports"] == [{"protocol": "TCP", "port": 8100, "endPort": 8105}]
    assert len(policy["spec"]["ingress"]) == 2  # one pod per replica: no members' rule


def test_the_reconcile_applies_it_once_and_deletes_it_when_turned_off():
    spec = {"model": {"uri": "smollm2-135m"}, "replicas": 1}
    kube = MemoryKube(copy.deepcopy(spec))
    reconciler = Reconciler(kube, network=SETTINGS)
    reconciler.reconcile("ns", "llm")
    reconciler.reconcile("ns", "llm")  # the Service moves to the now ready router
    assert kube.writes.count(("NetworkPolicy", "llm-engines")) == 1
    assert kube.objects[("NetworkPolicy", "llm-engines")]["spec"]["ingress"][0]["from"][1] == OPERATOR
    Reconciler(kube, network=np.NetworkPolicySettings(enabled=False)).reconcile("ns", "llm")
    assert ("NetworkPolicy", "llm-engines") not in kube.objects


@pytest.mark.parametrize("text,problem", [
    ("not json", "not JSON"),
    ('{"ipBlock": {"cidr": "0.0.0.0/0"}}', "namespaceSelector and/or podSelector"),
    ("{}", "namespaceSelector and/or podSelector"),
    ('{"podSelector": {"matchFields": {}}}', "label selector"),
])
def test_a_bad_peer_is_refused_naming_the_flag(text, problem):
    with pytest.raises(ValueError, match=problem) as error:
        np.parse_peer(text)
    assert "--network-policy-peer" in str(error.value)


def test_a_good_peer_round_trips():
    import json

    assert np.parse_peer(json.dumps(OPERATOR)) == OPERATOR
