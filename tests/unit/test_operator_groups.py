"""Multi-node replica groups (operator/groups.py): with spec.engine.parallelism.nodes > 1 each
replica is a StatefulSet of `nodes` pods behind a headless Service (or one LeaderWorkerSet where
the cluster serves it); ranks, the leader's DNS name and GPUs per pod in the rendered pods;
scaling adds and deletes whole groups; a failed member restarts its group; a group counts ready
only when every member is; the router, the Service and the autoscaler reach leaders only."""

from __future__ import annotations

import copy

import pytest

from iterserve import controller_chain as chain
from iterserve.labels import POD_INDEX_LABEL, is_leader
from iterserve.operator import groups
from iterserve.operator.reconcile import Reconciler
from iterserve.operator.resources import Owner, selector_labels
from iterserve.operator.routing import service_selector
from iterserve.operator.validation import SpecError, parse_spec
from iterserve.router.discovery import ready_urls
from tests.unit.test_operator_value_flow import MemoryKube

OWNER = Owner("llm", "ns", "u1")
SPEC = {"model": {"uri": "smollm2-135m"}, "replicas": 1, "routing": {"mode": "None"},
        "engine": {"parallelism": {"tensor": 2, "nodes": 2}}}


def _spec(**changes):
    raw = copy.deepcopy(SPEC)
    raw.update(changes)
    return parse_spec(raw)


class GroupKube(MemoryKube):
    """MemoryKube with the lists the group reconcile reads (items without a kind, as the API lists
    them); StatefulSets report their pods ready."""

    def __init__(self, spec: dict):
        super().__init__(spec)
        self.pods: list[dict] = []

    def apply(self, manifest, dry_run=False):
        applied = super().apply(manifest, dry_run)
        if manifest["kind"] == "StatefulSet" and not dry_run:
            obj = self.objects[("StatefulSet", manifest["metadata"]["name"])]
            obj["metadata"].update(uid=f"uid-{manifest['metadata']['name']}", generation=1)
            obj["status"] = {"observedGeneration": 1, "replicas": 2, "readyReplicas": 2, "updatedReplicas": 2,
                             "updateRevision": f"{manifest['metadata']['name']}-r1"}
            applied = copy.deepcopy(obj)
        return applied

    def list_stateful_sets(self, namespace, selector):  # as the API lists them: items carry no kind
        return [{k: v for k, v in copy.deepcopy(o).items() if k != "kind"}
                for (kind, _), o in self.objects.items() if kind == "StatefulSet"]

    def list_pods(self, namespace, selector):
        return copy.deepcopy(self.pods)

    def list_controller_revisions(self, namespace, selector):
        return []

    def delete(self, obj):
        if obj["kind"] == "Pod":
            self.writes.append(("delete Pod", obj["metadata"]["name"]))
            self.pods = [p for p in self.pods if p["metadata"]["name"] != obj["metadata"]["name"]]
            return
        super().delete(obj)


def member(group: str, index: int, ready: bool = True, restarts: int = 0, revision: str | None = None) -> dict:
    return {"metadata": {"name": f"{group}-{index}", "uid": f"pod-{group}-{index}",
                         "labels": {**selector_labels("llm"), POD_INDEX_LABEL: str(index),
                                    groups.REVISION_LABEL: revision or f"{group}-r1"},
                         "ownerReferences": [{"kind": "StatefulSet", "uid": f"uid-{group}", "controller": True}]},
            "spec": {"containers": [{"name": "engine", "ports": [{"name": "http", "containerPort": 8000}]}]},
            "status": {"phase": "Running", "podIP": f"127.10.0.{index + 1}",
                       "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
                       "containerStatuses": [{"name": "engine", "restartCount": restarts}]}}


def _engine(sts: dict) -> dict:
    return sts["spec"]["template"]["spec"]["containers"][0]


def test_each_group_is_a_statefulset_whose_pods_rendezvous_at_the_leaders_dns_name():
    spec = parse_spec({**SPEC, "engine": {"parallelism": {"tensor": 4, "nodes": 2},
                                          "resources": {"limits": {"nvidia.com/gpu": 1}}}})
    service, sts = groups.build_groups(OWNER, spec, lws=False)
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    assert service["metadata"]["name"] == "llm-group" and sts["spec"]["serviceName"] == "llm-group"
    assert sts["metadata"]["name"] == "llm-g0" and sts["spec"]["replicas"] == 2
    assert sts["spec"]["podManagementPolicy"] == "Parallel" and sts["spec"]["updateStrategy"] == {"type": "OnDelete"}
    engine = _engine(sts)
    args = engine["args"]
    assert args[args.index("--tensor-parallel-size") + 1] == "4"
    assert args[args.index("--nnodes") + 1] == "2"
    assert args[args.index("--master-addr") + 1] == "llm-g0-0.llm-group"
    assert args[args.index("--node-rank") + 1] == "$(ITERSERVE_NODE_RANK)"
    rank = next(e for e in engine["env"] if e["name"] == "ITERSERVE_NODE_RANK")
    assert rank["valueFrom"]["fieldRef"]["fieldPath"] == f"metadata.labels['{POD_INDEX_LABEL}']"
    # the workers' health port is the HTTP port: one template serves every rank and its probes
    assert args[args.index("--worker-health-port") + 1] == "8000"
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == "2"  # 4 ranks over 2 nodes
    assert {"name": "rendezvous", "containerPort": groups.RENDEZVOUS_PORT, "protocol": "TCP"} in engine["ports"]


def test_a_leaderworkerset_where_served_recreates_the_group_and_gives_workers_no_http_port():
    (lws,) = groups.build_groups(OWNER, _spec(replicas=3), lws=True)
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1" and lws["spec"]["replicas"] == 3
    template = lws["spec"]["leaderWorkerTemplate"]
    assert template["size"] == 2 and template["restartPolicy"] == "RecreateGroupOnPodRestart"
    leader, worker = (template[k]["spec"]["containers"][0] for k in ("leaderTemplate", "workerTemplate"))
    assert leader["args"][leader["args"].index("--master-addr") + 1] == "$(LWS_LEADER_ADDRESS)"
    assert worker["args"][worker["args"].index("--node-rank") + 1] == "$(LWS_WORKER_INDEX)"
    assert "http" in [p["name"] for p in leader["ports"]] and "http" not in [p["name"] for p in worker["ports"]]
    assert worker["readinessProbe"]["httpGet"]["port"] == "health"


def test_the_reconcile_applies_groups_once_and_scales_by_whole_groups():
    kube = GroupKube(copy.deepcopy(SPEC))
    reconciler = Reconciler(kube)
    reconciler.reconcile("ns", "llm")
    assert ("StatefulSet", "llm-g0") in kube.writes and ("Service", "llm-group") in kube.writes
    assert not any(kind == "Deployment" for kind, _ in kube.writes)
    status = kube.body["status"]
    assert status["replicas"] == 1 and status["readyReplicas"] == 0  # no member pod yet
    kube.pods = [member("llm-g0", 0), member("llm-g0", 1)]
    kube.writes.clear()
    reconciler.reconcile("ns", "llm")
    assert [w for w in kube.writes if w[0] != "status"] == []  # nothing to change
    assert kube.body["status"]["readyReplicas"] == 1
    # the scale subresource's selector: one pod per replica, the group's leader
    assert kube.body["status"]["selector"].endswith(f",{POD_INDEX_LABEL}=0")
    kube.writes.clear()
    reconciler.reconcile("ns", "llm")
    assert kube.writes == []  # a second pass writes nothing

    kube.body["spec"]["replicas"] = 2
    reconciler.reconcile("ns", "llm")
    assert ("StatefulSet", "llm-g1") in kube.writes
    args = _engine(kube.objects[("StatefulSet", "llm-g1")])["args"]
    assert args[args.index("--master-addr") + 1] == "llm-g1-0.llm-group"
    assert args[args.index("--master-port") + 1] == str(groups.RENDEZVOUS_PORT + 1)  # no two leaders share one
    kube.body["spec"]["replicas"] = 1
    kube.writes.clear()
    reconciler.reconcile("ns", "llm")
    assert ("delete StatefulSet", "llm-g1") in kube.writes and ("StatefulSet", "llm-g0") in kube.objects


def test_back_to_one_node_the_groups_go_and_a_deployment_serves():
    kube = GroupKube(copy.deepcopy(SPEC))
    reconciler = Reconciler(kube)
    reconciler.reconcile("ns", "llm")
    kube.body["spec"]["engine"]["parallelism"] = {"tensor": 2}
    kube.writes.clear()
    reconciler.reconcile("ns", "llm")
    assert ("Deployment", "llm") in kube.writes
    assert ("delete StatefulSet", "llm-g0") in kube.writes and ("delete Service", "llm-group") in kube.writes


def test_with_the_leaderworkerset_api_served_the_reconcile_writes_one_and_no_statefulset():
    kube = GroupKube(copy.deepcopy(SPEC))
    kube.served = True
    Reconciler(kube).reconcile("ns", "llm")
    assert ("LeaderWorkerSet", "llm") in kube.writes
    assert not any(kind in ("StatefulSet", "Deployment") for kind, _ in kube.writes)


def test_a_member_that_restarted_restarts_its_whole_group():
    kube = GroupKube(copy.deepcopy(SPEC))
    reconciler = Reconciler(kube)
    reconciler.reconcile("ns", "llm")
    kube.pods = [member("llm-g0", 0, ready=False), member("llm-g0", 1, restarts=1)]
    kube.writes.clear()
    outcome = reconciler.reconcile("ns", "llm")
    assert ("delete Pod", "llm-g0-0") in kube.writes and ("delete Pod", "llm-g0-1") in kube.writes
    assert any("Restarted group llm-g0: member llm-g0-1 failed or restarted" in c for c in outcome.changes)
    assert "GroupRestarted" in kube.events


def test_a_group_is_ready_only_when_every_member_is_ready_and_current():
    sts = {"metadata": {"name": "llm-g0", "uid": "uid-llm-g0", "generation": 1},
           "spec": {"replicas": 2}, "status": {"observedGeneration": 1, "updatedReplicas": 2, "updateRevision": "llm-g0-r1"}}
    spec = _spec()
    assert groups.groups_summary(spec, [sts], [member("llm-g0", 0), member("llm-g0", 1)])["status"]["readyReplicas"] == 1
    assert groups.groups_summary(spec, [sts], [member("llm-g0", 0), member("llm-g0", 1, ready=False)])["status"][
        "readyReplicas"] == 0
    assert groups.groups_summary(spec, [sts], [member("llm-g0", 0)])["status"]["readyReplicas"] == 0


def test_an_update_restarts_one_outdated_group_at_a_time():
    sets = [{"metadata": {"name": f"llm-g{i}", "uid": f"uid-llm-g{i}"}, "spec": {"replicas": 2},
             "status": {"updateRevision": f"llm-g{i}-r2"}} for i in range(2)]
    old = [member(f"llm-g{i}", k, revision=f"llm-g{i}-r1") for i in range(2) for k in range(2)]
    [(first, why)] = groups.groups_to_restart(sets, old)
    assert first["metadata"]["name"] == "llm-g0" and "old revision" in why
    # while llm-g0 comes back (not ready), llm-g1 waits: capacity drops by one group at most
    renewing = [member("llm-g0", 0, ready=False, revision="llm-g0-r2"), *old[2:]]
    assert groups.groups_to_restart(sets, renewing) == []


def test_only_leaders_take_requests_from_the_router_and_the_service():
    pods = [member("llm-g0", 0), member("llm-g0", 1)]
    assert [is_leader(p) for p in pods] == [True, False]
    assert ready_urls(pods, "http") == ["http://127.10.0.1:8000"]
    unlabelled = member("llm-g0", 1)
    del unlabelled["metadata"]["labels"][POD_INDEX_LABEL]  # the ordinal in the name still says worker
    assert not is_leader(unlabelled)
    assert service_selector("llm", _spec(), router_serving=False) == {**selector_labels("llm"), POD_INDEX_LABEL: "0"}
    assert service_selector("llm", _spec(), lws=True)["leaderworkerset.sigs.k8s.io/worker-index"] == "0"


def test_statefulset_pods_are_verified_through_their_controller_revision():
    template = {"containers": [{"name": "engine", "image": "e", "args": ["--node-rank", "$(R)"]}]}
    sts = {"metadata": {"name": "llm-g0", "uid": "s1", "creationTimestamp": "2026-01-01T00:00:00Z",
                        "ownerReferences": [{"kind": "InferenceService", "name": "llm", "uid": "u1", "controller": True}]}}
    revision = {"metadata": {"name": "llm-g0-r1", "ownerReferences": [{"kind": "StatefulSet", "uid": "s1", "controller": True}]},
                "data": {"spec": {"template": {"spec": template, "$patch": "replace"}}}}
    ours = member("llm-g0", 0)
    ours["metadata"]["ownerReferences"][0]["uid"] = "s1"
    ours["metadata"]["creationTimestamp"] = "2026-01-01T00:00:05Z"
    ours["spec"] = copy.deepcopy(template)
    other = copy.deepcopy(ours)
    other["metadata"]["name"] = "look-alike"
    other["spec"]["containers"][0]["args"] = ["--model", "attacker"]
    forged = copy.deepcopy(ours)
    forged["metadata"]["name"] = "forged-revision"
    forged["metadata"]["labels"][groups.REVISION_LABEL] = "made-up"
    owned = chain.stateful_sets_owned([sts, {**sts, "metadata": {**sts["metadata"], "uid": "s2", "ownerReferences": []}}],
                                      "llm", "u1")
    assert [s["metadata"]["uid"] for s in owned] == ["s1"]
    ours["metadata"]["labels"][groups.REVISION_LABEL] = "llm-g0-r1"
    other["metadata"]["labels"][groups.REVISION_LABEL] = "llm-g0-r1"
    verified, refused = chain.verify([ours, other, forged], [], [], owned, [revision])
    assert [p["metadata"]["name"] for p in verified] == ["llm-g0-0"]
    assert {r.pod: r.reason for r in refused} == {"look-alike": chain.SPEC_MISMATCH,
                                                  "forged-revision": chain.HASH_MISMATCH}


@pytest.mark.parametrize("raw, field", [
    ({"engine": {"parallelism": {"tensor": 3, "nodes": 2}}}, "spec.engine.parallelism.nodes"),
    ({"engine": {"extraArgs": ["--master-addr", "elsewhere"]}}, "spec.engine.extraArgs[0]"),
    ({"engine": {"extraArgs": ["--nnodes", "4"]}}, "spec.engine.extraArgs[0]"),
])
def test_specs_groups_cannot_serve_are_refused_naming_the_field(raw, field):
    with pytest.raises(SpecError) as error:
        parse_spec({"model": {"uri": "m"}, **raw})
    assert error.value.field == field


def test_the_chart_s_pod_monitor_scrapes_group_leaders_and_drops_workers():
    import re

    from tests.unit.chart_tools import of_kind, render

    [pod_monitor] = of_kind(render(("namespaced-monitoring.yaml",)), "PodMonitor")
    drops = {r["sourceLabels"][0]: r["regex"] for r in pod_monitor["spec"]["podMetricsEndpoints"][0]["relabelings"]
             if r["action"] == "drop"}
    for label in (POD_INDEX_LABEL, "leaderworkerset.sigs.k8s.io/worker-index"):
        meta = "__meta_kubernetes_pod_label_" + re.sub(r"[^A-Za-z0-9]", "_", label)
        # Prometheus anchors the regex: index 1, 2, 10 are dropped; 0 and no label (a Deployment's pod) kept
        assert [bool(re.fullmatch(drops[meta], v)) for v in ("1", "2", "10", "0", "")] == [True] * 3 + [False] * 2


def test_pods_a_leaderworkerset_made_pass_the_chain_despite_the_variables_its_webhook_adds():
    template = {"containers": [{"name": "engine", "image": "e", "env": [{"name": "HOME", "value": "/tmp"}]}]}
    lws = {"metadata": {"name": "llm", "uid": "l1", "ownerReferences": [
        {"kind": "InferenceService", "name": "llm", "uid": "u1", "controller": True}]}}
    sts = {"metadata": {"name": "llm", "uid": "s1", "creationTimestamp": "2026-01-01T00:00:00Z",
                        "ownerReferences": [{"kind": "LeaderWorkerSet", "uid": "l1", "controller": True}]}}
    revision = {"metadata": {"name": "llm-r1", "ownerReferences": [{"kind": "StatefulSet", "uid": "s1", "controller": True}]},
                "data": {"spec": {"template": {"spec": template}}}}
    leader = {"metadata": {"name": "llm-0", "creationTimestamp": "2026-01-01T00:00:05Z",
                           "labels": {groups.REVISION_LABEL: "llm-r1", "leaderworkerset.sigs.k8s.io/worker-index": "0"},
                           "ownerReferences": [{"kind": "StatefulSet", "uid": "s1", "controller": True}]},
              "spec": {"containers": [{"name": "engine", "image": "e", "env": [
                  {"name": "LWS_LEADER_ADDRESS", "value": "llm-0.llm.ns"}, {"name": "LWS_GROUP_SIZE", "value": "2"},
                  {"name": "LWS_WORKER_INDEX", "value": "0"}, {"name": "HOME", "value": "/tmp"}]}]}}
    tampered = copy.deepcopy(leader)
    tampered["metadata"]["name"] = "tampered"
    tampered["spec"]["containers"][0]["env"].append({"name": "EXTRA", "value": "1"})
    sets = chain.stateful_sets_owned([sts], "llm", "u1", leader_worker_set=lws)
    verified, refused = chain.verify([leader, tampered], [], [], sets, [revision])
    assert [p["metadata"]["name"] for p in verified] == ["llm-0"] and is_leader(leader)
    assert [(r.pod, r.reason) for r in refused] == [("tampered", chain.SPEC_MISMATCH)]
    # a StatefulSet of the InferenceService's own gets no such allowance
    own = {**sts, "metadata": {**sts["metadata"], "ownerReferences": lws["metadata"]["ownerReferences"]}}
    assert chain.verify([leader], [], [], [own], [revision])[1][0].reason == chain.SPEC_MISMATCH


def test_the_network_policy_lets_a_group_s_members_reach_each_other_on_every_port():
    from iterserve.operator import network_policy as np

    [policy] = np.build_for(OWNER, _spec(), np.DEFAULT_SETTINGS)
    assert {"from": [{"podSelector": {"matchLabels": selector_labels("llm")}}]} in policy["spec"]["ingress"]
    [single] = np.build_for(OWNER, parse_spec({**SPEC, "engine": {}}), np.DEFAULT_SETTINGS)
    assert all("ports" in rule for rule in single["spec"]["ingress"])  # one node: named ports only


def test_the_autoscaler_reads_one_verified_leader_per_group():
    from iterserve.labels import DECODE
    from iterserve.operator.autoscaling.hook import AutoscalerHook

    spec = _spec(replicas=2)
    template = {"containers": [{"name": "engine", "image": "e"}]}
    sets, revisions, pods = [], [], []
    for i in range(2):
        group = f"llm-g{i}"
        sets.append({"metadata": {"name": group, "uid": f"uid-{group}", "creationTimestamp": "2026-01-01T00:00:00Z",
                                  "ownerReferences": [{"kind": "InferenceService", "name": "llm", "uid": "u1",
                                                       "controller": True}]}})
        revisions.append({"metadata": {"name": f"{group}-r1", "ownerReferences": [
            {"kind": "StatefulSet", "uid": f"uid-{group}", "controller": True}]},
            "data": {"spec": {"template": {"spec": template}}}})
        for k in range(2):
            pod = member(group, k)
            pod["metadata"]["creationTimestamp"] = "2026-01-01T00:00:05Z"
            pod["spec"] = copy.deepcopy(template)
            pods.append(pod)
    stranger = copy.deepcopy(pods[0])
    stranger["metadata"]["name"] = "look-alike-0"
    stranger["spec"]["containers"][0]["image"] = "attacker"

    class Kube:
        def get(self, kind, namespace, name):
            return None

        def list_stateful_sets(self, namespace, selector):
            return copy.deepcopy(sets)

        def list_controller_revisions(self, namespace, selector):
            return copy.deepcopy(revisions)

        def list_pods(self, namespace, selector):
            return copy.deepcopy([*pods, stranger])

    pools = AutoscalerHook()._pools(Kube(), "ns", "llm", spec, OWNER)
    assert pools[DECODE].replicas == 2
    assert sorted(p["metadata"]["name"] for p in pools[DECODE].pods) == ["llm-g0-0", "llm-g1-0"]
