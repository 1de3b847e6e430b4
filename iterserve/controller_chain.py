"""Which engine pods belong to an InferenceService: the rule the router (where it routes) and the
autoscaler (whom it reads and sends the admin token) share.

Labels prove nothing, and neither does an ownerReference alone: anyone who may create pods in
the namespace can copy both, the ReplicaSet's UID and its pod-template-hash included (they are
readable, and the hash is a function of the template). So a pod is verified only through the
chain the Deployment controller builds, as read from the API server:

1. the Deployment is the InferenceService's (its controller ownerReference names the
   InferenceService; `owner_uid` checks the UID where the caller knows it);
2. the ReplicaSet's controller ownerReference is that Deployment's UID;
3. the pod's controller ownerReference is that ReplicaSet's UID, its pod-template-hash label is
   the ReplicaSet's, and it was created no earlier than the ReplicaSet;
4. what the pod runs is the ReplicaSet's template: the same containers (name, image, command,
   args, env, envFrom, volumeMounts), init containers and volumes. A copy that runs our engine
   with our arguments on our volumes is our engine; one that differs in any of these is not.

A multi-node group's pods (operator/groups.py) are a StatefulSet's: the StatefulSet is the
InferenceService's (or its LeaderWorkerSet's, which is the InferenceService's), the pod's
controller ownerReference is that StatefulSet's UID, its controller-revision-hash label names a
ControllerRevision that StatefulSet controls, it was created no earlier than the StatefulSet, and
it runs the template that revision records (a StatefulSet keeps each template it had there, as a
Deployment keeps them in its ReplicaSets).

Pure: objects in, verdicts out (with a machine-readable reason for each refused pod).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

TEMPLATE_HASH_LABEL = "pod-template-hash"
CONTAINER_FIELDS = ("name", "image", "command", "args", "env", "envFrom", "volumeMounts")
# Refusal reasons (Refused.reason)
NO_DEPLOYMENT = "no_verified_deployment"
NOT_OUR_REPLICA_SET = "owner_not_our_replica_set"
HASH_MISMATCH = "template_hash_mismatch"
PREDATES_REPLICA_SET = "created_before_replica_set"
SPEC_MISMATCH = "spec_differs_from_template"
NOT_OUR_STATEFUL_SET = "owner_not_our_stateful_set"
REVISION_LABEL = "controller-revision-hash"
# What the LeaderWorkerSet controller's pod webhook adds to every container of the pods it makes
# (its AddLWSVariables), never to the template: left out of the comparison for those pods only.
LWS_INJECTED_ENV = ("LWS_LEADER_ADDRESS", "LWS_GROUP_SIZE", "LWS_WORKER_INDEX")


@dataclass(frozen=True)
class Refused:
    pod: str
    reason: str


def controller(obj: dict) -> dict | None:
    return next((r for r in (obj.get("metadata") or {}).get("ownerReferences") or [] if r.get("controller")), None)


def deployment_is_owned(deployment: dict | None, owner_name: str, owner_uid: str | None = None) -> bool:
    """Whether the Deployment's (or any object's) controller is the InferenceService `owner_name`
    (and `owner_uid`)."""
    ref = controller(deployment) if deployment else None
    return bool(ref and ref.get("kind") == "InferenceService" and ref.get("name") == owner_name
                and (owner_uid is None or ref.get("uid") == owner_uid))


def stateful_sets_owned(stateful_sets: Sequence[dict], owner_name: str, owner_uid: str | None = None,
                        leader_worker_set: dict | None = None) -> list[dict]:
    """The StatefulSets the InferenceService controls, directly or through `leader_worker_set`
    (the live LeaderWorkerSet of its name, when there is one and it is the InferenceService's)."""
    lws_uid = (leader_worker_set["metadata"]["uid"]
               if leader_worker_set and deployment_is_owned(leader_worker_set, owner_name, owner_uid) else None)
    out = []
    for sts in stateful_sets:
        ref = controller(sts) or {}
        if deployment_is_owned(sts, owner_name, owner_uid) or (
                lws_uid and ref.get("kind") == "LeaderWorkerSet" and ref.get("uid") == lws_uid):
            out.append(sts)
    return out


def _created(obj: dict) -> datetime | None:
    stamp = (obj.get("metadata") or {}).get("creationTimestamp")
    try:
        return datetime.fromisoformat(stamp.replace("Z", "+00:00")) if stamp else None
    except (AttributeError, ValueError):
        return None


# The ServiceAccount admission plugin adds this volume (the pod's own token) to pods, never to
# templates; it is left out of the comparison (a look-alike gains nothing from its own token).
SERVICE_ACCOUNT_VOLUME_PREFIX = "kube-api-access-"


def _injected(item: dict) -> bool:
    return str(item.get("name", "")).startswith(SERVICE_ACCOUNT_VOLUME_PREFIX)


def _containers(spec: dict, key: str) -> list[dict]:
    out = []
    for container in spec.get(key) or []:
        fields = {f: container.get(f) or None for f in CONTAINER_FIELDS}
        fields["volumeMounts"] = [m for m in fields["volumeMounts"] or [] if not _injected(m)] or None
        out.append(fields)
    return out


def runs_template(pod: dict, replica_set: dict) -> bool:
    template = ((replica_set.get("spec") or {}).get("template") or {}).get("spec") or {}
    spec = pod.get("spec") or {}
    return (_containers(spec, "containers") == _containers(template, "containers")
            and _containers(spec, "initContainers") == _containers(template, "initContainers")
            and [v for v in spec.get("volumes") or [] if not _injected(v)]
            == [v for v in template.get("volumes") or [] if not _injected(v)])


def check_pod(pod: dict, replica_sets_by_uid: dict[str, dict]) -> str | None:
    """None when the pod's chain holds up to `replica_sets_by_uid` (the verified ReplicaSets), else why not."""
    ref = controller(pod)
    replica_set = replica_sets_by_uid.get(ref.get("uid")) if ref and ref.get("kind") == "ReplicaSet" else None
    if replica_set is None:
        return NOT_OUR_REPLICA_SET
    labels = (pod.get("metadata") or {}).get("labels") or {}
    if labels.get(TEMPLATE_HASH_LABEL) != ((replica_set["metadata"].get("labels") or {}).get(TEMPLATE_HASH_LABEL)):
        return HASH_MISMATCH
    pod_created, rs_created = _created(pod), _created(replica_set)
    if pod_created is None or rs_created is None or pod_created < rs_created:
        return PREDATES_REPLICA_SET
    if not runs_template(pod, replica_set):
        return SPEC_MISMATCH
    return None


def check_stateful_pod(pod: dict, stateful_sets_by_uid: dict[str, dict], revisions: Sequence[dict]) -> str | None:
    """None when the pod's chain holds up to `stateful_sets_by_uid` (the verified StatefulSets),
    reading the templates from `revisions` (ControllerRevisions), else why not."""
    ref = controller(pod)
    sts = stateful_sets_by_uid.get(ref.get("uid")) if ref and ref.get("kind") == "StatefulSet" else None
    if sts is None:
        return NOT_OUR_STATEFUL_SET
    named = ((pod.get("metadata") or {}).get("labels") or {}).get(REVISION_LABEL)
    revision = next((r for r in revisions if r["metadata"].get("name") == named
                     and (controller(r) or {}).get("uid") == sts["metadata"]["uid"]), None)
    if revision is None:
        return HASH_MISMATCH
    pod_created, sts_created = _created(pod), _created(sts)
    if pod_created is None or sts_created is None or pod_created < sts_created:
        return PREDATES_REPLICA_SET
    template = (((revision.get("data") or {}).get("spec") or {}).get("template")) or {}
    if (controller(sts) or {}).get("kind") == "LeaderWorkerSet":
        pod = _without_injected_env(pod, template)
    if not runs_template(pod, {"spec": {"template": template}}):
        return SPEC_MISMATCH
    return None


def _without_injected_env(pod: dict, template: dict) -> dict:
    """The pod with LWS_INJECTED_ENV taken out of each container the template does not set them in."""
    by_name = {c.get("name"): c for c in (template.get("spec") or {}).get("containers") or []}
    spec = dict(pod.get("spec") or {})
    containers = []
    for container in spec.get("containers") or []:
        declared = {e.get("name") for e in (by_name.get(container.get("name")) or {}).get("env") or []}
        env = [e for e in container.get("env") or [] if e.get("name") not in LWS_INJECTED_ENV or e.get("name") in declared]
        containers.append({**container, "env": env})
    spec["containers"] = containers
    return {**pod, "spec": spec}


def verify(pods: Sequence[dict], deployments: Sequence[dict], replica_sets: Sequence[dict],
           stateful_sets: Sequence[dict] = (), revisions: Sequence[dict] = ()) -> tuple[list[dict], list[Refused]]:
    """The pods whose chain reaches one of `deployments` or `stateful_sets` (already checked to be
    the InferenceService's), and a Refused for each other pod."""
    deployment_uids = {d["metadata"]["uid"] for d in deployments}
    ours = {rs["metadata"]["uid"]: rs for rs in replica_sets
            if (controller(rs) or {}).get("kind") == "Deployment" and (controller(rs) or {}).get("uid") in deployment_uids}
    sets = {s["metadata"]["uid"]: s for s in stateful_sets}
    verified, refused = [], []
    for pod in pods:
        if (controller(pod) or {}).get("kind") == "StatefulSet":
            reason = check_stateful_pod(pod, sets, revisions) if sets else NO_DEPLOYMENT
        else:
            reason = check_pod(pod, ours) if deployment_uids else NO_DEPLOYMENT
        if reason is None:
            verified.append(pod)
        else:
            refused.append(Refused(pod["metadata"]["name"], reason))
    return verified, refused
