"""Prefill/decode disaggregation with multi-node groups (spec.engine.parallelism.nodes 2): each
pool a set of groups of its own (StatefulSets NAME-g<i> and NAME-prefill-g<i>, or two
LeaderWorkerSets), every member started with its pool's role and the KV transfer flags, one KV
port per rank of tensor x pipeline declared and opened to the decode pods only, the pools' own replica counts
and scale paths, and the router and the autoscaler reaching the leaders of both pools."""

from __future__ import annotations

import copy

import pytest

from iterserve import controller_chain as chain
from iterserve.labels import DECODE, GROUP_LABEL, POD_INDEX_LABEL, PREFILL, ROLE_LABEL, is_leader
from iterserve.operator import groups
from iterserve.operator import network_policy as np
from iterserve.operator.reconcile import Reconciler
from iterserve.operator.resources import Owner, selector_labels
from iterserve.operator.validation import SpecError, parse_spec
from tests.unit.test_operator_groups import GroupKube, member

OWNER = Owner("llm", "ns", "u1")
KV_PORT = 8100
SPEC = {"model": {"uri": "smollm2-135m"}, "replicas": 2, "routing": {"mode": "Router"},
        "engine": {"parallelism": {"tensor": 4, "nodes": 2}, "resources": {"limits": {"nvidia.com/gpu": 1}}},
        "disaggregation": {"enabled": True, "kvTransferPort": KV_PORT,
                           "prefill": {"replicas": 1, "minReplicas": 1, "maxReplicas": 3}}}
ENGINES = selector_labels("llm")


def _raw(**changes) -> dict:
    raw = copy.deepcopy(SPEC)
    raw.update(changes)
    return raw


def _engine(template: dict) -> dict:
    return template["spec"]["containers"][0]


def _arg(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def test_each_pool_is_groups_of_its_own_whose_members_run_its_role_and_the_kv_flags():
    service, *sets = groups.build_groups(OWNER, parse_spec(_raw()), lws=False)
    assert service["metadata"]["name"] == "llm-group" and service["spec"]["selector"] == ENGINES  # both pools' DNS
    assert [(s["metadata"]["name"], s["spec"]["replicas"]) for s in sets] == [
        ("llm-g0", 2), ("llm-g1", 2), ("llm-prefill-g0", 2)]  # two decode groups, one prefill group, 2 nodes each
    ports = set()
    for sts in sets:
        name, template = sts["metadata"]["name"], sts["spec"]["template"]
        role = PREFILL if name.startswith("llm-prefill") else DECODE
        assert sts["spec"]["serviceName"] == "llm-group"
        assert sts["spec"]["selector"]["matchLabels"] == {**ENGINES, GROUP_LABEL: name}
        labels = template["metadata"]["labels"]
        assert labels[ROLE_LABEL] == role and labels[GROUP_LABEL] == name
        assert labels["app.kubernetes.io/component"] == ("engine-prefill" if role == PREFILL else "engine")
        engine = _engine(template)
        args = engine["args"]
        # one template serves every member, leader and worker: all of them get the role and KV flags
        assert _arg(args, "--role") == role and _arg(args, "--kv-transfer-port") == str(KV_PORT)
        assert _arg(args, "--kv-advertise-host") == "$(POD_IP)"  # each node's ranks advertise their own pod IP
        assert "--kv-auth-key-file" in args
        assert _arg(args, "--nnodes") == "2" and _arg(args, "--node-rank") == "$(ITERSERVE_NODE_RANK)"
        assert _arg(args, "--master-addr") == f"{name}-0.llm-group"
        assert _arg(args, "--tensor-parallel-size") == "4"
        assert {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in engine["env"]
        assert "kv-auth" in [m["name"] for m in engine["volumeMounts"]]
        # tensor rank r listens on kvTransferPort + r on its own node: every rank's port, on every member
        assert [(p["name"], p["containerPort"]) for p in engine["ports"] if p["name"].startswith("kv")] == [
            ("kv-transfer", 8100), ("kv-transfer-1", 8101), ("kv-transfer-2", 8102), ("kv-transfer-3", 8103)]
        assert engine["resources"]["limits"]["nvidia.com/gpu"] == "2"  # 4 ranks over 2 nodes
        ports.add(int(_arg(args, "--master-port")))
    # pods sharing a host's network never have two leaders on one rendezvous port
    assert ports == {groups.RENDEZVOUS_PORT, groups.RENDEZVOUS_PORT + 2, groups.RENDEZVOUS_PORT + 1}


def test_where_leaderworkersets_are_served_each_pool_is_one():
    decode, prefill = groups.build_groups(OWNER, parse_spec(_raw()), lws=True)
    assert (decode["metadata"]["name"], decode["spec"]["replicas"]) == ("llm", 2)
    assert (prefill["metadata"]["name"], prefill["spec"]["replicas"]) == ("llm-prefill", 1)
    for lws, role in ((decode, DECODE), (prefill, PREFILL)):
        template = lws["spec"]["leaderWorkerTemplate"]
        assert template["size"] == 2
        for kind in ("leaderTemplate", "workerTemplate"):
            assert template[kind]["metadata"]["labels"][ROLE_LABEL] == role
            engine = _engine(template[kind])
            args = engine["args"]
            assert _arg(args, "--role") == role and _arg(args, "--kv-transfer-port") == str(KV_PORT)
            assert _arg(args, "--master-addr") == "$(LWS_LEADER_ADDRESS)"
            assert [p["containerPort"] for p in engine["ports"] if p["name"].startswith("kv")] == [8100, 8101, 8102, 8103]
        worker = _engine(template["workerTemplate"])
        assert "http" not in [p["name"] for p in worker["ports"]]  # workers take no request


def test_the_network_policy_opens_the_kv_ports_to_decode_pods_only_and_every_other_port_to_members():
    [policy] = np.build_for(OWNER, parse_spec(_raw()), np.DEFAULT_SETTINGS)
    assert policy["spec"]["podSelector"] == {"matchLabels": ENGINES}
    http, kv, members = policy["spec"]["ingress"]
    assert http["ports"] == [{"protocol": "TCP", "port": 8000}]
    assert http["from"][0] == {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "iterserve-router",
                                                               "app.kubernetes.io/instance": "llm"}}}
    # decode ranks dial the prefill ranks' listeners; a prefill pod reaches no KV listener
    assert kv == {"from": [{"podSelector": {"matchLabels": {**ENGINES, ROLE_LABEL: DECODE}}}],
                  "ports": [{"protocol": "TCP", "port": 8100, "endPort": 8103}]}
    # the rendezvous port and the ports gloo and NCCL pick: every port but the KV range
    assert members == {"from": [{"podSelector": {"matchLabels": ENGINES}}], "ports": [
        {"protocol": "TCP", "port": 1, "endPort": 8099}, {"protocol": "TCP", "port": 8104, "endPort": 65535},
        {"protocol": "UDP", "port": 1, "endPort": 8099}, {"protocol": "UDP", "port": 8104, "endPort": 65535}]}
    covered = lambda port: any(r["port"] <= port <= r.get("endPort", r["port"])  # noqa: E731
                               for r in members["ports"] if r["protocol"] == "TCP")
    assert all(covered(p) for p in (groups.RENDEZVOUS_PORT, groups.RENDEZVOUS_PORT + 1, 8000, 8099, 8104))
    assert not any(covered(p) for p in range(8100, 8104))


def test_a_kv_range_at_the_top_of_the_port_space_leaves_no_empty_range():
    [policy] = np.build_for(OWNER, parse_spec(_raw(disaggregation={"enabled": True, "kvTransferPort": 65532})),
                            np.DEFAULT_SETTINGS)
    members = policy["spec"]["ingress"][-1]
    assert members["ports"] == [{"protocol": "TCP", "port": 1, "endPort": 65531},
                                {"protocol": "UDP", "port": 1, "endPort": 65531}]


def test_the_reconcile_builds_both_pools_scales_each_by_its_own_field_and_counts_their_groups():
    kube = GroupKube(_raw())
    reconciler = Reconciler(kube)
    reconciler.reconcile("ns", "llm")
    reconciler.reconcile("ns", "llm")  # the router is ready: the Service selects it
    assert {name for kind, name in kube.objects if kind == "StatefulSet"} == {"llm-g0", "llm-g1", "llm-prefill-g0"}
    assert ("Deployment", "llm-prefill") not in kube.objects and ("Deployment", "llm") not in kube.objects
    assert ("Secret", "llm-kv-auth") in kube.objects  # the KV key every member mounts
    router_args = kube.objects[("Deployment", "llm-router")]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--pd-threshold-tokens" in router_args
    assert kube.body["status"]["prefill"]["replicas"] == 1 and kube.body["status"]["prefill"]["readyReplicas"] == 0

    prefill_pods = [_as(member("llm-prefill-g0", k), PREFILL) for k in range(2)]
    kube.pods = [*prefill_pods, *(_as(member(f"llm-g{i}", k), DECODE) for i in range(2) for k in range(2))]
    kube.writes.clear()
    reconciler.reconcile("ns", "llm")
    assert [w for w in kube.writes if w[0] != "status"] == []  # nothing to change
    assert kube.body["status"]["readyReplicas"] == 2 and kube.body["status"]["prefill"]["readyReplicas"] == 1
    kube.writes.clear()
    reconciler.reconcile("ns", "llm")
    assert kube.writes == []  # a second pass writes nothing

    # the autoscaler's path for the prefill pool: spec.disaggregation.prefill.replicas, in whole groups
    kube.body["spec"]["disaggregation"]["prefill"]["replicas"] = 2
    reconciler.reconcile("ns", "llm")
    assert ("StatefulSet", "llm-prefill-g1") in kube.writes
    args = _engine(kube.objects[("StatefulSet", "llm-prefill-g1")]["spec"]["template"])["args"]
    assert _arg(args, "--master-port") == str(groups.RENDEZVOUS_PORT + 3)
    kube.body["spec"]["disaggregation"]["prefill"]["replicas"] = 1
    kube.body["spec"]["replicas"] = 1
    kube.writes.clear()
    changes = reconciler.reconcile("ns", "llm").changes
    assert ("delete StatefulSet", "llm-prefill-g1") in kube.writes and ("delete StatefulSet", "llm-g1") in kube.writes
    assert ("StatefulSet", "llm-prefill-g0") in kube.objects and ("StatefulSet", "llm-g0") in kube.objects
    assert "deleted StatefulSet llm-prefill-g1 (spec.disaggregation.prefill.replicas is 1 groups)" in changes
    assert "deleted StatefulSet llm-g1 (spec.replicas is 1 groups)" in changes


def test_a_restarted_prefill_member_restarts_its_group_only():
    kube = GroupKube(_raw(replicas=1))
    reconciler = Reconciler(kube)
    reconciler.reconcile("ns", "llm")
    kube.pods = [_as(member("llm-prefill-g0", 0), PREFILL), _as(member("llm-prefill-g0", 1, restarts=1), PREFILL),
                 _as(member("llm-g0", 0), DECODE), _as(member("llm-g0", 1), DECODE)]
    kube.writes.clear()
    reconciler.reconcile("ns", "llm")
    deleted = sorted(name for kind, name in kube.writes if kind == "delete Pod")
    assert deleted == ["llm-prefill-g0-0", "llm-prefill-g0-1"]


def test_turning_disaggregation_off_deletes_the_prefill_groups_and_the_roles():
    kube = GroupKube(_raw())
    reconciler = Reconciler(kube)
    reconciler.reconcile("ns", "llm")
    kube.body["spec"]["disaggregation"]["enabled"] = False
    kube.writes.clear()
    changes = reconciler.reconcile("ns", "llm").changes
    assert ("delete StatefulSet", "llm-prefill-g0") in kube.writes
    assert "deleted StatefulSet llm-prefill-g0 (spec.disaggregation.enabled is false)" in changes
    args = _engine(kube.objects[("StatefulSet", "llm-g1")]["spec"]["template"])["args"]
    assert "--role" not in args and _arg(args, "--master-port") == str(groups.RENDEZVOUS_PORT + 1)


def test_with_leaderworkersets_served_the_reconcile_writes_one_per_pool():
    kube = GroupKube(_raw())
    kube.served = True
    Reconciler(kube).reconcile("ns", "llm")
    assert ("LeaderWorkerSet", "llm") in kube.writes and ("LeaderWorkerSet", "llm-prefill") in kube.writes
    assert not any(kind in ("StatefulSet", "Deployment") and name != "llm-router" for kind, name in kube.writes)
    kube.body["spec"]["disaggregation"]["enabled"] = False
    kube.writes.clear()
    Reconciler(kube).reconcile("ns", "llm")
    assert ("delete LeaderWorkerSet", "llm-prefill") in kube.writes


def _as(pod: dict, role: str) -> dict:
    pod["metadata"]["labels"][ROLE_LABEL] = role
    return pod


def _owned(name: str, owner_kind: str = "InferenceService", owner_uid: str = "u1") -> dict:
    return {"metadata": {"name": name, "uid": f"uid-{name}", "creationTimestamp": "2026-01-01T00:00:00Z",
                         "ownerReferences": [{"kind": owner_kind, "name": "llm", "uid": owner_uid, "controller": True}]}}


def _verifiable(stateful_sets: list[dict]) -> tuple[list[dict], list[dict]]:
    """Each StatefulSet's revision and its two members, running the revision's template."""
    template = {"containers": [{"name": "engine", "image": "e", "ports": [{"name": "http", "containerPort": 8000}]}]}
    revisions, pods = [], []
    for sts in stateful_sets:
        group, uid = sts["metadata"]["name"], sts["metadata"]["uid"]
        revisions.append({"metadata": {"name": f"{group}-r1", "ownerReferences": [
            {"kind": "StatefulSet", "uid": uid, "controller": True}]}, "data": {"spec": {"template": {"spec": template}}}})
        for k in range(2):
            pod = _as(member(group, k), PREFILL if "prefill" in group else DECODE)
            pod["metadata"]["ownerReferences"][0]["uid"] = uid
            pod["metadata"]["creationTimestamp"] = "2026-01-01T00:00:05Z"
            pod["spec"] = copy.deepcopy(template)
            pods.append(pod)
    return revisions, pods


class _HookKube:
    def __init__(self, sets, revisions, pods, lws=()):
        self.sets, self.revisions, self.pods = sets, revisions, pods
        self.lws = {o["metadata"]["name"]: o for o in lws}

    def get(self, kind, namespace, name):
        return copy.deepcopy(self.lws.get(name)) if kind == groups.LEADER_WORKER_SET else None

    def list_stateful_sets(self, namespace, selector):
        return copy.deepcopy(self.sets)

    def list_controller_revisions(self, namespace, selector):
        return copy.deepcopy(self.revisions)

    def list_pods(self, namespace, selector):
        return copy.deepcopy(self.pods)


@pytest.mark.parametrize("lws", [False, True], ids=["statefulsets", "leaderworkersets"])
def test_the_autoscaler_reads_each_pool_s_verified_leaders(lws):
    from iterserve.operator.autoscaling.hook import AutoscalerHook

    spec = parse_spec(_raw())
    if lws:  # the LeaderWorkerSet controller's StatefulSets, one per LeaderWorkerSet (leaders)
        owners = [_owned("llm"), _owned("llm-prefill")]
        sets = [_owned("llm-g0", "LeaderWorkerSet", "uid-llm"), _owned("llm-g1", "LeaderWorkerSet", "uid-llm"),
                _owned("llm-prefill-g0", "LeaderWorkerSet", "uid-llm-prefill")]
    else:
        owners, sets = [], [_owned("llm-g0"), _owned("llm-g1"), _owned("llm-prefill-g0")]
    revisions, pods = _verifiable(sets)
    pools = AutoscalerHook()._pools(_HookKube(sets, revisions, pods, owners), "ns", "llm", spec, OWNER)
    assert pools[DECODE].replicas == 2 and pools[PREFILL].replicas == 1
    assert sorted(p["metadata"]["name"] for p in pools[DECODE].pods) == ["llm-g0-0", "llm-g1-0"]
    assert [p["metadata"]["name"] for p in pools[PREFILL].pods] == ["llm-prefill-g0-0"]


def test_the_router_reaches_the_leaders_of_both_pools_only():
    from iterserve.router.discovery import ready_urls

    sets = [_owned("llm-g0"), _owned("llm-prefill-g0")]
    revisions, pods = _verifiable(sets)
    verified, refused = chain.verify(pods, [], [], chain.stateful_sets_owned(sets, "llm", "u1"), revisions)
    assert refused == [] and len(verified) == 4
    leaders = [p for p in verified if is_leader(p)]
    by_role = {role: ready_urls([p for p in leaders if p["metadata"]["labels"][ROLE_LABEL] == role], "http")
               for role in (PREFILL, DECODE)}
    assert by_role == {PREFILL: ["http://127.10.0.1:8000"], DECODE: ["http://127.10.0.1:8000"]}
    assert all(p["metadata"]["labels"][POD_INDEX_LABEL] == "0" for p in leaders)


@pytest.mark.parametrize("changes, field", [
    ({"disaggregation": {"enabled": True, "kvTransferPort": 29499}}, "spec.disaggregation.kvTransferPort"),
    # TP=2 x PP=2 is four ranks: 29497..29500 holds 29500, a LeaderWorkerSet prefill leader's port
    ({"engine": {"parallelism": {"tensor": 2, "pipeline": 2, "nodes": 2}},
      "disaggregation": {"enabled": True, "kvTransferPort": 29497}}, "spec.disaggregation.kvTransferPort"),
    ({"disaggregation": {"enabled": True, "prefill": {"extraArgs": ["--tensor-parallel-size", "2"]}}},
     "spec.disaggregation.prefill.extraArgs[0]"),
    ({"disaggregation": {"enabled": True, "decode": {"extraArgs": ["--nnodes", "1"]}}},
     "spec.disaggregation.decode.extraArgs[0]"),
])
def test_what_groups_cannot_disaggregate_is_refused_naming_the_field(changes, field):
    with pytest.raises(SpecError) as error:
        parse_spec(_raw(**changes))
    assert error.value.field == field


def test_a_pipeline_group_s_kv_range_is_every_rank_of_tensor_x_pipeline_declared_by_every_member():
    """TP=2 x PP=2 over two nodes: node 0 runs ranks 0-1 (stage 0), node 1 ranks 2-3 (stage 1),
    rank r listening on kvTransferPort + r; one template serves every member of a StatefulSet group
    (and every LWS worker), so each declares the whole range, which the policy opens to decode."""
    raw = _raw(engine={"parallelism": {"tensor": 2, "pipeline": 2, "nodes": 2}})
    spec = parse_spec(raw)
    for lws in (False, True):
        for workload in groups.build_groups(OWNER, spec, lws=lws):
            if workload["kind"] == "StatefulSet":
                templates = [workload["spec"]["template"]]
            elif workload["kind"] == groups.LEADER_WORKER_SET:
                templates = [workload["spec"]["leaderWorkerTemplate"][k] for k in ("leaderTemplate", "workerTemplate")]
            else:
                continue
            for template in templates:
                engine = _engine(template)
                assert _arg(engine["args"], "--pipeline-parallel-size") == "2"
                assert [p["containerPort"] for p in engine["ports"] if p["name"].startswith("kv")] == [
                    8100, 8101, 8102, 8103]
    [policy] = np.build_for(OWNER, spec, np.DEFAULT_SETTINGS)
    http, kv, members = policy["spec"]["ingress"]
    assert kv["ports"] == [{"protocol": "TCP", "port": 8100, "endPort": 8103}]
    assert members["ports"][:2] == [{"protocol": "TCP", "port": 1, "endPort": 8099},
                                    {"protocol": "TCP", "port": 8104, "endPort": 65535}]


def test_the_rendezvous_clash_check_counts_every_rank_of_tensor_x_pipeline():
    parallel = {"tensor": 2, "pipeline": 2, "nodes": 2}
    # 29498..29501 holds LeaderWorkerSet groups' 29500 and StatefulSet prefill group 0's 29501 (a
    # tensor-only range, 29498..29499, would hold neither)
    with pytest.raises(SpecError, match="rendezvous port 29500"):
        parse_spec(_raw(engine={"parallelism": parallel}, disaggregation={"enabled": True, "kvTransferPort": 29498}))
    # 29502..29505 holds prefill group 1's 29503 with maxReplicas 2
    with pytest.raises(SpecError, match="rendezvous port 29503"):
        parse_spec(_raw(engine={"parallelism": parallel},
                        disaggregation={"enabled": True, "kvTransferPort": 29502, "prefill": {"maxReplicas": 2}}))
    # with one prefill group, 29502..29505 is clear
    spec = parse_spec(_raw(engine={"parallelism": parallel},
                           disaggregation={"enabled": True, "kvTransferPort": 29502, "prefill": {"maxReplicas": 1}}))
    assert spec.disaggregation.kv_transfer_port == 29502


def test_a_kv_range_clear_of_the_prefill_rendezvous_ports_is_accepted():
    # the prefill groups' leaders bind 29501, 29503, 29505 (maxReplicas 3); KV ports 29506..29509 are clear
    spec = parse_spec(_raw(disaggregation={"enabled": True, "kvTransferPort": 29506,
                                           "prefill": {"maxReplicas": 3}}))
    assert spec.disaggregation.kv_transfer_port == 29506
    with pytest.raises(SpecError, match="rendezvous port 29503"):
        parse_spec(_raw(disaggregation={"enabled": True, "kvTransferPort": 29502, "prefill": {"maxReplicas": 3}}))
