"""The InferenceService resource as pydantic models: the one source of the CRD's schema
(operator/crd.py turns them into OpenAPI v3) and of the operator's defaulting and validation.

Field names are camelCase on the wire (aliases) and snake_case in Python. Cross-field rules are
written twice on purpose: as CEL (`x-kubernetes-validations`, checked by the API server at
`kubectl apply` time) and as pydantic validators (checked by the operator, for objects that got
in some other way, e.g. written before the CRD carried the rule). Both name the field.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, model_validator
from pydantic.alias_generators import to_camel

from iterserve.engine.config import EngineConfig  # its defaults are the engine's own
from iterserve.engine.server.protocol import (  # the engine's adapter names
    LORA_NAME_MAX_LENGTH,
    LORA_NAME_PATTERN,
)
from iterserve.replica_model import online  # the online step profile's bounds
from iterserve.replica_model.profile import DEFAULT_PROFILE, PROFILES  # the shipped step profiles
from iterserve.router.disagg import PdPolicy  # the router's P/D defaults are its own

GROUP = "iterserve.dev"
VERSION = "v1alpha1"
KIND = "InferenceService"
PLURAL = "inferenceservices"
SINGULAR = "inferenceservice"
SHORT_NAME = "infsvc"
API_VERSION = f"{GROUP}/{VERSION}"

DEFAULT_ENGINE_IMAGE = "ghcr.io/iterserve/engine:0.1.0"
SCALING_HISTORY_LIMIT = 10

# Kubernetes quantities ("4Gi", "500m", 2) as the API server's own schemas describe them.
Quantity = Annotated[
    int | str,
    WithJsonSchema({
        "anyOf": [{"type": "integer"}, {"type": "string"}],
        "x-kubernetes-int-or-string": True,
        "pattern": r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$",
    }),
]
# Free-form Kubernetes objects (affinity, a volume source, a pod template patch): kept as given.
FreeForm = Annotated[
    dict[str, Any],
    WithJsonSchema({"type": "object", "x-kubernetes-preserve-unknown-fields": True}),
]
SIZE_PATTERN = r"^[0-9]+(\.[0-9]+)?([kKMGT]i?[bB]?|[bB])?$"


def cel(rule: str, message: str, field_path: str | None = None) -> dict:
    entry = {"rule": rule, "message": message}
    if field_path:
        entry["fieldPath"] = field_path
    return entry


class WireModel(BaseModel):
    """camelCase on the wire; unknown fields refused (the API server prunes them anyway)."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")

    def to_wire(self) -> dict:
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


# ---------------------------------------------------------------------------------------- spec


class PersistentVolumeClaimRef(WireModel):
    """An existing PersistentVolumeClaim holding the model files, mounted read-only."""

    claim_name: str = Field(min_length=1, description="Name of the PVC in the InferenceService's namespace.")


class ModelSpec(WireModel):
    """What to serve: a path or URI the engine understands, and optionally a volume holding it."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [
        cel("!(has(self.persistentVolumeClaim) && has(self.volume))",
            "spec.model: set at most one of persistentVolumeClaim and volume"),
    ]})

    uri: str = Field(min_length=1, description=(
        "Passed to `iterserve serve --model`: a GGUF file or Hugging Face directory, absolute or "
        "relative to mountPath when a volume is given, or the name of the embedded model "
        "(smollm2-135m)."))
    persistent_volume_claim: PersistentVolumeClaimRef | None = Field(
        None, description="Mount this PVC (read-only) at mountPath.")
    volume: FreeForm | None = Field(
        None, description=("A Kubernetes volume source of a type the restricted Pod Security profile allows "
                           "(e.g. {csi: ...}, {ephemeral: ...}), mounted read-only at mountPath. hostPath and "
                           "other types only where the cluster admin allows them (chart value admissionPolicy.allow)."))
    mount_path: str = Field("/models", pattern=r"^/", description="Where the model volume is mounted in the engine container.")

    @model_validator(mode="after")
    def _one_volume(self):
        if self.persistent_volume_claim is not None and self.volume is not None:
            raise ValueError("spec.model: set at most one of persistentVolumeClaim and volume")
        return self

    @property
    def has_volume(self) -> bool:
        return self.persistent_volume_claim is not None or self.volume is not None

    @property
    def engine_path(self) -> str:
        """The --model argument: relative paths are resolved inside the mounted volume."""
        if self.has_volume and not self.uri.startswith("/") and "://" not in self.uri:
            return f"{self.mount_path.rstrip('/')}/{self.uri}"
        return self.uri


class ResourceRequirements(WireModel):
    """Container resources; `nvidia.com/gpu` in limits (or requests) asks for GPUs."""

    requests: dict[str, Quantity] = Field(default_factory=dict)
    limits: dict[str, Quantity] = Field(default_factory=dict)


class EnvVar(WireModel):
    name: str = Field(min_length=1)
    value: str | None = None
    value_from: FreeForm | None = Field(None, description="As in a container's env[].valueFrom.")


class ParallelismSpec(WireModel):
    """One model across several processes (docs/parallelism.md): tensor x pipeline ranks, in one pod,
    or with nodes > 1 spread evenly over a group of pods (one per node) that is one replica."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [
        cel("(self.tensor * self.pipeline) % self.nodes == 0",
            "spec.engine.parallelism.nodes must divide tensor x pipeline (every node runs the same number of ranks)",
            ".nodes"),
    ]})

    tensor: int = Field(1, ge=1, le=64, description="Tensor-parallel ranks (`--tensor-parallel-size`): each layer split across them.")
    pipeline: int = Field(1, ge=1, le=64, description="Pipeline stages (`--pipeline-parallel-size`): the layers split into them.")
    nodes: int = Field(1, ge=1, le=16, description=(
        "Pods per replica (`--nnodes`), each on its own node with tensor x pipeline / nodes ranks. Above 1 each "
        "replica is a group: a LeaderWorkerSet group when the cluster serves that API, else a StatefulSet per "
        "group; the leader (index 0) serves HTTP, the others join its process group. spec.replicas counts groups."))

    @model_validator(mode="after")
    def _even_split(self):
        if (self.tensor * self.pipeline) % self.nodes:
            raise ValueError("spec.engine.parallelism.nodes must divide tensor x pipeline (every node runs the same "
                             f"number of ranks; got {self.tensor} x {self.pipeline} over {self.nodes} nodes)")
        return self

    @property
    def ranks_per_node(self) -> int:
        return self.tensor * self.pipeline // self.nodes


class EngineSpec(WireModel):
    """The engine container and its options (each maps to an `iterserve serve` flag)."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [
        cel("self.chunkedPrefill || !has(self.maxNumBatchedTokens) || !has(self.maxModelLen) "
            "|| self.maxNumBatchedTokens >= self.maxModelLen",
            "spec.engine.maxNumBatchedTokens must be >= spec.engine.maxModelLen when chunkedPrefill is false",
            ".maxNumBatchedTokens"),
        cel("!has(self.maxNumBatchedTokens) || self.maxNumSeqs <= self.maxNumBatchedTokens",
            "spec.engine.maxNumSeqs must be <= spec.engine.maxNumBatchedTokens (each sequence needs a token of the step budget)",
            ".maxNumSeqs"),
    ]})

    image: str = Field(DEFAULT_ENGINE_IMAGE, min_length=1, description="Engine container image.")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    resources: ResourceRequirements = Field(default_factory=ResourceRequirements)
    max_num_seqs: int = Field(EngineConfig.max_num_seqs, ge=1, description="Cap on concurrent sequences (a memory bound); the KV retune may lower the effective value.")
    max_num_batched_tokens: int | None = Field(None, ge=1, description="Tokens per iteration (a compute bound). Default: the engine's.")
    max_model_len: int | None = Field(None, ge=1, description="Longest sequence. Default: the model's context, capped at 2048.")
    block_size: Literal[1, 2, 4, 8, 16, 32, 64, 128, 256] = Field(16, description="KV cache block size in tokens.")
    chunked_prefill: bool = True
    preemption_mode: Literal["recompute", "swap"] = "recompute"
    kv_cache_memory: str | None = Field(None, pattern=SIZE_PATTERN, description="KV cache pool size, e.g. 512MiB or 20GiB; unset, the engine sizes it from the memory left after the weights load (--gpu-memory-utilization of the GPU, or a share of the pod's available memory on CPU).")
    parallelism: ParallelismSpec = Field(default_factory=ParallelismSpec, description="Tensor and pipeline parallelism: one process per rank; with GPUs, each pod asks for tensor x pipeline / nodes of them.")
    extra_args: list[str] = Field(default_factory=list, description="More `iterserve serve` flags (not the ones above, which the operator manages).")
    env: list[EnvVar] = Field(default_factory=list)
    drain_seconds: int = Field(30, ge=0, le=3600, description="How long a terminating pod may take to finish in-flight requests (preStop drain).")
    startup_seconds: int = Field(600, ge=10, le=7200, description="How long model loading may take before the pod is restarted.")

    @model_validator(mode="after")
    def _engine_rules(self):
        if (not self.chunked_prefill and self.max_num_batched_tokens is not None
                and self.max_model_len is not None and self.max_num_batched_tokens < self.max_model_len):
            raise ValueError("spec.engine.maxNumBatchedTokens must be >= spec.engine.maxModelLen when chunkedPrefill is false")
        if self.max_num_batched_tokens is not None and self.max_num_seqs > self.max_num_batched_tokens:
            raise ValueError("spec.engine.maxNumSeqs must be <= spec.engine.maxNumBatchedTokens (each sequence needs a token of the step budget)")
        return self


class ScalingPolicy(WireModel):
    """At most `value` pods (type Pods) or percent of current replicas (type Percent) per period."""

    type: Literal["Pods", "Percent"]
    value: int = Field(ge=1)
    period_seconds: int = Field(ge=1, le=1800)


class _ScalingRules(WireModel):
    select_policy: Literal["Max", "Min", "Disabled"] = Field("Max", description="Which policy wins when several apply.")


class ScaleUpRules(_ScalingRules):
    stabilization_window_seconds: int = Field(0, ge=0, le=3600)
    policies: list[ScalingPolicy] = Field(
        default_factory=lambda: [ScalingPolicy(type="Pods", value=4, period_seconds=15),
                                 ScalingPolicy(type="Percent", value=100, period_seconds=15)])


class ScaleDownRules(_ScalingRules):
    stabilization_window_seconds: int = Field(300, ge=0, le=3600)
    policies: list[ScalingPolicy] = Field(
        default_factory=lambda: [ScalingPolicy(type="Percent", value=100, period_seconds=15)])


class KvRetune(WireModel):
    """Lower max_num_seqs on a replica whose KV cache stays nearly full; raise it back when it recovers."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [
        cel("self.recoveryThreshold < self.threshold",
            "spec.autoscaling.kvRetune.recoveryThreshold must be below spec.autoscaling.kvRetune.threshold",
            ".recoveryThreshold"),
    ]})

    enabled: bool = True
    threshold: float = Field(0.95, gt=0, le=1, description="KV usage fraction that counts as pressure.")
    consecutive_samples: int = Field(3, ge=1, le=100, description="Samples above threshold before lowering.")
    step_factor: float = Field(0.75, gt=0, lt=1, description="Multiply max_num_seqs by this when lowering.")
    floor: int = Field(1, ge=1, description="Never lower max_num_seqs below this.")
    recovery_threshold: float = Field(0.80, ge=0, lt=1, description="KV usage below which max_num_seqs may rise again.")
    recovery_window_seconds: int = Field(300, ge=0, description="Quiet time (below recovery, no preemptions) before raising.")
    recovery_step: int = Field(4, ge=1, description="Add this much to max_num_seqs per recovery step, up to the spec value.")

    @model_validator(mode="after")
    def _thresholds(self):
        if self.recovery_threshold >= self.threshold:
            raise ValueError("spec.autoscaling.kvRetune.recoveryThreshold must be below spec.autoscaling.kvRetune.threshold")
        return self


class SloTargets(WireModel):
    """Latency targets the autoscaler plans replicas for (operator/autoscaling/slo.py): each tick it
    runs the simulator's replica model on the measured workload and keeps the fewest replicas whose
    predicted p95s meet the targets."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [
        cel("has(self.ttftP95Ms) || has(self.itlP95Ms)",
            "spec.autoscaling.slo needs ttftP95Ms, itlP95Ms or both", ".ttftP95Ms"),
    ]})

    ttft_p95_ms: float | None = Field(None, gt=0, le=600_000, description="p95 time to first token to keep under (ms).")
    itl_p95_ms: float | None = Field(None, gt=0, le=60_000, description=(
        "p95 inter-token latency to keep under (ms). When it binds, the autoscaler also lowers each replica's "
        "max_num_seqs to the largest value whose predicted ITL meets it."))
    window: int = Field(120, ge=15, le=3600, description=(
        "Seconds of metrics the estimate reads: arrival rate, prompt and output lengths, measured p95s."))
    step_profile: Literal[*PROFILES] = Field(DEFAULT_PROFILE, description=(
        "The step-time profile the replica model runs (`iterserve simulate --profile`), one that ships with iterserve; "
        "with fitStepProfileOnline, the fallback."))
    fit_step_profile_online: bool = Field(True, description=(
        "Fit the step profile online on the warm decode pods' own steps (their GET /admin/steps) and plan with it "
        f"once it holds {online.MIN_STEPS} steps and errs by at most {online.MAX_ERROR:.0%} on its held-out steps; "
        "until then, or when it errs more, "
        "stepProfile (status.slo.stepProfileReason says which). false: always stepProfile."))
    hysteresis: float = Field(0.2, ge=0, lt=1, description=(
        "Scale down only when the fewer replicas are predicted to meet targets x (1 - hysteresis): the band "
        "that stops 2 <-> 1 flapping."))
    max_prediction_error: float = Field(0.5, gt=0, le=10, description=(
        "When a measured p95 differs from the prediction for the current replicas by more than this fraction "
        "of the measurement, the tick falls back to the waiting-requests signal (status.slo.fallback says so)."))

    @model_validator(mode="after")
    def _some_target(self):
        if self.ttft_p95_ms is None and self.itl_p95_ms is None:
            raise ValueError("spec.autoscaling.slo needs ttftP95Ms, itlP95Ms or both")
        return self


class AutoscalingSpec(WireModel):
    """Builtin: the operator scales on waiting requests and preemptions. External: an HPA or KEDA
    drives spec.replicas through the scale subresource and the operator never writes it. Off: fixed."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [
        cel("self.minReplicas <= self.maxReplicas",
            "spec.autoscaling.minReplicas must be <= spec.autoscaling.maxReplicas", ".minReplicas"),
        cel("!has(self.scaleToZeroAfterSeconds) || self.minReplicas == 0",
            "spec.autoscaling.scaleToZeroAfterSeconds needs spec.autoscaling.minReplicas 0",
            ".scaleToZeroAfterSeconds"),
    ]})

    mode: Literal["Builtin", "External", "Off"] = "Builtin"
    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(4, ge=1)
    target_waiting_per_replica: float = Field(10, gt=0, description="Waiting requests per replica the scaler aims for.")
    preemptions_per_minute_threshold: float = Field(1, ge=0, description="Preemption rate per replica above which a replica is added.")
    tolerance: float = Field(0.1, ge=0, lt=1, description="No change while desired/current is within this of 1.")
    scale_up: ScaleUpRules = Field(default_factory=ScaleUpRules)
    scale_down: ScaleDownRules = Field(default_factory=ScaleDownRules)
    cold_start_seconds: int = Field(600, ge=0, description="Pods not ready within this stop counting as coming capacity.")
    warmup_seconds: int = Field(30, ge=0, description="Ignore a pod's samples for this long after it becomes ready.")
    kv_retune: KvRetune = Field(default_factory=KvRetune)
    metrics_source: Literal["scrape", "prometheus"] = "scrape"
    interval_seconds: int = Field(15, ge=1, le=3600, description="How often the scaler decides.")
    slo: SloTargets | None = Field(None, description=(
        "Latency targets: replicas (and max_num_seqs when the ITL target binds) planned from them instead of "
        "the waiting-requests target, which stays the fallback."))
    scale_to_zero_after_seconds: int | None = Field(None, ge=0, le=86_400, description=(
        "With minReplicas 0: go to zero replicas after this long without a request. The router holds requests "
        "that arrive at zero (bounded) and its held-request count brings the first replica back."))

    @model_validator(mode="after")
    def _bounds(self):
        if self.min_replicas > self.max_replicas:
            raise ValueError("spec.autoscaling.minReplicas must be <= spec.autoscaling.maxReplicas")
        if self.scale_to_zero_after_seconds is not None and self.min_replicas != 0:
            raise ValueError("spec.autoscaling.scaleToZeroAfterSeconds needs spec.autoscaling.minReplicas 0 "
                             "(set minReplicas: 0, or drop scaleToZeroAfterSeconds)")
        return self


class Toleration(WireModel):
    key: str | None = None
    operator: Literal["Exists", "Equal"] | None = None
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = None


class SchedulingSpec(WireModel):
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[Toleration] = Field(default_factory=list)
    affinity: FreeForm | None = None
    priority_class_name: str | None = None


class RoutingSpec(WireModel):
    """How requests reach the engine pods (operator/routing.py builds the objects)."""

    mode: Literal["Router", "Gateway", "None"] = Field(
        "Router", description=("Router: a load-aware `iterserve router` Deployment (NAME-router, scheduled with "
                               "spec.scheduling's nodeSelector and tolerations) behind the InferenceService's "
                               "Service. Gateway: an InferencePool (inference.networking.k8s.io/v1) for a Gateway "
                               "API Inference Extension gateway (condition RoutingUnavailable while its CRD is not "
                               "installed). None: the Service selects the engine pods."))
    endpoint_picker: str | None = Field(
        None, description="Gateway mode: the endpoint picker's Service (default: NAME-epp), port 9002.")
    max_queue: int | None = Field(
        None, ge=0, description=("Router mode: requests a replica may queue beyond its max_num_seqs before the router "
                                 "counts it saturated (`iterserve router --max-queue`; default: the router's). Raise it "
                                 "with the engines' --max-waiting-requests when queueing should happen in the engines."))
    queue_timeout_seconds: float | None = Field(
        None, ge=0, description=("Router mode: how long a request waits while every replica is saturated before the "
                                 "router answers 429 with Retry-After (`--queue-timeout`; default: the router's)."))
    tenant_header: str | None = Field(
        None, min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9-]*$",
        description=("Router mode: the request header naming each request's tenant, set by your gateway after it "
                     "authenticates the client (e.g. X-Tenant). The router sets cache_salt to a keyed hash of it "
                     "(`--tenant-salt-header`), so tenants never share prefix-cache KV, and answers 400 to a request "
                     "without it. The key is Secret NAME-tenant-salt, created once and mounted in every router "
                     "pod. Default: off, one prefix cache shared by all users."))


class PrefillPool(WireModel):
    """The prefill replicas (engine --role prefill): Deployment NAME-prefill, its own replica
    bounds and scaling signal."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [
        cel("self.minReplicas <= self.maxReplicas",
            "spec.disaggregation.prefill.minReplicas must be <= spec.disaggregation.prefill.maxReplicas",
            ".minReplicas"),
    ]})

    replicas: int = Field(1, ge=0, description=(
        "Prefill pods wanted (kept within minReplicas..maxReplicas). With spec.autoscaling mode Builtin the "
        "autoscaler sets it from scalingSignal each tick, as it sets spec.replicas for the decode pool."))
    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(4, ge=1)
    scaling_signal: Literal["QueuedPromptTokens", "TTFT"] = Field(
        "QueuedPromptTokens", description=("What the prefill pool scales on: prompt tokens waiting per replica, or "
                                           "time to first token."))
    target_queued_prompt_tokens: int = Field(
        PdPolicy().max_prefill_queue * PdPolicy().threshold_tokens, ge=1, description=(
            "QueuedPromptTokens: prompt tokens not yet computed per prefill replica (the engines' "
            "iterserve_scheduler_queued_prompt_tokens) the scaler aims for. The default is maxPrefillQueue x "
            "thresholdTokens at their defaults (4 x 512): the router queues at most maxPrefillQueue prompts on a "
            "prefill replica, so a larger target is never reached and the decode pool takes the overflow."))
    target_ttft_seconds: float = Field(2.0, gt=0, description=(
        "TTFT: the p95 time to first token on the prefill pods over the last 60 s to keep under "
        "(replicas x p95 / target)."))
    extra_args: list[str] = Field(default_factory=list, description="More `iterserve serve` flags for prefill pods only.")

    @model_validator(mode="after")
    def _bounds(self):
        if self.min_replicas > self.max_replicas:
            raise ValueError("spec.disaggregation.prefill.minReplicas must be <= spec.disaggregation.prefill.maxReplicas")
        return self

    @property
    def wanted_replicas(self) -> int:
        return max(self.min_replicas, min(self.replicas, self.max_replicas))


class DecodePool(WireModel):
    """The decode replicas (engine --role decode): the engine Deployment NAME, scaled by
    spec.replicas / spec.autoscaling exactly as without disaggregation (waiting requests,
    preemptions, KV usage and the max_num_seqs retune)."""

    extra_args: list[str] = Field(default_factory=list, description="More `iterserve serve` flags for decode pods only.")


class DisaggregationSpec(WireModel):
    """Prefill/decode disaggregation: prompts longer than thresholdTokens are prefilled on the
    prefill pool and decoded on the decode pool (the router's P/D path; needs spec.routing.mode Router)."""

    enabled: bool = False
    threshold_tokens: int = Field(PdPolicy().threshold_tokens, ge=0, description=(
        "Prefill remotely only prompts with more uncached tokens than this (the router's --pd-threshold-tokens). "
        "Condition DisaggregationIneffective warns when the observed average prompt is under it."))
    max_prefill_queue: int = Field(PdPolicy().max_prefill_queue, ge=1, description=(
        "Prefill remotely only while the least-loaded prefill replica has fewer requests than this "
        "(--pd-max-prefill-queue); else the decode replica prefills locally."))
    kv_transfer_port: int = Field(8100, ge=1, le=65535, description="The engines' KV transfer listener (--kv-transfer-port).")
    prefill: PrefillPool = Field(default_factory=PrefillPool)
    decode: DecodePool = Field(default_factory=DecodePool)


MAX_ADAPTERS = 64  # spec.adapters entries (each is loaded on every replica)
ADAPTER_SOURCE_MAX_LENGTH = 1024


class AdapterSpec(WireModel):
    """One LoRA adapter every replica serves beside the base model (docs/lora.md): a request
    names it as its `model`. Loaded at pod start and, when the list changes, on running pods."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [
        cel("!self.source.contains('://')",
            "spec.adapters[].source must be a path in the engine image or on the model's volume, not a URL "
            "(nothing is downloaded)", ".source"),
        cel("!self.source.matches('(^|/)\\\\.\\\\.(/|$)')",
            "spec.adapters[].source must not contain a '..' segment", ".source"),
    ]})

    name: str = Field(min_length=1, max_length=LORA_NAME_MAX_LENGTH, pattern=LORA_NAME_PATTERN, description=(
        "What requests send as `model` to use the adapter: letters, digits and . _ : / - (vLLM's), "
        "starting with a letter or digit; not the base model's name."))
    source: str = Field(min_length=1, max_length=ADAPTER_SOURCE_MAX_LENGTH, pattern=r"^\S+$", description=(
        "The adapter's directory in PEFT's format (adapter_config.json, adapter_model.safetensors): an "
        "absolute path in the engine image, or a path relative to spec.model.mountPath on the model's "
        "volume (PVC or volume). No URLs, no '..', no whitespace."))

    @model_validator(mode="after")
    def _local_source(self):
        if "://" in self.source:
            raise ValueError(f"spec.adapters[{self.name}].source must be a path in the engine image or on the "
                             "model's volume, not a URL (nothing is downloaded)")
        if ".." in self.source.split("/"):
            raise ValueError(f"spec.adapters[{self.name}].source must not contain a '..' segment")
        return self

    def engine_path(self, model: ModelSpec) -> str:
        """The path the engine reads: relative sources are resolved inside the model's volume."""
        return self.source if self.source.startswith("/") else f"{model.mount_path.rstrip('/')}/{self.source}"


class InferenceServiceSpec(WireModel):
    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [
        cel("!has(self.autoscaling) || !has(self.autoscaling.kvRetune) || !has(self.engine) "
            "|| self.autoscaling.kvRetune.floor <= self.engine.maxNumSeqs",
            "spec.autoscaling.kvRetune.floor must be <= spec.engine.maxNumSeqs", ".autoscaling.kvRetune.floor"),
        cel("!has(self.disaggregation) || !has(self.disaggregation.enabled) || !self.disaggregation.enabled "
            "|| !has(self.routing) || !has(self.routing.mode) || self.routing.mode == 'Router'",
            "spec.disaggregation.enabled needs spec.routing.mode Router (the router sends prompts to the prefill "
            "pool)", ".disaggregation.enabled"),
        cel("!has(self.adapters) || self.adapters.all(a, a.source.startsWith('/')) "
            "|| has(self.model.persistentVolumeClaim) || has(self.model.volume)",
            "spec.adapters: a relative source needs spec.model.persistentVolumeClaim or spec.model.volume (it is "
            "resolved under spec.model.mountPath); give an absolute path in the engine image otherwise", ".adapters"),
    ]})

    model: ModelSpec
    engine: EngineSpec = Field(default_factory=EngineSpec)
    replicas: int = Field(1, ge=0, description="Engine pods wanted; the scale subresource's target.")
    autoscaling: AutoscalingSpec | None = Field(None, description="Absent: no autoscaling (mode Off).")
    scheduling: SchedulingSpec = Field(default_factory=SchedulingSpec)
    routing: RoutingSpec = Field(default_factory=RoutingSpec)
    disaggregation: DisaggregationSpec = Field(default_factory=DisaggregationSpec)
    adapters: list[AdapterSpec] = Field(
        default_factory=list, max_length=MAX_ADAPTERS,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
        description=("LoRA adapters of the model served by every replica (docs/lora.md): loaded when a pod starts "
                     "and, when this list changes, loaded and unloaded on the running pods through their admin "
                     "API (no restart); status.adapters says what each pod serves. Adding the first adapter or "
                     "removing the last restarts the pods (LoRA is switched on or off at start)."))
    pod_template_patch: FreeForm | None = Field(
        None, description=("Merged into the generated pod template last (maps by key, lists of named items by "
                           "name). Nothing that weakens the restricted Pod Security profile (privileged, host "
                           "namespaces, hostPath, added capabilities, root, another ServiceAccount, a removed "
                           "securityContext) unless the cluster admin allows it."))

    @model_validator(mode="after")
    def _floor(self):
        if any(not a.source.startswith("/") for a in self.adapters) and not self.model.has_volume:
            raise ValueError("spec.adapters: a relative source needs spec.model.persistentVolumeClaim or "
                             "spec.model.volume (it is resolved under spec.model.mountPath); give an absolute path "
                             "in the engine image otherwise")
        names = [a.name for a in self.adapters]
        if len(set(names)) != len(names):
            raise ValueError(f"spec.adapters: names must be unique ({sorted({n for n in names if names.count(n) > 1})} "
                             "repeat)")
        if self.autoscaling is not None and self.autoscaling.kv_retune.floor > self.engine.max_num_seqs:
            raise ValueError("spec.autoscaling.kvRetune.floor must be <= spec.engine.maxNumSeqs")
        if self.disaggregation.enabled and self.routing.mode != "Router":
            raise ValueError("spec.disaggregation.enabled needs spec.routing.mode Router (the router sends prompts "
                             "to the prefill pool)")
        return self

    @property
    def autoscaling_mode(self) -> str:
        return "Off" if self.autoscaling is None else self.autoscaling.mode


# -------------------------------------------------------------------------------------- status

# Condition types, defined here only. The reconcile sets the first five, and records the
# autoscaler's MetricsAvailable and ScalingLimited; status.py lists them in this order.
READY = "Ready"
PROGRESSING = "Progressing"
DEGRADED = "Degraded"
INVALID_SPEC = "InvalidSpec"
CONFLICT = "Conflict"  # an object of an owned object's name exists and is not this InferenceService's
METRICS_AVAILABLE = "MetricsAvailable"
SCALING_LIMITED = "ScalingLimited"
# spec.routing cannot be served as asked (Gateway mode without the InferencePool CRD installed).
ROUTING_UNAVAILABLE = "RoutingUnavailable"
# Disaggregation is on but the prompts seen are on average too short for it to pay (a warning).
DISAGGREGATION_INEFFECTIVE = "DisaggregationIneffective"
CONDITION_TYPES = (READY, PROGRESSING, DEGRADED, INVALID_SPEC, CONFLICT, ROUTING_UNAVAILABLE,
                   DISAGGREGATION_INEFFECTIVE, METRICS_AVAILABLE, SCALING_LIMITED)


class Condition(WireModel):
    type: Literal[CONDITION_TYPES]  # type: ignore[valid-type]
    status: Literal["True", "False", "Unknown"]
    reason: str = Field(min_length=1, description="CamelCase, machine-readable.")
    message: str = ""
    last_transition_time: datetime
    observed_generation: int | None = None


class ScalingRecord(WireModel):
    """One decision that changed something: replicas, or one pod's max_num_seqs."""

    time: datetime
    action: Literal["ScaleUp", "ScaleDown", "RetuneDown", "RetuneUp"]
    reason: str
    message: str = ""
    from_replicas: int | None = None
    to_replicas: int | None = None
    pod: str | None = None
    from_max_num_seqs: int | None = None
    to_max_num_seqs: int | None = None
    pool: Literal["decode", "prefill"] | None = Field(
        None, description="Disaggregation: the pool whose replicas changed (decode: the engine Deployment).")
    signal: Literal["WaitingRequests", "QueuedPromptTokens", "TTFT", "SLO"] | None = Field(
        None, description="Scale: the signal the pool scales on (SLO: spec.autoscaling.slo's plan).")
    signal_value: float | None = Field(
        None, description="Scale: what it read (waiting requests or queued prompt tokens per read replica, or the "
                          "windowed p95 TTFT in seconds).")
    target: float | None = Field(None, description="Scale: the signal's target.")
    metric_replicas: float | None = Field(
        None, description="Scale: the replicas the signal alone asked for (unrounded), before tolerance, "
                          "scale-down floors, stabilization, rate policies and bounds.")
    kv_usage_readings: list[float] = Field(
        default_factory=list, max_length=64,
        description="RetuneDown for KV pressure: the KV cache usage readings that showed it, oldest first.")
    preemptions_at_readings: list[float] = Field(
        default_factory=list, max_length=64,
        description="RetuneDown for KV pressure: the rise of the preemption counter at each of those readings.")


class PodSummary(WireModel):
    """The autoscaler's last reading of one engine pod."""

    name: str
    ready: bool = False
    waiting_requests: int | None = None
    running_seqs: int | None = None
    kv_cache_usage: float | None = None
    preemptions_per_minute: float | None = None
    max_num_seqs: int | None = None


class PrefillPoolStatus(WireModel):
    """Disaggregation: the prefill pool (Deployment NAME-prefill) as the autoscaler last saw it."""

    replicas: int = Field(0, description="Prefill pods that exist.")
    ready_replicas: int = Field(0, description="Prefill pods ready.")
    desired_replicas: int | None = Field(None, description="What the autoscaler wants (else spec's replicas).")
    last_scale_time: datetime | None = None
    signal: Literal["QueuedPromptTokens", "TTFT"] | None = None
    signal_value: float | None = Field(
        None, description="QueuedPromptTokens: queued prompt tokens per read replica; TTFT: windowed p95 in seconds.")
    target: float | None = None
    reason: str | None = Field(None, description="The last decision's reason (snake_case).")


class SloStatus(WireModel):
    """SLO mode: what the last tick predicted and measured (seconds), and whether it planned on them."""

    predicted_ttft_p95: float | None = Field(None, description="Predicted p95 TTFT at the desired replicas; where "
                                              "SLO mode fell back, at the current ones (the prediction predictionError "
                                              "compares with the measurement).")
    predicted_itl_p95: float | None = Field(None, description="Predicted p95 ITL at the desired replicas; where SLO "
                                             "mode fell back, at the current ones.")
    measured_ttft_p95: float | None = Field(None, description="Measured p95 TTFT over the window (warm pods only).")
    measured_itl_p95: float | None = Field(None, description="Measured p95 ITL over the window (warm pods only).")
    prediction_error: float | None = Field(None, description=(
        "Largest |predicted - measured| / measured at the current replicas this window."))
    fallback: bool = Field(False, description="True: the prediction was off by more than maxPredictionError; "
                           "the tick used the waiting-requests signal.")
    max_num_seqs: int | None = Field(None, description="The max_num_seqs the ITL target allows (None: it does not bind).")
    arrival_rate: float | None = Field(None, description="Requests per second over the window.")
    step_profile: str | None = Field(None, description="The step profile the prediction ran (NAME-online: fitted online).")
    step_profile_reason: Literal["fitted", "too_few_steps", "fit_error_above_bound", "given"] | None = Field(
        None, description="Why that profile: fitted online; the given one while the fit has too few steps or errs "
        "above its bound on its held-out steps; given (fitStepProfileOnline false).")
    step_profile_steps: int | None = Field(None, description="Steps the online fit holds.")
    message: str | None = None


class ReplicaAdapters(WireModel):
    """The LoRA adapters one engine pod serves, as the operator last read them (its GET /v1/models)."""

    pod: str
    loaded: list[str] = Field(default_factory=list, max_length=2 * MAX_ADAPTERS,
                              description="Adapter names the pod serves now (after this pass's loads and unloads).")
    failed: list[str] = Field(default_factory=list, max_length=MAX_ADAPTERS, description=(
        "Adapters whose load failed on this pod in the last pass. New pods start without an adapter that "
        "failed and is loaded on no pod (a bad source would stop them at start); each pass retries it."))
    error: str | None = Field(None, max_length=1024, description=(
        "The last load, unload or read that failed on this pod (retried every resync); absent when all went well."))


class InferenceServiceStatus(WireModel):
    model_config = ConfigDict(extra="ignore")

    observed_generation: int | None = None
    replicas: int = 0
    ready_replicas: int = 0
    desired_replicas: int | None = None
    effective_max_num_seqs: int | None = None
    selector: str | None = Field(None, description="Label selector of the engine pods (scale subresource).")
    conditions: list[Condition] = Field(default_factory=list, json_schema_extra={
        "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]})
    last_scale_time: datetime | None = None
    scaling_history: list[ScalingRecord] = Field(
        default_factory=list, max_length=SCALING_HISTORY_LIMIT, description="The last decisions, newest last.")
    waiting_requests: int | None = Field(None, description="Sum of waiting requests over readable pods.")
    kv_cache_usage: float | None = Field(None, description="Highest KV cache usage fraction over readable pods.")
    prefill_replicas: int | None = Field(
        None, description="Deprecated: read prefill.replicas (this copy of it is removed in the next release).")
    prefill_ready_replicas: int | None = Field(
        None, description="Deprecated: read prefill.readyReplicas (this copy of it is removed in the next release).")
    prefill: PrefillPoolStatus | None = Field(None, description="Disaggregation: the prefill pool and its scaling.")
    slo: SloStatus | None = Field(None, description="SLO mode: the last tick's predicted and measured p95s.")
    held_requests: int | None = Field(None, description="Requests the router holds while no replica is ready.")
    pods: list[PodSummary] = Field(default_factory=list)
    adapters: list[ReplicaAdapters] = Field(default_factory=list, description=(
        "spec.adapters: what each ready engine pod serves, and its last adapter error."))


class InferenceService(WireModel):
    """The whole object, for tests and examples (the operator reads spec and status separately)."""

    model_config = ConfigDict(extra="ignore")

    api_version: Literal["iterserve.dev/v1alpha1"] = API_VERSION
    kind: Literal["InferenceService"] = KIND
    metadata: dict[str, Any]
    spec: InferenceServiceSpec
    status: InferenceServiceStatus | None = None
