"""Which pods belong to an InferenceService (iterserve/controller_chain.py): only a pod the
Deployment controller made, through our Deployment's ReplicaSet, running that ReplicaSet's
template. Each forgery a tenant with pod-create rights can make is refused with its reason."""

from __future__ import annotations

import copy

import pytest

from iterserve import controller_chain as chain

TEMPLATE = {"containers": [{"name": "engine", "image": "ghcr.io/iterserve/engine:1", "command": ["iterserve", "serve"],
                            "args": ["--model", "m"], "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}]}],
            "volumes": [{"name": "tmp", "emptyDir": {}}]}
DEPLOYMENT = {"metadata": {"name": "llm", "uid": "dep", "ownerReferences": [
    {"kind": "InferenceService", "name": "llm", "uid": "isvc", "controller": True}]}}
REPLICA_SET = {"metadata": {"name": "llm-abc", "uid": "rs", "labels": {"pod-template-hash": "abc"},
                            "creationTimestamp": "2026-01-01T00:00:00Z",
                            "ownerReferences": [{"kind": "Deployment", "uid": "dep", "controller": True}]},
               "spec": {"template": {"spec": TEMPLATE}}}


def pod(name="llm-abc-1", owner=("ReplicaSet", "rs"), hash_="abc", created="2026-01-01T00:00:05Z", spec=None):
    refs = [{"kind": owner[0], "uid": owner[1], "controller": True}] if owner else []
    return {"metadata": {"name": name, "labels": {"pod-template-hash": hash_}, "ownerReferences": refs,
                         "creationTimestamp": created},
            "spec": copy.deepcopy(spec if spec is not None else TEMPLATE)}


def _other_args():
    spec = copy.deepcopy(TEMPLATE)
    spec["containers"][0]["args"] = ["--model", "attacker/weights"]
    return spec


def _extra_container():
    spec = copy.deepcopy(TEMPLATE)
    spec["containers"].append({"name": "sniffer", "image": "evil"})
    return spec


def _host_volume():
    spec = copy.deepcopy(TEMPLATE)
    spec["volumes"] = [{"name": "tmp", "persistentVolumeClaim": {"claimName": "attacker"}}]
    return spec


FORGERIES = [
    (pod(owner=None), chain.NOT_OUR_REPLICA_SET),
    (pod(owner=("ReplicaSet", "someone-elses")), chain.NOT_OUR_REPLICA_SET),
    (pod(owner=("Deployment", "dep")), chain.NOT_OUR_REPLICA_SET),
    (pod(hash_="forged"), chain.HASH_MISMATCH),
    (pod(created="2025-12-31T23:59:59Z"), chain.PREDATES_REPLICA_SET),
    (pod(spec=_other_args()), chain.SPEC_MISMATCH),
    (pod(spec=_extra_container()), chain.SPEC_MISMATCH),
    (pod(spec=_host_volume()), chain.SPEC_MISMATCH),
]


@pytest.mark.parametrize("forged,reason", FORGERIES,
                         ids=["no-owner", "other-rs", "owner-deployment", "hash", "predates", "args", "sidecar", "volume"])
def test_each_forgery_is_refused_with_its_reason(forged, reason):
    verified, refused = chain.verify([pod(), forged], [DEPLOYMENT], [REPLICA_SET])
    assert [p["metadata"]["name"] for p in verified] == ["llm-abc-1"]
    assert [r.reason for r in refused] == [reason]


def test_a_replica_set_not_owned_by_our_deployment_verifies_nothing():
    stranger_rs = copy.deepcopy(REPLICA_SET)
    stranger_rs["metadata"]["ownerReferences"][0]["uid"] = "other-deployment"
    assert chain.verify([pod()], [DEPLOYMENT], [stranger_rs])[0] == []
    assert chain.verify([pod()], [], [REPLICA_SET])[1] == [chain.Refused("llm-abc-1", chain.NO_DEPLOYMENT)]


def test_the_deployment_must_be_the_inference_services():
    assert chain.deployment_is_owned(DEPLOYMENT, "llm")
    assert chain.deployment_is_owned(DEPLOYMENT, "llm", "isvc")
    assert not chain.deployment_is_owned(DEPLOYMENT, "llm", "other-uid")
    assert not chain.deployment_is_owned(DEPLOYMENT, "chat")
    assert not chain.deployment_is_owned({"metadata": {"name": "llm"}}, "llm")
    assert not chain.deployment_is_owned(None, "llm")


def test_the_routers_chain_reader_rereads_for_an_unknown_owner_but_at_most_once_a_second():
    from iterserve.router.discovery import ChainReader

    now = [0.0]
    reader = ChainReader(None, "ns", "llm", "sel", clock=lambda: now[0])
    reads = []
    reader._read = lambda: (reads.append(now[0]), ([DEPLOYMENT], [REPLICA_SET]))[1]
    assert [p["metadata"]["name"] for p in reader.verified([pod()])] == ["llm-abc-1"]
    reader.verified([pod()])
    assert reads == [0.0]  # known owner, fresh read: no API call
    made_up = pod(name="spam", owner=("ReplicaSet", "made-up"))
    for _ in range(50):
        assert [p["metadata"]["name"] for p in reader.verified([pod(), made_up])] == ["llm-abc-1"]
    assert reads == [0.0]  # an unknown owner within the minimum interval: still no call
    now[0] = 1.5
    reader.verified([pod(), made_up])
    assert reads == [0.0, 1.5]


def test_the_service_account_volume_admission_adds_to_pods_does_not_count_as_a_difference():
    spec = copy.deepcopy(TEMPLATE)
    spec["volumes"].append({"name": "kube-api-access-x7k2p", "projected": {"sources": [{"serviceAccountToken": {}}]}})
    spec["containers"][0]["volumeMounts"].append({"name": "kube-api-access-x7k2p", "readOnly": True,
                                                  "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount"})
    verified, refused = chain.verify([pod(spec=spec)], [DEPLOYMENT], [REPLICA_SET])
    assert len(verified) == 1 and refused == []
