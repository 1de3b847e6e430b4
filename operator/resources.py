"""Pure builders: an InferenceService spec -> the Deployment, Service, ConfigMap and admin-token
Secret the operator owns. No API calls here; reconcile.py applies what these return.

The engine reads its tunable max_num_seqs from the ConfigMap (through an env var expanded in its
args, read once at start), so the KV retune changes the ConfigMap, not the pod template, and pods
are not rolled. spec.adapters reach new pods the same way (`--lora-modules` and `--max-loras`
from the ConfigMap), so a changed adapter list rolls nothing: running pods get it through their
admin API (operator/adapters.py). A change of spec.engine.maxNumSeqs itself must reach running engines, so it rolls
them: the template carries the spec value in an annotation (nothing reads it; changing it is
what makes the Deployment roll).
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from iterserve.engine.server.cli import flags_of
from iterserve.labels import DECODE, PREFILL, ROLE_LABEL, selector_labels
from iterserve.labels import selector_string as selector_string  # the pods' selector, re-exported
from iterserve.operator import kv_auth
from iterserve.operator.models import API_VERSION, KIND, AdapterSpec, InferenceServiceSpec

ENGINE_PORT = 8000
METRICS_SERVICE_PORT = 9090
CONTAINER_NAME = "engine"
ENGINE_UID = 10001
GPU_RESOURCE = "nvidia.com/gpu"
MANAGED_BY = "iterserve-operator"
MAX_NUM_SEQS_KEY = "max_num_seqs"
MAX_NUM_SEQS_ENV = "ITERSERVE_MAX_NUM_SEQS"
LORA_MODULES_KEY = "lora_modules"  # spec.adapters as `--lora-modules` items, space-separated
LORA_MODULES_ENV = "ITERSERVE_LORA_MODULES"
MAX_LORAS_KEY = "max_loras"
MAX_LORAS_ENV = "ITERSERVE_MAX_LORAS"
# --max-loras (device slots, each as large as the widest adapter) sized to spec.adapters, up to this:
# more adapters than slots still run (slots are reused); extraArgs' --max-loras sets it instead.
MAX_LORAS_CAP = 8
# ConfigMap keys new pods start with, by the env var their args expand.
CONFIGMAP_ENV = {MAX_NUM_SEQS_ENV: MAX_NUM_SEQS_KEY, LORA_MODULES_ENV: LORA_MODULES_KEY, MAX_LORAS_ENV: MAX_LORAS_KEY}
ADMIN_TOKEN_ENV = "ITERSERVE_ADMIN_TOKEN"
ADMIN_TOKEN_KEY = "token"
SPEC_MAX_NUM_SEQS_ANNOTATION = "iterserve.dev/spec-max-num-seqs"  # the roll trigger (docstring)
# Termination: the preStop hook sleeps while the pod leaves the Service's endpoints (so no new
# request reaches a pod that would refuse it), then SIGTERM makes the engine drain: it refuses new
# requests with 503 and gives in-flight ones --drain-timeout seconds. The grace period covers the
# sleep, the drain and uvicorn's own shutdown.
PRESTOP_SLEEP_SECONDS = 5
SHUTDOWN_MARGIN_SECONDS = 10
# Flags built from typed spec fields; extraArgs may not repeat them (validation.py). Named by the
# serve options they set and read from serve's own parser, so every form of each is listed and a
# flag serve does not have cannot be.
MANAGED_FLAGS = flags_of(
    "host", "port", "model", "max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size",
    "chunked_prefill", "preemption_mode", "kv_cache_memory", "drain_timeout", "role", "kv_transfer_port",
    "kv_advertise_host", "kv_auth_key_file", "tensor_parallel_size", "pipeline_parallel_size", "lora_modules",
    "nnodes", "node_rank", "master_addr", "master_port", "worker_health_port",  # multi-node groups (groups.py)
)
POD_IP_ENV = "POD_IP"
NODE_RANK_ENV = "ITERSERVE_NODE_RANK"  # a multi-node group member's index (operator/groups.py)
RESERVED_ENV = (MAX_NUM_SEQS_ENV, ADMIN_TOKEN_ENV, POD_IP_ENV, NODE_RANK_ENV)
RESERVED_ENV += (LORA_MODULES_ENV, MAX_LORAS_ENV)
# What the restricted Pod Security profile asks of every container; containers a podTemplatePatch
# adds get what they leave out (operator/podsecurity.py refuses patches that loosen it).
def restricted_container() -> dict[str, Any]:
    return {"allowPrivilegeEscalation": False, "runAsNonRoot": True, "capabilities": {"drop": ["ALL"]}}


def restricted_security(given: dict[str, Any] | None) -> dict[str, Any]:
    """A patched container's securityContext over the restricted defaults, merged one level into
    capabilities too: `capabilities: {add: [NET_BIND_SERVICE]}` alone must not lose `drop: [ALL]`."""
    given = given or {}
    return {**restricted_container(), **given,
            "capabilities": {"drop": ["ALL"], **(given.get("capabilities") or {})}}


@dataclass(frozen=True)
class Owner:
    """The InferenceService that owns the objects."""

    name: str
    namespace: str
    uid: str

    @classmethod
    def from_body(cls, body) -> Owner:
        meta = body["metadata"]
        return cls(meta["name"], meta["namespace"], meta["uid"])


def deployment_name(name: str) -> str:
    return name


def service_name(name: str) -> str:
    return name


def configmap_name(name: str) -> str:
    return f"{name}-engine"


def secret_name(name: str) -> str:
    return f"{name}-admin"


def common_labels(name: str) -> dict[str, str]:
    return {
        **selector_labels(name),
        "app.kubernetes.io/component": "engine",
        "app.kubernetes.io/part-of": "iterserve",
        "app.kubernetes.io/managed-by": MANAGED_BY,
    }


def owner_reference(owner: Owner) -> dict[str, Any]:
    return {"apiVersion": API_VERSION, "kind": KIND, "name": owner.name, "uid": owner.uid,
            "controller": True, "blockOwnerDeletion": True}


def controlled_by(obj: dict, owner: Owner) -> bool:
    """Whether `obj` carries this InferenceService's controller reference (the operator's mark:
    objects without it are never patched, whatever their name)."""
    return any(ref.get("controller") and ref.get("uid") == owner.uid and ref.get("kind") == KIND
               for ref in (obj.get("metadata") or {}).get("ownerReferences") or [])


def _metadata(owner: Owner, name: str) -> dict[str, Any]:
    return {"name": name, "namespace": owner.namespace, "labels": common_labels(owner.name),
            "ownerReferences": [owner_reference(owner)]}


def effective_max_num_seqs(spec: InferenceServiceSpec, tuned: int | None) -> int:
    """The value new pods start with: the KV retune's, never above the spec's nor below 1."""
    if tuned is None:
        return spec.engine.max_num_seqs
    return max(1, min(tuned, spec.engine.max_num_seqs))


def role_of(spec: InferenceServiceSpec, role: str | None) -> str | None:
    """The engine role of a pool: `role` (prefill) or, with disaggregation on, decode; else None (both)."""
    return role or (DECODE if spec.disaggregation.enabled else None)


def role_args(spec: InferenceServiceSpec, role: str | None) -> list[str]:
    """--role and the KV transfer listener (advertised at the pod IP) of a disaggregated pool."""
    if role is None:
        return []
    pool = spec.disaggregation.prefill if role == PREFILL else spec.disaggregation.decode
    return ["--role", role, "--kv-transfer-port", str(spec.disaggregation.kv_transfer_port),
            "--kv-advertise-host", f"$({POD_IP_ENV})", *kv_auth.args(), *pool.extra_args]


def _sets_max_loras(spec: InferenceServiceSpec) -> bool:
    given = [*spec.engine.extra_args, *spec.disaggregation.prefill.extra_args, *spec.disaggregation.decode.extra_args]
    return any(arg.split("=", 1)[0] in flags_of("max_loras") for arg in given)


def lora_args(spec: InferenceServiceSpec) -> list[str]:
    """--enable-lora with spec.adapters (from the ConfigMap: the list may change without a roll)."""
    if not spec.adapters:
        return []
    args = ["--enable-lora", "--lora-modules", f"$({LORA_MODULES_ENV})"]
    return args if _sets_max_loras(spec) else [*args, "--max-loras", f"$({MAX_LORAS_ENV})"]


def configmap_data(spec: InferenceServiceSpec, max_num_seqs: int,
                   start_adapters: Sequence[AdapterSpec] | None = None) -> dict[str, str]:
    """What new engine pods start with: max_num_seqs (the spec's or the KV retune's) and the
    adapters (`start_adapters`: spec.adapters less those operator/adapters.py holds back; the
    value may be empty: the pods then start with LoRA on and no adapter)."""
    data = {MAX_NUM_SEQS_KEY: str(max_num_seqs)}
    if spec.adapters:
        start = spec.adapters if start_adapters is None else start_adapters
        data[LORA_MODULES_KEY] = " ".join(f"{a.name}={a.engine_path(spec.model)}" for a in start)
        data[MAX_LORAS_KEY] = str(min(len(spec.adapters), MAX_LORAS_CAP))
    return data


def engine_args(spec: InferenceServiceSpec, role: str | None = None) -> list[str]:
    engine = spec.engine
    args = ["--host", "0.0.0.0", "--port", str(ENGINE_PORT), "--model", spec.model.engine_path,
            "--max-num-seqs", f"$({MAX_NUM_SEQS_ENV})", "--block-size", str(engine.block_size),
            "--preemption-mode", engine.preemption_mode, "--drain-timeout", str(engine.drain_seconds)]
    if engine.max_num_batched_tokens is not None:
        args += ["--max-num-batched-tokens", str(engine.max_num_batched_tokens)]
    if engine.max_model_len is not None:
        args += ["--max-model-len", str(engine.max_model_len)]
    if engine.kv_cache_memory is not None:
        args += ["--kv-cache-memory", engine.kv_cache_memory]
    if not engine.chunked_prefill:
        args.append("--no-chunked-prefill")
    parallel = engine.parallelism
    if parallel.tensor > 1:
        args += ["--tensor-parallel-size", str(parallel.tensor)]
    if parallel.pipeline > 1:
        args += ["--pipeline-parallel-size", str(parallel.pipeline)]
    return args + lora_args(spec) + list(engine.extra_args) + role_args(spec, role_of(spec, role))


def kv_port_range(spec: InferenceServiceSpec) -> tuple[int, int]:
    """The first and last KV transfer port of a disaggregated group: rank r of tensor x pipeline
    listens on kvTransferPort + r (engine/kv_transfer/sharded.py), whichever node runs it."""
    first = spec.disaggregation.kv_transfer_port
    return first, first + spec.engine.parallelism.tensor * spec.engine.parallelism.pipeline - 1


def kv_transfer_ports(spec: InferenceServiceSpec) -> list[dict[str, Any]]:
    """A disaggregated pod's KV transfer listeners: the whole range, on every pod. A one-node pod runs
    every rank; a group's members share one template (a StatefulSet's, or LWS's worker template),
    and the NetworkPolicy opens the range to every decode pod anyway, so a member declares the ports
    of the other nodes' ranks too."""
    first, last = kv_port_range(spec)
    ports = []
    for rank, port in enumerate(range(first, last + 1)):
        name = "kv-transfer" + (f"-{rank}" if rank else "")
        # A port name has at most 15 characters (IANA_SVC_NAME): ranks from 1000 on go unnamed.
        ports.append({**({"name": name} if len(name) <= 15 else {}), "containerPort": port, "protocol": "TCP"})
    return ports


def gpu_count(spec: InferenceServiceSpec) -> int:
    """GPUs per engine pod: as the resources ask; a pod that asks for GPUs under parallelism gets one
    per rank it runs (tensor x pipeline / nodes)."""
    res = spec.engine.resources
    asked = int(str(res.limits.get(GPU_RESOURCE, res.requests.get(GPU_RESOURCE, 0))))
    ranks = spec.engine.parallelism.ranks_per_node
    return ranks if asked and ranks > 1 else asked


def container_resources(spec: InferenceServiceSpec) -> dict[str, Any]:
    requests = {k: str(v) for k, v in spec.engine.resources.requests.items()}
    limits = {k: str(v) for k, v in spec.engine.resources.limits.items()}
    if gpu_count(spec):  # extended resources must be limits, and requests must equal them
        limits[GPU_RESOURCE] = requests[GPU_RESOURCE] = str(gpu_count(spec))
    out = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


def _env(spec: InferenceServiceSpec, name: str) -> list[dict[str, Any]]:
    pod_ip = [{"name": POD_IP_ENV, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}]
    env = [*(pod_ip if spec.disaggregation.enabled else []),
        {"name": MAX_NUM_SEQS_ENV,
         "valueFrom": {"configMapKeyRef": {"name": configmap_name(name), "key": MAX_NUM_SEQS_KEY}}},
        {"name": ADMIN_TOKEN_ENV,
         "valueFrom": {"secretKeyRef": {"name": secret_name(name), "key": ADMIN_TOKEN_KEY}}},
        {"name": "HOME", "value": "/tmp"},
    ]
    env += [{"name": var, "valueFrom": {"configMapKeyRef": {"name": configmap_name(name), "key": CONFIGMAP_ENV[var]}}}
            for var in (LORA_MODULES_ENV, MAX_LORAS_ENV) if f"$({var})" in lora_args(spec)]
    return env + [var.to_wire() for var in spec.engine.env]


def _probe(path: str, period: int, failures: int, timeout: int = 3) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": "http"}, "periodSeconds": period,
            "failureThreshold": failures, "timeoutSeconds": timeout}


def engine_container(spec: InferenceServiceSpec, name: str, role: str | None = None) -> dict[str, Any]:
    engine = spec.engine
    mounts = [{"name": "tmp", "mountPath": "/tmp"}]
    if spec.model.has_volume:
        mounts.append({"name": "model", "mountPath": spec.model.mount_path, "readOnly": True})
    if gpu_count(spec):
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    if role_of(spec, role):
        mounts.append(kv_auth.mount())
    startup_period = 10
    container = {
        "name": CONTAINER_NAME,
        "image": engine.image,
        "imagePullPolicy": engine.image_pull_policy,
        "command": ["iterserve", "serve"],
        "args": engine_args(spec, role),
        "ports": [{"name": "http", "containerPort": ENGINE_PORT, "protocol": "TCP"}] + (
            kv_transfer_ports(spec) if role_of(spec, role) else []),
        "env": _env(spec, name),
        "startupProbe": _probe("/health", startup_period, -(-engine.startup_seconds // startup_period)),
        "livenessProbe": _probe("/health", 10, 3),
        "readinessProbe": _probe("/ready", 5, 2),
        "lifecycle": {"preStop": {"sleep": {"seconds": PRESTOP_SLEEP_SECONDS}}},
        "securityContext": {"readOnlyRootFilesystem": True, **restricted_container()},
        "volumeMounts": mounts,
    }
    resources = container_resources(spec)
    if resources:
        container["resources"] = resources
    return container


def termination_grace_seconds(spec: InferenceServiceSpec) -> int:
    return PRESTOP_SLEEP_SECONDS + spec.engine.drain_seconds + SHUTDOWN_MARGIN_SECONDS


def _volumes(spec: InferenceServiceSpec, name: str) -> list[dict[str, Any]]:
    volumes: list[dict[str, Any]] = [{"name": "tmp", "emptyDir": {}}]
    if spec.model.persistent_volume_claim is not None:
        volumes.append({"name": "model", "persistentVolumeClaim": {
            "claimName": spec.model.persistent_volume_claim.claim_name, "readOnly": True}})
    elif spec.model.volume is not None:
        volumes.append({"name": "model", **spec.model.volume})
    if gpu_count(spec):
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory"}})
    if spec.disaggregation.enabled:
        volumes.append(kv_auth.volume(name))
    return volumes


def pod_scheduling(spec, with_affinity: bool = True) -> dict:
    """spec.scheduling as pod spec fields: nodeSelector, tolerations (with the automatic GPU one),
    affinity (engine pods only, when asked) and priorityClassName."""
    scheduling, out = spec.scheduling, {}
    if scheduling.node_selector:
        out["nodeSelector"] = dict(scheduling.node_selector)
    tolerations = _tolerations(spec)
    if tolerations:
        out["tolerations"] = tolerations
    if with_affinity and scheduling.affinity:
        out["affinity"] = scheduling.affinity
    if scheduling.priority_class_name:
        out["priorityClassName"] = scheduling.priority_class_name
    return out


def _tolerations(spec: InferenceServiceSpec) -> list[dict[str, Any]]:
    tolerations = [t.to_wire() for t in spec.scheduling.tolerations]
    if gpu_count(spec) and not any(t.get("key") == GPU_RESOURCE for t in tolerations):
        tolerations.append({"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"})
    return tolerations


def pod_labels(spec: InferenceServiceSpec, name: str, role: str | None = None) -> dict[str, str]:
    """The engine pods' labels: the selector's, the endpoint picker's in Gateway mode, the pool's role."""
    from iterserve.operator.routing import engine_pod_labels  # routing builds on this module

    role = role_of(spec, role)
    return {**common_labels(name), **engine_pod_labels(spec), **({ROLE_LABEL: role} if role else {})}


def pod_template(spec: InferenceServiceSpec, name: str, role: str | None = None) -> dict[str, Any]:
    pod_spec: dict[str, Any] = {
        "containers": [engine_container(spec, name, role)],
        "volumes": _volumes(spec, name),
        "terminationGracePeriodSeconds": termination_grace_seconds(spec),
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": {
            "runAsNonRoot": True, "runAsUser": ENGINE_UID, "runAsGroup": ENGINE_UID, "fsGroup": ENGINE_UID,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
    }
    pod_spec.update(pod_scheduling(spec))
    template = {
        "metadata": {
            "labels": pod_labels(spec, name, role),
            "annotations": {
                "prometheus.io/scrape": "true",
                "prometheus.io/port": str(ENGINE_PORT),
                "prometheus.io/path": "/metrics",
                SPEC_MAX_NUM_SEQS_ANNOTATION: str(spec.engine.max_num_seqs),
            },
        },
        "spec": pod_spec,
    }
    if spec.pod_template_patch:
        template = merge_patch(template, spec.pod_template_patch)
        # the selector (and the pool's role, by which the router and the prefill selector find it) must keep matching
        role = role_of(spec, role)
        template["metadata"]["labels"].update({**selector_labels(name), **({ROLE_LABEL: role} if role else {})})
        for container in template["spec"].get("containers", []) + template["spec"].get("initContainers", []):
            container["securityContext"] = restricted_security(container.get("securityContext"))
    return template


def build_deployment(owner: Owner, spec: InferenceServiceSpec) -> dict[str, Any]:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(owner, deployment_name(owner.name)),
        "spec": {
            "replicas": spec.replicas,
            "selector": {"matchLabels": selector_labels(owner.name)},
            "revisionHistoryLimit": 3,
            "progressDeadlineSeconds": spec.engine.startup_seconds + 120,
            "template": pod_template(spec, owner.name),
        },
    }


def build_service(owner: Owner, spec: InferenceServiceSpec, router_serving: bool = False,
                  lws: bool = False) -> dict[str, Any]:
    """The InferenceService's Service: the engines, or in Router mode once `router_serving` the
    router pods (operator/routing.py decides)."""
    from iterserve.operator.routing import service_selector  # routing builds on this module

    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(owner, service_name(owner.name)),
        "spec": {
            "type": "ClusterIP",
            "selector": service_selector(owner.name, spec, router_serving, lws),
            "ports": [
                {"name": "http", "port": ENGINE_PORT, "targetPort": "http", "protocol": "TCP"},
                # The engine serves /metrics on its HTTP port; a named port lets monitors select it.
                {"name": "metrics", "port": METRICS_SERVICE_PORT, "targetPort": "http", "protocol": "TCP"},
            ],
        },
    }


def build_configmap(owner: Owner, spec: InferenceServiceSpec, max_num_seqs: int,
                    start_adapters: Sequence[AdapterSpec] | None = None) -> dict[str, Any]:
    """What new engine pods start with (configmap_data)."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(owner, configmap_name(owner.name)),
        "data": configmap_data(spec, max_num_seqs, start_adapters),
    }


def build_owned(owner: Owner, spec: InferenceServiceSpec, max_num_seqs: int,
                router_serving: bool = False) -> tuple[dict[str, Any], ...]:
    """The objects the reconcile keeps applied, in write order. Only the ConfigMap depends on
    `max_num_seqs`: a retune never changes the Deployment, so it never rolls pods."""
    return (build_configmap(owner, spec, max_num_seqs), build_service(owner, spec, router_serving),
            build_deployment(owner, spec))


def build_admin_secret(owner: Owner, token: str | None = None) -> dict[str, Any]:
    """Created once and never rewritten: engines and the autoscaler share this token."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": _metadata(owner, secret_name(owner.name)),
        "stringData": {ADMIN_TOKEN_KEY: token or secrets.token_urlsafe(32)},
    }


def merge_patch(base: Any, patch: Any) -> Any:
    """JSON merge patch, except that lists of named items (containers, volumes, env) merge by name."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for key, value in patch.items():
            if value is None:
                out.pop(key, None)
            else:
                out[key] = merge_patch(base.get(key), value)
        return out
    if _named_list(base) and _named_list(patch):
        out = list(base)
        index = {item["name"]: i for i, item in enumerate(out)}
        for item in patch:
            if item["name"] in index:
                out[index[item["name"]]] = merge_patch(out[index[item["name"]]], item)
            else:
                out.append(item)
        return out
    return patch


def _named_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(i, dict) and "name" in i for i in value)
