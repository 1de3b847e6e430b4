"""Pure builders for how requests reach an InferenceService's engines (spec.routing.mode):

- Router (the default): an `iterserve router` Deployment (two replicas, a PodDisruptionBudget
  keeping one up through node drains) + the RBAC it needs (get/list/watch pods in its own
  namespace, nothing more), and the InferenceService's Service selecting the router pods instead
  of the engines; the router watches the engine pods itself. A router pod that stops first
  sleeps in preStop (the Service's endpoints drop it), then drains (--drain-grace) within its
  termination grace period.
- Gateway: an InferencePool (inference.networking.k8s.io/v1) selecting the engine pods, at the
  engine port, with a FailOpen reference to an endpoint picker Service; the engine pods carry
  the label by which the upstream endpoint picker maps vLLM-compatible metric names.
- None: nothing extra; the Service selects the engines (round robin by kube-proxy).

In: the owner and its parsed spec. Out: manifests (dicts) for the reconcile to apply. No API
calls here.
"""

from __future__ import annotations

from typing import Any

from iterserve.operator import groups, kv_auth, router_salt
from iterserve.operator.models import ROUTING_UNAVAILABLE, InferenceServiceSpec
from iterserve.operator.resources import (
    ENGINE_PORT,
    ENGINE_UID,
    MANAGED_BY,
    Owner,
    owner_reference,
    restricted_container,
    selector_labels,
)

ROUTER = "Router"
GATEWAY = "Gateway"
NONE = "None"
ROUTER_PORT = 8000
ROUTER_REPLICAS = 2  # one can be drained or rescheduled while the other serves
ROUTER_MIN_AVAILABLE = 1
# SIGTERM comes after the preStop sleep (time for the endpoints to drop the pod); the router then
# stops accepting and gives requests in flight ROUTER_DRAIN_GRACE_SECONDS; the grace period covers
# both and aiohttp's own shutdown, so the kubelet's SIGKILL never cuts a draining stream.
ROUTER_PRESTOP_SLEEP_SECONDS = 5
ROUTER_DRAIN_GRACE_SECONDS = 30
ROUTER_MAX_HOLD_SECONDS = 300  # a request held at zero replicas waits at most this long for the first one
ROUTER_TERMINATION_GRACE_SECONDS = ROUTER_PRESTOP_SLEEP_SECONDS + ROUTER_DRAIN_GRACE_SECONDS + 10
INFERENCE_POOL_GROUP = "inference.networking.k8s.io"
INFERENCE_POOL_VERSION = "v1"
INFERENCE_POOL_PLURAL = "inferencepools"
ENDPOINT_PICKER_PORT = 9002
# The upstream endpoint picker reads vllm:* gauges from pods labelled so (its default, stated).
ENGINE_TYPE_LABEL = "llm-d.ai/engine-type"
ENGINE_TYPE_VLLM = "vllm"
# The gauges an unmodified endpoint picker reads (exactly one series per name, GIE #2950).
ENDPOINT_PICKER_GAUGES = ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc")
__all__ = ["ROUTING_UNAVAILABLE"]  # the condition's type, defined in models.py


def router_name(name: str) -> str:
    return f"{name}-router"


def router_labels(name: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "iterserve-router", "app.kubernetes.io/instance": name}


def endpoint_picker_name(name: str, spec: InferenceServiceSpec) -> str:
    return spec.routing.endpoint_picker or f"{name}-epp"


def _metadata(owner: Owner, name: str, labels: dict[str, str]) -> dict[str, Any]:
    return {"name": name, "namespace": owner.namespace,
            "labels": {**labels, "app.kubernetes.io/part-of": "iterserve", "app.kubernetes.io/managed-by": MANAGED_BY},
            "ownerReferences": [owner_reference(owner)]}


def service_selector(name: str, spec: InferenceServiceSpec, router_serving: bool = True,
                     lws: bool = False) -> dict[str, str]:
    """What the InferenceService's Service selects: the router pods in Router mode once the router
    serves (`router_serving`: a ready router pod, or the Service selects the router already), else
    the engines (of multi-node groups the leaders only; `lws`: the groups are a LeaderWorkerSet's);
    so switching to Router never leaves the Service without endpoints."""
    if spec.routing.mode == ROUTER and router_serving:
        return router_labels(name)
    return {**selector_labels(name), **groups.leader_selector(spec, lws)}


def engine_pod_labels(spec: InferenceServiceSpec) -> dict[str, str]:
    """Labels the engine pods carry for the routing mode (Gateway: the endpoint picker's engine type)."""
    return {ENGINE_TYPE_LABEL: ENGINE_TYPE_VLLM} if spec.routing.mode == GATEWAY else {}


def router_args(owner: Owner, spec: InferenceServiceSpec | None = None) -> list[str]:
    args = ["--infsvc", owner.name, "-n", owner.namespace, "--host", "0.0.0.0", "--port", str(ROUTER_PORT),
            "--drain-grace", str(ROUTER_DRAIN_GRACE_SECONDS)]
    settings = spec.routing if spec is not None else None
    if settings is not None and settings.max_queue is not None:
        args += ["--max-queue", str(settings.max_queue)]
    if settings is not None and settings.queue_timeout_seconds is not None:
        args += ["--queue-timeout", f"{settings.queue_timeout_seconds:g}"]
    if spec is not None and spec.autoscaling is not None and spec.autoscaling.min_replicas == 0:
        # The pool may be at zero: the router holds requests (the activator) while the first replica
        # starts, as long as the engine may take to start, at most ROUTER_MAX_HOLD_SECONDS.
        args += ["--hold-timeout", str(min(spec.engine.startup_seconds, ROUTER_MAX_HOLD_SECONDS))]
    if spec is not None and spec.disaggregation.enabled:  # the prefill pool is found by the pods' role label
        args += ["--pd-threshold-tokens", str(spec.disaggregation.threshold_tokens),
                 "--pd-max-prefill-queue", str(spec.disaggregation.max_prefill_queue), *kv_auth.args()]
    if spec is not None:  # every replica salts with the one key of Secret NAME-tenant-salt
        args += router_salt.args(spec)
    return args


def build_router_rbac(owner: Owner) -> list[dict[str, Any]]:
    """A ServiceAccount, and a Role + RoleBinding granting it get/list/watch on pods here only, and
    the reads of its engines' controller chain (ReplicaSets, its two engine Deployments; for
    multi-node groups StatefulSets, their ControllerRevisions and its two LeaderWorkerSets)."""
    name, labels = router_name(owner.name), router_labels(owner.name)
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _metadata(owner, name, labels),
         "automountServiceAccountToken": True},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": _metadata(owner, name, labels),
         "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
                   # the controller chain the router checks before routing to a pod (discovery.py)
                   {"apiGroups": ["apps"], "resources": ["replicasets"], "verbs": ["list"]},
                   {"apiGroups": ["apps"], "resources": ["deployments"], "verbs": ["get"],
                    "resourceNames": [owner.name, f"{owner.name}-prefill"]},
                   {"apiGroups": ["apps"], "resources": ["statefulsets", "controllerrevisions"], "verbs": ["list"]},
                   {"apiGroups": ["leaderworkerset.x-k8s.io"], "resources": ["leaderworkersets"], "verbs": ["get"],
                    "resourceNames": [owner.name, f"{owner.name}-prefill"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": _metadata(owner, name, labels),
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
         "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": owner.namespace}]},
    ]


def build_router_deployment(owner: Owner, spec: InferenceServiceSpec) -> dict[str, Any]:
    name, labels = router_name(owner.name), router_labels(owner.name)
    disaggregated = spec.disaggregation.enabled  # the router signs kv_transfer_params with the KV key
    probe = lambda path: {"httpGet": {"path": path, "port": "http"}, "periodSeconds": 5,  # noqa: E731
                          "failureThreshold": 3, "timeoutSeconds": 2}
    container = {
        "name": "router",
        "image": spec.engine.image,  # the engine image holds the whole iterserve package
        "imagePullPolicy": spec.engine.image_pull_policy,
        "command": ["iterserve", "router"],
        "args": router_args(owner, spec),
        "ports": [{"name": "http", "containerPort": ROUTER_PORT, "protocol": "TCP"}],
        "env": [{"name": "HOME", "value": "/tmp"}],
        # /health, not /ready: a router with no ready engine must stay behind the Service and answer
        # 503 with Retry-After itself, rather than leave clients a refused connection.
        "readinessProbe": probe("/health"),
        "livenessProbe": probe("/health"),
        # Liveness begins once /health first answers: a start slower than liveness' 15 s (a loaded
        # node, a cold image) is not killed in a loop. Up to 120 s.
        "startupProbe": {**probe("/health"), "periodSeconds": 2, "failureThreshold": 60},
        "lifecycle": {"preStop": {"sleep": {"seconds": ROUTER_PRESTOP_SLEEP_SECONDS}}},
        "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"memory": "512Mi"}},
        "securityContext": {"readOnlyRootFilesystem": True, **restricted_container()},
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}, *([kv_auth.mount()] if disaggregated else []),
                         *router_salt.mounts(spec)],
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(owner, name, {**labels, "app.kubernetes.io/component": "router"}),
        "spec": {
            "replicas": ROUTER_REPLICAS,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": {**labels, "app.kubernetes.io/component": "router"},
                             "annotations": {"prometheus.io/scrape": "true", "prometheus.io/port": str(ROUTER_PORT),
                                             "prometheus.io/path": "/metrics"}},
                "spec": {
                    "serviceAccountName": name,
                    "terminationGracePeriodSeconds": ROUTER_TERMINATION_GRACE_SECONDS,
                    **_router_scheduling(spec),
                    "containers": [container],
                    "volumes": [{"name": "tmp", "emptyDir": {}},
                                *([kv_auth.volume(owner.name)] if disaggregated else []),
                                *router_salt.volumes(owner.name, spec)],
                    "enableServiceLinks": False,
                    "securityContext": {"runAsNonRoot": True, "runAsUser": ENGINE_UID, "runAsGroup": ENGINE_UID,
                                        "seccompProfile": {"type": "RuntimeDefault"}},
                },
            },
        },
    }


def build_router_disruption_budget(owner: Owner) -> dict[str, Any]:
    """Voluntary evictions (node drains, upgrades) leave at least one router pod serving."""
    name, labels = router_name(owner.name), router_labels(owner.name)
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": _metadata(owner, name, {**labels, "app.kubernetes.io/component": "router"}),
            "spec": {"minAvailable": ROUTER_MIN_AVAILABLE, "selector": {"matchLabels": labels}}}


def _router_scheduling(spec: InferenceServiceSpec) -> dict[str, Any]:
    """The engines' nodeSelector and tolerations: the router runs where its engines may (near them,
    and on clusters that keep workloads on labelled or tainted nodes)."""
    from iterserve.operator.resources import pod_scheduling

    return pod_scheduling(spec, with_affinity=False)


def build_inference_pool(owner: Owner, spec: InferenceServiceSpec, lws: bool = False) -> dict[str, Any]:
    return {
        "apiVersion": f"{INFERENCE_POOL_GROUP}/{INFERENCE_POOL_VERSION}",
        "kind": "InferencePool",
        "metadata": _metadata(owner, owner.name, selector_labels(owner.name)),
        "spec": {
            "selector": {"matchLabels": {**selector_labels(owner.name), **groups.leader_selector(spec, lws)}},
            "targetPorts": [{"number": ENGINE_PORT}],
            "endpointPickerRef": {
                "group": "", "kind": "Service", "name": endpoint_picker_name(owner.name, spec),
                "port": {"number": ENDPOINT_PICKER_PORT}, "failureMode": "FailOpen",
            },
        },
    }


def build_routing(owner: Owner, spec: InferenceServiceSpec, pool_served: bool = True,
                  lws: bool = False) -> list[dict[str, Any]]:
    """The objects the routing mode adds to the engine Deployment, Service and ConfigMap, in write
    order (`pool_served`: whether the API server serves InferencePools; none is built otherwise)."""
    mode = spec.routing.mode
    if mode == ROUTER:
        return [*build_router_rbac(owner), build_router_deployment(owner, spec), build_router_disruption_budget(owner)]
    if mode == GATEWAY and pool_served:
        return [build_inference_pool(owner, spec, lws)]
    return []


def routing_object_keys(name: str) -> list[tuple[str, str]]:
    """(kind, name) of every object some routing mode creates: what a mode switch may leave behind."""
    router = router_name(name)
    return [("PodDisruptionBudget", router), ("Deployment", router), ("RoleBinding", router), ("Role", router),
            ("ServiceAccount", router), ("InferencePool", name)]


def may_delete_leftover(obj: dict, name: str, service: dict | None) -> bool:
    """Whether a routing object another mode left behind may go now. The router's objects wait
    until the Service, as read at the start of this pass, already selects the engines: a mode
    switch moves the Service in one pass and removes the router in a later one, so clients are
    never sent to a router that is stopping, and the router drains what it still holds."""
    if obj["metadata"]["name"] != router_name(name):
        return True
    return service is not None and (service.get("spec") or {}).get("selector") != router_labels(name)


def routing_condition(name: str, spec: InferenceServiceSpec, pool_served: bool,
                      router: dict | None) -> tuple[str, str, str]:
    """(status, reason, message) of the RoutingUnavailable condition; `router`: the live router Deployment."""
    mode = spec.routing.mode
    if mode == GATEWAY and not pool_served:
        return ("True", "InferencePoolCRDMissing",
                f"spec.routing.mode is Gateway but the API server does not serve {INFERENCE_POOL_PLURAL}."
                f"{INFERENCE_POOL_GROUP}/{INFERENCE_POOL_VERSION}: install the Gateway API Inference Extension's "
                f"CRDs (its manifests.yaml), or set spec.routing.mode to Router or None. Meanwhile Service {name} "
                "selects the engine pods directly.")
    if mode == GATEWAY:
        return ("False", "InferencePoolApplied",
                f"InferencePool {name} selects the engine pods; endpoint picker Service "
                f"{endpoint_picker_name(name, spec)}:{ENDPOINT_PICKER_PORT} (FailOpen).")
    if mode == ROUTER:
        ready = ((router or {}).get("status") or {}).get("readyReplicas", 0)
        return ("False", "RouterDeployed", f"Service {name} -> router Deployment {router_name(name)} "
                                           f"({ready}/{ROUTER_REPLICAS} ready) -> the engine pods.")
    return "False", "ServiceSelectsEngines", f"spec.routing.mode is None: Service {name} selects the engine pods."


def router_ready(router: dict | None) -> bool:
    return ((router or {}).get("status") or {}).get("readyReplicas", 0) >= 1
