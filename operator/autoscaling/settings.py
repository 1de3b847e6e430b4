"""The policy's settings: small frozen values that the pure policy reads, and how they are built
from an InferenceService spec.

Every default is the pydantic model's (operator/models.py), read from there: changing a default
means changing the model only. `Settings()` with no arguments is what an InferenceService with
an empty `autoscaling: {}` section gets; the simulator and the tests build them the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

from iterserve.operator.models import (
    AutoscalingSpec,
    EngineSpec,
    KvRetune,
    PrefillPool,
    ScaleDownRules,
    ScaleUpRules,
    ScalingPolicy,
    SloTargets,
)
from iterserve.replica_model.online import ProfileChoice

_AUTOSCALING = AutoscalingSpec()  # the models' defaults, the one place they are written
_KV = KvRetune()
_PREFILL = PrefillPool()
# The policy's own windows (not spec fields): samples older than this no longer describe a pod,
# and a preemption rate is measured over this much time.
MIN_STALE_SAMPLE_SECONDS = 60
PREEMPTION_WINDOW_SECONDS = 60
# The prefill pool's TTFT signal: the p95 of the TTFT histogram's increase over this much time.
TTFT_WINDOW_SECONDS = 60


@dataclass(frozen=True)
class RatePolicy:
    """At most `value` pods (kind "Pods") or percent of replicas ("Percent") per period."""

    kind: str
    value: int
    period_seconds: float

    @classmethod
    def from_model(cls, policy: ScalingPolicy) -> RatePolicy:
        return cls(policy.type, policy.value, policy.period_seconds)


@dataclass(frozen=True)
class DirectionRules:
    stabilization_window_seconds: float
    policies: tuple[RatePolicy, ...]
    select_policy: str = _AUTOSCALING.scale_up.select_policy  # Max | Min | Disabled

    @classmethod
    def from_model(cls, rules: ScaleUpRules | ScaleDownRules) -> DirectionRules:
        return cls(rules.stabilization_window_seconds,
                   tuple(RatePolicy.from_model(p) for p in rules.policies),
                   rules.select_policy)


@dataclass(frozen=True)
class KvRetuneSettings:
    enabled: bool = _KV.enabled
    threshold: float = _KV.threshold
    consecutive_samples: int = _KV.consecutive_samples
    step_factor: float = _KV.step_factor
    floor: int = _KV.floor
    recovery_threshold: float = _KV.recovery_threshold
    recovery_window_seconds: float = _KV.recovery_window_seconds
    recovery_step: int = _KV.recovery_step


@dataclass(frozen=True)
class PrefillSettings:
    """A disaggregated InferenceService's prefill pool (spec.disaggregation.prefill): its bounds and
    signal. The decision reuses the decode pool's tolerance, stabilization windows, rate policies,
    cold start and warm-up (spec.autoscaling)."""

    min_replicas: int = _PREFILL.min_replicas
    max_replicas: int = _PREFILL.max_replicas
    signal: str = _PREFILL.scaling_signal  # QueuedPromptTokens | TTFT
    target_queued_prompt_tokens: float = _PREFILL.target_queued_prompt_tokens
    target_ttft_seconds: float = _PREFILL.target_ttft_seconds
    ttft_window_seconds: float = TTFT_WINDOW_SECONDS

    @property
    def target(self) -> float:
        return self.target_queued_prompt_tokens if self.signal == "QueuedPromptTokens" else self.target_ttft_seconds


@dataclass(frozen=True)
class SloSettings:
    """spec.autoscaling.slo in seconds, and the replica model the plan runs: the EngineConfig and
    server options a pod starts with and the step profile (slo.py; iterserve/replica_model/plan.py).
    `profile` is the spec's stepProfile; with `fit_online` the tick puts the InferenceService's
    online fit in its place when that is fitted (step_feed.py), and `profile_choice` says which
    and why."""

    ttft_p95_s: float | None
    itl_p95_s: float | None
    window_seconds: float
    hysteresis: float
    max_prediction_error: float
    engine: object  # iterserve.engine.config.EngineConfig of a pod, max_num_seqs as the spec sets it
    server: object  # iterserve.replica_model.replica.ServerOptions
    profile: object  # iterserve.replica_model.profile.StepProfile
    fit_online: bool = SloTargets.model_fields["fit_step_profile_online"].default
    profile_choice: ProfileChoice = ProfileChoice()


_SLO_SETTINGS: dict[str, SloSettings] = {}  # by the spec's JSON: parsing the engine flags costs ~0.1 s a tick
_SLO_SETTINGS_KEPT = 64


def slo_settings(spec, slo: SloTargets) -> SloSettings:
    """The SLO settings of an InferenceService spec; the pod's engine options come from the
    operator's and the server's own code (engine_config.py). Memoized per spec."""
    key = spec.model_dump_json()
    if key not in _SLO_SETTINGS:
        if len(_SLO_SETTINGS) >= _SLO_SETTINGS_KEPT:
            _SLO_SETTINGS.pop(next(iter(_SLO_SETTINGS)))
        _SLO_SETTINGS[key] = _slo_settings(spec, slo)
    return _SLO_SETTINGS[key]


def _slo_settings(spec, slo: SloTargets) -> SloSettings:
    from iterserve.operator.engine_config import engine_config_for, profile_for

    engine, server = engine_config_for(spec, spec.engine.max_num_seqs)
    profile = profile_for(spec, slo.step_profile)  # a shipped name only (the model's Literal): never a path
    ms = 1e-3
    return SloSettings(None if slo.ttft_p95_ms is None else slo.ttft_p95_ms * ms,
                       None if slo.itl_p95_ms is None else slo.itl_p95_ms * ms,
                       float(slo.window), slo.hysteresis, slo.max_prediction_error, engine, server, profile,
                       slo.fit_step_profile_online)


DECODE, PREFILL = "decode", "prefill"  # pool roles: the engine Deployment, NAME-prefill
WAITING, QUEUED_PROMPT_TOKENS, TTFT = "WaitingRequests", "QueuedPromptTokens", "TTFT"
REPLICAS_FIELDS = {DECODE: "spec.replicas", PREFILL: "spec.disaggregation.prefill.replicas"}  # each pool's size


@dataclass(frozen=True)
class Pool:
    """One pool of engine replicas the decision sizes (policy.decide): its role, replica bounds,
    signal and target. Every InferenceService has the decode pool (the engine Deployment: decode
    pods, or the only pool); a disaggregated one has the prefill pool too. Tolerance,
    stabilization windows, rate policies, cold start and warm-up are the InferenceService's
    (spec.autoscaling), shared by its pools."""

    role: str  # DECODE | PREFILL
    min_replicas: int
    max_replicas: int
    signal: str  # WAITING (per replica) | QUEUED_PROMPT_TOKENS (per replica) | TTFT (windowed p95, seconds)
    target: float
    ttft_window_seconds: float = TTFT_WINDOW_SECONDS

    @property
    def replicas_field(self) -> str:
        """The spec field the pool's replicas live in (the autoscaler's one write for it)."""
        return REPLICAS_FIELDS[self.role]

    @property
    def holds_sequences(self) -> bool:
        """Whether its pods keep sequences across steps (they decode): then running sequences,
        preemptions and the KV retune count. Prefill pods hand each prompt on after one pass."""
        return self.role == DECODE


@dataclass(frozen=True)
class Settings:
    mode: str = _AUTOSCALING.mode  # Builtin | External | Off
    min_replicas: int = _AUTOSCALING.min_replicas
    max_replicas: int = _AUTOSCALING.max_replicas
    target_waiting_per_replica: float = _AUTOSCALING.target_waiting_per_replica
    preemptions_per_minute_threshold: float = _AUTOSCALING.preemptions_per_minute_threshold
    tolerance: float = _AUTOSCALING.tolerance
    scale_up: DirectionRules = field(default_factory=lambda: DirectionRules.from_model(_AUTOSCALING.scale_up))
    scale_down: DirectionRules = field(default_factory=lambda: DirectionRules.from_model(_AUTOSCALING.scale_down))
    cold_start_seconds: float = _AUTOSCALING.cold_start_seconds
    warmup_seconds: float = _AUTOSCALING.warmup_seconds
    preemption_window_seconds: float = PREEMPTION_WINDOW_SECONDS
    stale_sample_seconds: float = MIN_STALE_SAMPLE_SECONDS
    spec_max_num_seqs: int = EngineSpec().max_num_seqs
    kv_retune: KvRetuneSettings = field(default_factory=KvRetuneSettings)
    # Disaggregation on: the prefill pool's bounds and signal (`pool(PREFILL)`); None: no such pool.
    prefill: PrefillSettings | None = None
    slo: SloSettings | None = None  # SLO mode (the decode pool); None: the waiting-requests signal
    scale_to_zero_after_seconds: float | None = _AUTOSCALING.scale_to_zero_after_seconds

    @property
    def retunes(self) -> bool:
        """Whether the KV retune runs. External mode only reports: the engines' config, like
        replicas, is left to whoever owns it, and new pods start with the spec's value."""
        return self.mode == "Builtin" and self.kv_retune.enabled

    @property
    def memory_seconds(self) -> float:
        """How far back samples, recommendations and scale events still matter."""
        periods = [p.period_seconds for r in (self.scale_up, self.scale_down) for p in r.policies]
        return max([self.scale_up.stabilization_window_seconds,
                    self.scale_down.stabilization_window_seconds, self.preemption_window_seconds,
                    self.kv_retune.recovery_window_seconds, *periods,
                    self.prefill.ttft_window_seconds if self.prefill else 0,
                    self.slo.window_seconds if self.slo else 0,
                    self.scale_to_zero_after_seconds or 0]) + 60

    def pool(self, role: str = DECODE) -> Pool:
        if role == DECODE:
            return Pool(DECODE, self.min_replicas, self.max_replicas, WAITING, self.target_waiting_per_replica)
        if role == PREFILL and self.prefill is not None:
            p = self.prefill
            return Pool(PREFILL, p.min_replicas, p.max_replicas, p.signal, p.target, p.ttft_window_seconds)
        raise ValueError(f"no {role} pool: a prefill pool needs spec.disaggregation.enabled true"
                         if role == PREFILL else f"unknown pool role {role!r} (decode or prefill)")

    def pools(self) -> tuple[Pool, ...]:
        """Every pool the InferenceService has, the decode pool first."""
        return (self.pool(DECODE),) + ((self.pool(PREFILL),) if self.prefill is not None else ())

    def bounded_to(self, pool: Pool) -> Settings:
        """These settings with the pool's replica bounds, for the machinery the pools share."""
        return replace(self, min_replicas=pool.min_replicas, max_replicas=pool.max_replicas)


def _same_named(cls, model) -> dict:
    """The model's values for the dataclass fields that share its names."""
    return {f.name: getattr(model, f.name) for f in fields(cls) if f.name in type(model).model_fields}


def settings_from_spec(spec) -> Settings:
    """`spec` is an InferenceServiceSpec; no autoscaling section means mode Off."""
    auto = spec.autoscaling
    if auto is None:
        return Settings(mode="Off", spec_max_num_seqs=spec.engine.max_num_seqs)
    return Settings(**{
        **_same_named(Settings, auto),
        "scale_up": DirectionRules.from_model(auto.scale_up),
        "scale_down": DirectionRules.from_model(auto.scale_down),
        "stale_sample_seconds": max(MIN_STALE_SAMPLE_SECONDS, 4 * auto.interval_seconds),
        "spec_max_num_seqs": spec.engine.max_num_seqs,
        "kv_retune": KvRetuneSettings(**_same_named(KvRetuneSettings, auto.kv_retune)),
        "prefill": prefill_settings(spec),
        "slo": slo_settings(spec, auto.slo) if auto.slo is not None else None,
    })


def prefill_settings(spec) -> PrefillSettings | None:
    d = spec.disaggregation
    if not d.enabled:
        return None
    return PrefillSettings(min_replicas=d.prefill.min_replicas, max_replicas=d.prefill.max_replicas,
                           signal=d.prefill.scaling_signal,
                           target_queued_prompt_tokens=d.prefill.target_queued_prompt_tokens,
                           target_ttft_seconds=d.prefill.target_ttft_seconds)
