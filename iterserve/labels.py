"""The labels that tie an InferenceService to its engine pods, owned here because two layers read
them: the operator sets them on every pod it builds (operator/resources.py), and the router and
the autoscaler select pods by them (router/discovery.py, operator/autoscaling/hook.py). A module
with no imports, so neither side imports the other to agree on a name.
"""

from __future__ import annotations

# The engine's --role on the pod: prefill | decode | both (absent: both). The router's P/D path
# and the autoscaler's per-pool readings split pods by it.
ROLE_LABEL = "iterserve.dev/role"
PREFILL, DECODE = "prefill", "decode"


def selector_labels(name: str) -> dict[str, str]:
    """The labels every engine pod of InferenceService `name` carries, whatever its role."""
    return {"app.kubernetes.io/name": "iterserve-engine", "app.kubernetes.io/instance": name}


def selector_string(name: str) -> str:
    """`selector_labels` as a label selector (the scale subresource's status.selector, pod lists)."""
    return ",".join(f"{k}={v}" for k, v in selector_labels(name).items())


# Multi-node groups (operator/groups.py): the group a pod belongs to (its StatefulSet's name), and
# the index each workload controller sets on its pods (0: the group's leader).
GROUP_LABEL = "iterserve.dev/group"
POD_INDEX_LABEL = "apps.kubernetes.io/pod-index"  # the StatefulSet controller's
LWS_WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"  # the LeaderWorkerSet controller's


def is_leader(pod: dict) -> bool:
    """Whether an engine pod takes requests: every pod outside a group, and a group's index 0. The
    index is the one its controller set (StatefulSet: the pod-index label, else the ordinal its
    name ends in; LeaderWorkerSet: the worker-index label). Workers serve only /health and /ready:
    the router, the autoscaler's scrape and the admin retune skip them."""
    meta = pod.get("metadata") or {}
    labels = meta.get("labels") or {}
    if LWS_WORKER_INDEX_LABEL in labels:
        return labels[LWS_WORKER_INDEX_LABEL] == "0"
    owner = next((r for r in meta.get("ownerReferences") or [] if r.get("controller")), None)
    if owner is None or owner.get("kind") != "StatefulSet":
        return True
    return (labels.get(POD_INDEX_LABEL) or str(meta.get("name", "")).rpartition("-")[2]) == "0"
