"""Every Kubernetes API permission the operator's code uses, with the call that needs it.

The Helm chart's Role/ClusterRole must grant exactly these (its RBAC test compares), and the
integration tests run the operator as a ServiceAccount bound to nothing more than these rules.
When code starts making a new API call, add its rule here in the same commit.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Rule:
    api_group: str
    resource: str
    verbs: tuple[str, ...]
    why: str


# On namespaced resources: a ClusterRole (cluster-wide mode) or a Role in each watched namespace.
RULES: tuple[Rule, ...] = (
    Rule("iterserve.dev", "inferenceservices", ("get", "list", "watch", "patch"),
         "kopf watches them and patches its annotations; the reconcile reads them fresh; the builtin "
         "autoscaler sets spec.replicas (and spec.disaggregation.prefill.replicas for the prefill pool)"),
    Rule("iterserve.dev", "inferenceservices/status", ("patch",),
         "the reconcile writes status (conditions, replicas, selector)"),
    Rule("iterserve.dev", "inferenceservices/finalizers", ("update",),
         "owner references with blockOwnerDeletion, where OwnerReferencesPermissionEnforcement is on"),
    Rule("apps", "deployments", ("get", "list", "watch", "create", "patch", "delete"),
         "engine and router Deployments: server-side apply (patch, or create when missing); drift watch; "
         "delete: the router's, when spec.routing.mode leaves Router"),
    Rule("", "services", ("get", "list", "watch", "create", "patch"),
         "engine Services: server-side apply; a deleted one is noticed and recreated"),
    Rule("", "configmaps", ("get", "list", "watch", "create", "patch"),
         "engine configuration (effective max_num_seqs): server-side apply; drift watch"),
    Rule("", "secrets", ("get", "create"),
         "the engine admin token, created once, never listed or watched"),
    Rule("", "events", ("create",),
         "an Event on the InferenceService for every change"),
    Rule("", "pods", ("get", "list", "watch", "delete"),
         "list: the autoscaler finds the engine pods, their readiness and addresses, to read their metrics; "
         "get, watch: only held so that the operator may grant them to the router's Role (RBAC lets no one "
         "grant what it lacks); delete: a multi-node group's pods, to restart the group when a member failed"),
    Rule("", "serviceaccounts", ("get", "create", "patch", "delete"),
         "the router's ServiceAccount (Router mode): server-side apply; delete on a mode switch"),
    Rule("rbac.authorization.k8s.io", "roles", ("get", "create", "patch", "delete"),
         "the router's Role (get/list/watch pods in its namespace): server-side apply; delete on a mode switch"),
    Rule("rbac.authorization.k8s.io", "rolebindings", ("get", "create", "patch", "delete"),
         "binds the router's Role to its ServiceAccount: server-side apply; delete on a mode switch"),
    Rule("inference.networking.k8s.io", "inferencepools", ("get", "create", "patch", "delete"),
         "the InferencePool (Gateway mode): server-side apply; delete on a mode switch"),
    Rule("networking.k8s.io", "networkpolicies", ("get", "create", "patch", "delete"),
         "the engines' NetworkPolicy: server-side apply; delete when the operator runs with --no-network-policy"),
    Rule("policy", "poddisruptionbudgets", ("get", "create", "patch", "delete"),
         "the router's PodDisruptionBudget (Router mode): server-side apply; delete on a mode switch"),
    Rule("apps", "replicasets", ("list",),
         "the autoscaler trusts only pods of its Deployment's current ReplicaSet"),
    Rule("apps", "statefulsets", ("get", "list", "watch", "create", "patch", "delete"),
         "multi-node groups, one StatefulSet each: server-side apply; list: the groups past spec.replicas, to "
         "delete; watch: drift and readiness"),
    Rule("apps", "controllerrevisions", ("list",),
         "the templates a group's pods run, for the chain check (and granted to the router's Role)"),
    Rule("leaderworkerset.x-k8s.io", "leaderworkersets", ("get", "create", "patch", "delete"),
         "multi-node groups as a LeaderWorkerSet where the cluster serves it: server-side apply; delete when "
         "the engines take another shape"),
)

# Only with kopf peering on (`iterserve operator run --peering NAME`, several operator replicas).
PEERING_RULES: tuple[Rule, ...] = (
    Rule("kopf.dev", "kopfpeerings", ("get", "list", "watch", "patch"), "kopf peering, namespaced mode"),
)
CLUSTER_PEERING_RULES: tuple[Rule, ...] = (
    Rule("kopf.dev", "clusterkopfpeerings", ("get", "list", "watch", "patch"), "kopf peering, cluster-wide mode"),
)


def policy_rules(rules: tuple[Rule, ...] = RULES) -> list[dict]:
    """As the `rules:` of a Role or ClusterRole."""
    return [{"apiGroups": [r.api_group], "resources": [r.resource], "verbs": list(r.verbs)} for r in rules]


def permissions(rules: tuple[Rule, ...] = RULES) -> set[tuple[str, str, str]]:
    """(apiGroup, resource, verb) triples, for comparing with a rendered role."""
    return {(r.api_group, r.resource, verb) for r in rules for verb in r.verbs}
