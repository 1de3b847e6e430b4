"""Multi-node replica groups (spec.engine.parallelism.nodes > 1), as pure builders.

Each replica is a group of `nodes` pods running one engine together: the pod of index 0 (the
leader) runs the scheduler and serves HTTP; the others (workers) run their ranks, join the
leader's rendezvous at --master-addr:--master-port, and answer only /health and /ready. A group
is one replica: spec.replicas and the scale subresource count groups, the router, the
autoscaler's scrape and the admin retune reach leaders only (`is_leader`), and a group counts as
ready when every member is.

Built on Kubernetes' own workload APIs:

- LeaderWorkerSet (leaderworkerset.x-k8s.io/v1) NAME when the API server serves it: replicas =
  groups, size = nodes, restartPolicy RecreateGroupOnPodRestart (a member that restarts recreates
  its group); LWS gives every pod LWS_LEADER_ADDRESS and LWS_WORKER_INDEX, and the leader and the
  workers have templates of their own (the workers' has no HTTP port).
- Otherwise one StatefulSet NAME-g<i> per group (replicas = nodes, Parallel pod management,
  OnDelete updates) behind one headless Service NAME-group (publishing pods before they are
  ready: members rendezvous before any is ready). Rank = the pod's index (the
  apps.kubernetes.io/pod-index label the StatefulSet controller sets), the leader is
  NAME-g<i>-0, reached by DNS as NAME-g<i>-0.NAME-group on port 29500 + i; each member on a node
  of its own unless spec.scheduling.affinity is set. One template serves every rank, so the
  workers' health port is the HTTP port (they serve nothing else there). Scaling adds or deletes
  whole StatefulSets, the highest index first; `groups_to_restart` says which groups the
  reconcile restarts (by deleting their pods): one whose member failed or restarted, and one of
  an old revision when every other group of its pool is ready (a rolling update a group at a time).

With prefill/decode disaggregation each pool is a set of groups (`GroupPool`): the engine pool
(decode) as above, and the prefill pool named NAME-prefill (StatefulSets NAME-prefill-g<i>, or
LeaderWorkerSet NAME-prefill) with spec.disaggregation.prefill's replicas. Every member of both
runs its pool's --role and the KV transfer flags (rank r of tensor x pipeline of a prefill
group listens on kvTransferPort + r on the node that runs it and advertises that pod's IP; every
member declares the whole range); the router and the autoscaler reach the leaders of both.
Both pools' StatefulSets share the headless Service, and their rendezvous ports interleave
(decode group i on 29500 + 2i, prefill group i on 29500 + 2i + 1).

In: the owner and the parsed spec (and live objects for the decisions). Out: manifests and
names. No API calls here; reconcile.py applies and deletes.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from typing import Any

from iterserve.labels import (
    GROUP_LABEL,
    LWS_WORKER_INDEX_LABEL,
    POD_INDEX_LABEL,
    PREFILL,
    selector_labels,
)
from iterserve.labels import is_leader as is_leader  # which pods take requests, re-exported
from iterserve.operator.disaggregation import PREFILL_COMPONENT, prefill_name
from iterserve.operator.models import InferenceServiceSpec
from iterserve.operator.resources import (
    CONTAINER_NAME,
    ENGINE_PORT,
    NODE_RANK_ENV,
    Owner,
    _metadata,
    pod_template,
)

STATEFULSET = "StatefulSet"
LEADER_WORKER_SET = "LeaderWorkerSet"
LWS_GROUP = "leaderworkerset.x-k8s.io"
LWS_VERSION = "v1"
LWS_PLURAL = "leaderworkersets"
# The leader's rendezvous store (--master-port). StatefulSet group i uses RENDEZVOUS_PORT + i: pods
# that share a host's network (hostNetwork, common for RDMA, and the local pod runtime) then never
# have two groups' leaders on one port.
RENDEZVOUS_PORT = 29500
WORKER_HEALTH_PORT = 8001  # LWS workers' /health and /ready (--worker-health-port)
LWS_LEADER_ADDRESS_ENV = "LWS_LEADER_ADDRESS"  # set by the LeaderWorkerSet controller in every pod
LWS_WORKER_INDEX_ENV = "LWS_WORKER_INDEX"
REVISION_LABEL = "controller-revision-hash"


def is_group(spec: InferenceServiceSpec) -> bool:
    return spec.engine.parallelism.nodes > 1


@dataclass(frozen=True)
class GroupPool:
    """One pool of groups: `base` names its StatefulSets (base-g<i>) or its LeaderWorkerSet (base);
    `role` is PREFILL for the prefill pool, None for the engine pool (decode when disaggregated)."""

    base: str
    role: str | None
    replicas: int
    replicas_field: str  # the spec field that counts its groups (the Events' words)
    # rendezvous port of group i: RENDEZVOUS_PORT + stride * i + offset (pools never share a port)
    stride: int = 1
    offset: int = 0

    def rendezvous_port(self, index: int) -> int:
        return RENDEZVOUS_PORT + self.stride * index + self.offset


def group_pools(name: str, spec: InferenceServiceSpec) -> list[GroupPool]:
    """The pools of groups a multi-node spec runs: the engine pool, and with disaggregation the
    prefill pool (interleaved rendezvous ports)."""
    if not spec.disaggregation.enabled:
        return [GroupPool(name, None, spec.replicas, "spec.replicas")]
    return [GroupPool(name, None, spec.replicas, "spec.replicas", stride=2),
            GroupPool(prefill_name(name), PREFILL, spec.disaggregation.prefill.wanted_replicas,
                      "spec.disaggregation.prefill.replicas", stride=2, offset=1)]


def headless_service_name(name: str) -> str:
    return f"{name}-group"


def group_name(name: str, index: int) -> str:
    return f"{name}-g{index}"


def group_index(name: str, group: str) -> int | None:
    """The index of StatefulSet `group` of InferenceService `name` (None: not a group's name)."""
    found = re.fullmatch(rf"{re.escape(name)}-g(0|[1-9][0-9]*)", group)
    return int(found.group(1)) if found else None


def leader_address(owner: Owner, index: int, base: str | None = None) -> str:
    """The leader's DNS name, as the namespace's search path resolves it (<pod>.<headless service>);
    `base`: the pool's (default: the engine pool's, the InferenceService's name)."""
    return f"{group_name(base or owner.name, index)}-0.{headless_service_name(owner.name)}"


def leader_selector(spec: InferenceServiceSpec, lws: bool) -> dict[str, str]:
    """Labels only a group's leader carries, for selectors that must skip workers (the Service in
    None mode, the InferencePool); empty without groups."""
    if not is_group(spec):
        return {}
    return {LWS_WORKER_INDEX_LABEL: "0"} if lws else {POD_INDEX_LABEL: "0"}


def leader_pod_selector(name: str, spec: InferenceServiceSpec, lws: bool) -> str | None:
    """The scale subresource's selector for groups: their leaders (one pod per replica, the one
    with metrics, for an HPA's pod metrics); None without groups (every engine pod)."""
    if not is_group(spec):
        return None
    return ",".join(f"{k}={v}" for k, v in {**selector_labels(name), **leader_selector(spec, lws)}.items())


def group_args(spec: InferenceServiceSpec, master_addr: str, node_rank: str, health_port: int,
               master_port: int = RENDEZVOUS_PORT) -> list[str]:
    return ["--nnodes", str(spec.engine.parallelism.nodes), "--node-rank", node_rank, "--master-addr", master_addr,
            "--master-port", str(master_port), "--worker-health-port", str(health_port)]


def spread_members(name: str) -> dict[str, Any]:
    """Each member of a group on a node of its own (unless spec.scheduling.affinity says otherwise):
    pods of the same InferenceService and the same group (matchLabelKeys: the pod's own group)."""
    return {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [{
        "labelSelector": {"matchLabels": selector_labels(name)}, "matchLabelKeys": [GROUP_LABEL],
        "topologyKey": "kubernetes.io/hostname"}]}}


def _group_template(spec: InferenceServiceSpec, name: str, args: list[str], env: list[dict],
                    labels: dict[str, str], master_port: int = RENDEZVOUS_PORT,
                    role: str | None = None) -> dict[str, Any]:
    template = copy.deepcopy(pod_template(spec, name, role))
    template["metadata"]["labels"].update(labels)
    if role == PREFILL:
        template["metadata"]["labels"]["app.kubernetes.io/component"] = PREFILL_COMPONENT
    if GROUP_LABEL in labels and not spec.scheduling.affinity:
        template["spec"].setdefault("affinity", spread_members(name))
    for container in template["spec"]["containers"]:
        if container["name"] == CONTAINER_NAME:
            container["args"] = container["args"] + args
            container["env"] = env + container["env"]
            container["ports"] = container["ports"] + [
                {"name": "rendezvous", "containerPort": master_port, "protocol": "TCP"}]
    return template


def build_headless_service(owner: Owner) -> dict[str, Any]:
    """The group members' DNS names (<pod>.NAME-group), published before they are ready."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(owner, headless_service_name(owner.name)),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": selector_labels(owner.name),
            "ports": [{"name": "rendezvous", "port": RENDEZVOUS_PORT, "targetPort": "rendezvous", "protocol": "TCP"}],
        },
    }


def build_statefulset(owner: Owner, spec: InferenceServiceSpec, index: int,
                      pool: GroupPool | None = None) -> dict[str, Any]:
    """Group `index` of `pool` (default: the engine pool)."""
    pool = pool or group_pools(owner.name, spec)[0]
    group = group_name(pool.base, index)
    rank_env = [{"name": NODE_RANK_ENV, "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{POD_INDEX_LABEL}']"}}}]
    port = pool.rendezvous_port(index)
    args = group_args(spec, leader_address(owner, index, pool.base), f"$({NODE_RANK_ENV})", ENGINE_PORT, port)
    metadata = _metadata(owner, group)
    metadata["labels"] = {**metadata["labels"], GROUP_LABEL: group}
    return {
        "apiVersion": "apps/v1",
        "kind": STATEFULSET,
        "metadata": metadata,
        "spec": {
            "replicas": spec.engine.parallelism.nodes,
            "serviceName": headless_service_name(owner.name),
            "podManagementPolicy": "Parallel",
            "updateStrategy": {"type": "OnDelete"},  # the reconcile restarts a whole group at a time
            "revisionHistoryLimit": 3,
            "selector": {"matchLabels": {**selector_labels(owner.name), GROUP_LABEL: group}},
            "template": _group_template(spec, owner.name, args, rank_env, {GROUP_LABEL: group}, port, pool.role),
        },
    }


def build_leader_worker_set(owner: Owner, spec: InferenceServiceSpec, pool: GroupPool | None = None) -> dict[str, Any]:
    """The LeaderWorkerSet of `pool` (default: the engine pool). Each group has a leader address of
    its own, so both pools' groups rendezvous on RENDEZVOUS_PORT."""
    pool = pool or group_pools(owner.name, spec)[0]
    rank = f"$({LWS_WORKER_INDEX_ENV})"
    args = group_args(spec, f"$({LWS_LEADER_ADDRESS_ENV})", rank, WORKER_HEALTH_PORT)
    leader = _group_template(spec, owner.name, args, [], {}, role=pool.role)
    worker = _group_template(spec, owner.name, args, [], {}, role=pool.role)
    for container in worker["spec"]["containers"]:
        if container["name"] == CONTAINER_NAME:  # no HTTP port: /health and /ready on the worker port only
            container["ports"] = [{"name": "health", "containerPort": WORKER_HEALTH_PORT, "protocol": "TCP"},
                                  *(p for p in container["ports"] if p["name"] != "http")]
            for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
                container[probe]["httpGet"]["port"] = "health"
    worker["metadata"]["annotations"] = {k: v for k, v in worker["metadata"]["annotations"].items()
                                         if not k.startswith("prometheus.io/")}  # metrics are the leader's
    return {
        "apiVersion": f"{LWS_GROUP}/{LWS_VERSION}",
        "kind": LEADER_WORKER_SET,
        "metadata": _metadata(owner, pool.base),
        "spec": {
            "replicas": pool.replicas,
            "startupPolicy": "LeaderCreated",
            "leaderWorkerTemplate": {
                "size": spec.engine.parallelism.nodes,
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": leader,
                "workerTemplate": worker,
            },
        },
    }


def build_groups(owner: Owner, spec: InferenceServiceSpec, lws: bool) -> list[dict[str, Any]]:
    """The engine workload of a multi-node spec, in write order (`lws`: whether the API server
    serves LeaderWorkerSets)."""
    pools = group_pools(owner.name, spec)
    if lws:
        return [build_leader_worker_set(owner, spec, pool) for pool in pools]
    return [build_headless_service(owner),
            *(build_statefulset(owner, spec, i, pool) for pool in pools for i in range(pool.replicas))]


def leftover_keys(name: str) -> list[tuple[str, str]]:
    """(kind, name) of the fixed-name objects some workload shape makes: the Deployment (one node),
    the headless Service (StatefulSet groups) and the LeaderWorkerSets (the engine pool's, the
    prefill pool's). The StatefulSets are listed."""
    return [("Deployment", name), ("Service", headless_service_name(name)), (LEADER_WORKER_SET, name),
            (LEADER_WORKER_SET, prefill_name(name))]


def leftover_reason(spec: InferenceServiceSpec, lws: bool, prefill_pool: bool = False) -> str:
    """Why an engine workload of another shape goes (the Event's words); `prefill_pool`: it is the
    prefill pool's."""
    nodes = spec.engine.parallelism.nodes
    if prefill_pool and not spec.disaggregation.enabled:
        return "spec.disaggregation.enabled is false"
    if nodes == 1:
        return "spec.engine.parallelism.nodes is 1: the engines are a Deployment"
    return (f"spec.engine.parallelism.nodes is {nodes} and the API server serves {LWS_PLURAL}.{LWS_GROUP}" if lws
            else f"spec.engine.parallelism.nodes is {nodes} and the API server does not serve {LWS_PLURAL}.{LWS_GROUP}")


def pool_of(name: str, statefulset: str) -> tuple[str, int] | None:
    """(the pool's base name, the group's index) of StatefulSet `statefulset` of InferenceService
    `name`, for either pool (None: not a group's name)."""
    for base in (name, prefill_name(name)):
        index = group_index(base, statefulset)
        if index is not None:
            return base, index
    return None


def by_pool(name: str, statefulsets: list[dict]) -> dict[str, list[dict]]:
    """The group StatefulSets by their pool's base name (both keys always present)."""
    out: dict[str, list[dict]] = {name: [], prefill_name(name): []}
    for sts in statefulsets:
        found = pool_of(name, sts["metadata"]["name"])
        if found is not None:
            out[found[0]].append(sts)
    return out


def surplus_statefulsets(name: str, spec: InferenceServiceSpec, lws: bool,
                         statefulsets: list[dict]) -> list[tuple[dict, str]]:
    """(StatefulSet, why) of the group StatefulSets the spec no longer wants, highest index first:
    past their pool's replicas, a whole pool the spec no longer runs (disaggregation off), or all of
    them when the engines are a Deployment or LeaderWorkerSets."""
    wanted = {pool.base: pool for pool in group_pools(name, spec)} if is_group(spec) and not lws else {}
    out = []
    for sts in statefulsets:
        found = pool_of(name, sts["metadata"]["name"])
        if found is None:
            continue
        base, index = found
        pool = wanted.get(base)
        if pool is not None and index < pool.replicas:
            continue
        why = (f"{pool.replicas_field} is {pool.replicas} groups" if pool is not None
               else leftover_reason(spec, lws, prefill_pool=base != name))
        out.append((sts, why, index))
    return [(sts, why) for sts, why, _ in sorted(out, key=lambda item: -item[2])]


def _restarted(pod: dict) -> bool:
    status = pod.get("status") or {}
    return status.get("phase") == "Failed" or any(
        (c.get("restartCount") or 0) > 0 for c in status.get("containerStatuses") or [])


def _ready(pod: dict) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (pod.get("status") or {}).get("conditions") or [])


def group_ready(sts: dict, pods: list[dict]) -> bool:
    """Every member exists, runs the StatefulSet's current revision and is ready."""
    want = (sts.get("spec") or {}).get("replicas", 0)
    revision = (sts.get("status") or {}).get("updateRevision")
    live = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
    return (len(live) == want and all(_ready(p) for p in live)
            and all((p["metadata"].get("labels") or {}).get(REVISION_LABEL) == revision for p in live))


def members(sts: dict, pods: list[dict]) -> list[dict]:
    """The pods `sts` controls (by its UID)."""
    uid = sts["metadata"]["uid"]
    return [p for p in pods if any(r.get("controller") and r.get("uid") == uid
                                   for r in p["metadata"].get("ownerReferences") or [])]


def groups_to_restart(statefulsets: list[dict], pods: list[dict]) -> list[tuple[dict, str]]:
    """(StatefulSet, why) of the groups of one pool whose pods the reconcile deletes (the
    StatefulSet makes them again, and the new members rendezvous afresh): every group with a member
    that failed or restarted (the others are waiting on a peer that lost its state), and, when
    every other group is ready, the first group of an old revision (a rolling update, one group at
    a time)."""
    out: list[tuple[dict, str]] = []
    outdated: list[dict] = []
    ready = 0
    for sts in statefulsets:
        live = [p for p in members(sts, pods) if not p["metadata"].get("deletionTimestamp")]
        broken = [p["metadata"]["name"] for p in live if _restarted(p)]
        revision = (sts.get("status") or {}).get("updateRevision")
        if broken:
            out.append((sts, f"member {', '.join(sorted(broken))} failed or restarted"))
        elif revision and any((p["metadata"].get("labels") or {}).get(REVISION_LABEL) != revision for p in live):
            outdated.append(sts)
        elif group_ready(sts, live):
            ready += 1
    if outdated and not out and ready == len(statefulsets) - len(outdated):
        out.append((outdated[0], "its pods run an old revision of the template"))
    return out


def groups_summary(spec: InferenceServiceSpec, statefulsets: list[dict], pods: list[dict],
                   lws: dict | None = None) -> dict[str, Any]:
    """The groups counted as a Deployment's status counts pods (operator/status.py reads this):
    replicas = groups that exist, readyReplicas = groups ready in every member, updatedReplicas =
    groups on the current template."""
    if lws is not None:
        counts = lws.get("status") or {}
        return {"metadata": {"generation": 0}, "status": {
            "observedGeneration": 0, "replicas": counts.get("replicas", 0),
            "readyReplicas": counts.get("readyReplicas", 0), "updatedReplicas": counts.get("updatedReplicas", 0)}}
    replicas = ready = updated = 0
    for sts in statefulsets:
        status, live = sts.get("status") or {}, members(sts, pods)
        current = (status.get("observedGeneration", 0) >= sts["metadata"].get("generation", 0)
                   and status.get("updatedReplicas", 0) >= spec.engine.parallelism.nodes)
        replicas += 1
        updated += int(current)
        ready += int(current and group_ready(sts, live))
    return {"metadata": {"generation": 0},
            "status": {"observedGeneration": 0, "replicas": replicas, "readyReplicas": ready, "updatedReplicas": updated}}
