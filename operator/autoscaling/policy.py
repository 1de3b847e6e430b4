"""The autoscaler's decision function: spec + state + samples + clock -> decision with reasons.

Pure: no I/O, no clock of its own, no Kubernetes. The operator's timer and the simulator call
`decide()` unchanged, once per pool (settings.Pool: the decode pool, and the prefill pool when
disaggregated), each with its own signal, target, bounds and pods. Replicas follow HPA's formula
on an average-value target (the pool's signal summed over read pods / target per replica, or
replicas x p95 TTFT / target), with HPA's tolerance, stabilization windows and rate policies,
plus the guards that other LLM control planes lack: capacity that is still loading counts,
warm-up samples are ignored, an unreadable pod never blocks the others, missing is never zero,
and, in a pool whose pods hold sequences, preemptions both add replicas and block scale-down and
the KV retune (retune.py) tunes each pod's max_num_seqs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from iterserve.operator.autoscaling.readings import PodSample as PodSample
from iterserve.operator.autoscaling.readings import PodState as PodState
from iterserve.operator.autoscaling.readings import (
    effective_seqs,
    preemption_rate_per_minute,
    usable_samples,
    windowed_ttft_quantile,
)
from iterserve.operator.autoscaling.readings import histogram_quantile as histogram_quantile
from iterserve.operator.autoscaling.retune import SeqsChange as SeqsChange
from iterserve.operator.autoscaling.retune import kv_retune
from iterserve.operator.autoscaling.settings import (
    DECODE,
    QUEUED_PROMPT_TOKENS,
    TTFT,
    WAITING,
    Pool,
    Settings,
)
from iterserve.operator.autoscaling.settings import DirectionRules as DirectionRules
from iterserve.operator.autoscaling.settings import KvRetuneSettings as KvRetuneSettings
from iterserve.operator.autoscaling.settings import RatePolicy as RatePolicy
from iterserve.operator.autoscaling.slo import SLO_SIGNAL, SloOutcome, slo_reading

# -------------------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class Recommendation:
    at: float
    replicas: int


@dataclass(frozen=True)
class ScaleEvent:
    at: float
    from_replicas: int
    to_replicas: int


@dataclass(frozen=True)
class State:
    replicas: int  # spec.replicas: what was last asked for
    pods: tuple[PodState, ...] = ()
    recommendations: tuple[Recommendation, ...] = ()  # earlier raw proposals, for stabilization
    scale_events: tuple[ScaleEvent, ...] = ()  # earlier replica changes, for rate policies
    last_scale_up_at: float | None = None
    # Requests the router holds while no replica is ready (its held-requests gauge); None: not read.
    held_requests: float | None = None


# ------------------------------------------------------------------------------------- outputs


@dataclass(frozen=True)
class MetricsStatus:
    available: bool
    reason: str  # CamelCase, as a condition reason
    message: str


@dataclass(frozen=True)
class PodSignal:
    """What the policy made of one ready pod this tick."""

    pod: str
    state: str  # measured | warming | unreadable | stale
    waiting: float | None = None
    running: float | None = None
    kv_usage: float | None = None
    preemptions_per_minute: float | None = None
    max_num_seqs: int | None = None
    error: str | None = None
    queued_prompt_tokens: float | None = None


@dataclass(frozen=True)
class Decision:
    current_replicas: int
    desired_replicas: int
    direction: str  # up | down | none
    reason: str  # snake_case code, the label of iterserve_autoscaler_decisions_total
    message: str  # the numbers behind it
    recommendation: Recommendation | None  # the raw proposal, to remember for stabilization
    seqs_changes: tuple[SeqsChange, ...]
    metrics: MetricsStatus
    scaling_limited: bool = False
    limited_message: str = ""
    limited_reason: str = ""  # HPA's ScalingLimited reasons: TooManyReplicas, TooFewReplicas, ScaleUpLimit, ScaleDownLimit
    pods: tuple[PodSignal, ...] = ()
    total_waiting: float | None = None
    total_running: float | None = None
    preemptions_per_minute_per_replica: float | None = None
    # The pool decided for, its signal and what the signal read.
    pool: str = DECODE  # decode (the engine Deployment, or the only pool) | prefill
    signal: str | None = None  # WaitingRequests | QueuedPromptTokens | TTFT
    signal_value: float | None = None  # waiting or queued prompt tokens per replica, or the windowed p95 TTFT (s)
    signal_target: float | None = None
    metric_replicas: float | None = None  # what the signal alone asked for, unrounded, before every other rule
    slo: SloOutcome | None = None  # SLO mode: the workload, predicted and measured p95s, the plan
    held_requests: float | None = None  # what the router held when the tick read it

    @property
    def replicas_changed(self) -> bool:
        return self.desired_replicas != self.current_replicas


# ------------------------------------------------------------------------------------- signals


REQUIRED_SIGNALS = ("waiting", "running", "kv_usage", "preemptions_total")  # a reading without one is unusable


def _missing_field(sample: PodSample) -> str | None:
    for name in REQUIRED_SIGNALS:
        value = getattr(sample, name)
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return name
    return None


def _pod_signal(pod: PodState, samples: Sequence[PodSample], settings: Settings, now: float,
                pool: Pool) -> PodSignal:
    if now - pod.ready_at < settings.warmup_seconds:
        return PodSignal(pod.name, "warming")
    if not samples or samples[-1].at < now - settings.stale_sample_seconds:
        return PodSignal(pod.name, "stale", error="no recent sample")
    latest = samples[-1]
    if not latest.ok:
        return PodSignal(pod.name, "unreadable", error=latest.error)
    missing = _missing_field(latest)
    if missing is not None:
        return PodSignal(pod.name, "unreadable", error=f"{missing} missing or NaN")
    missing = _missing_pool_signal(latest, pool)
    if missing is not None:
        return PodSignal(pod.name, "unreadable", error=missing)
    usable = usable_samples(samples, pod, settings)
    return PodSignal(
        pod.name, "measured", waiting=latest.waiting, running=latest.running,
        kv_usage=latest.kv_usage,
        preemptions_per_minute=preemption_rate_per_minute(usable, now, settings.preemption_window_seconds),
        max_num_seqs=effective_seqs(pod, latest, settings), queued_prompt_tokens=latest.queued_prompt_tokens,
    )


def _missing_pool_signal(latest: PodSample, pool: Pool) -> str | None:
    """What the pool's own signal needs on top of the required readings (missing is never zero)."""
    if pool.signal == QUEUED_PROMPT_TOKENS and (latest.queued_prompt_tokens is None
                                                or math.isnan(latest.queued_prompt_tokens)):
        return "iterserve_scheduler_queued_prompt_tokens missing (an engine older than the operator?)"
    if pool.signal == TTFT and not latest.ttft_buckets:
        return "TTFT histogram missing"
    return None


def _preempted_within(samples: Sequence[PodSample], now: float, window: float) -> bool:
    rate = preemption_rate_per_minute(samples, now, window)
    return rate is not None and rate > 0


# --------------------------------------------------------------------------------- the decision


def decide(settings: Settings, state: State, history: Mapping[str, Sequence[PodSample]], now: float,
           pool: str = DECODE) -> Decision:
    """The whole decision for one pool of one InferenceService at time `now`.

    `pool` is the pool's role (`settings.pools()`): the decode pool (the engine Deployment; the
    only pool without disaggregation) or the prefill pool. `state` and `history` hold that pool's
    pods only, and `state.replicas` is its replicas. `history` maps a pod name to its recent
    samples, oldest first, this tick's last.
    """
    spec = settings.pool(pool)
    extra = {"pool": spec.role, "signal": spec.signal, "signal_target": spec.target}
    if settings.mode == "Off":
        return Decision(state.replicas, state.replicas, "none", "autoscaling_off", "autoscaling is Off", None, (),
                        MetricsStatus(False, "AutoscalingOff", "autoscaling is Off"), **extra)

    ready = [p for p in state.pods if p.ready_at is not None]
    signals = tuple(_pod_signal(p, history.get(p.name, ()), settings, now, spec) for p in ready)
    measured = [s for s in signals if s.state == "measured"]
    metrics = _metrics_status(signals, state)
    retunes = bool(measured) and settings.retunes and spec.holds_sequences
    seqs_changes = kv_retune(settings, ready, history, now) if retunes else ()

    replicas = _replica_decision(settings.bounded_to(spec), spec, state, history, signals, measured, metrics, now)
    if replicas.slo is not None and settings.mode == "Builtin":
        seqs_changes = _itl_cap(replicas.slo.max_num_seqs, seqs_changes, ready, history, settings)
        extra.update(signal=SLO_SIGNAL, signal_target=settings.slo.ttft_p95_s or settings.slo.itl_p95_s)
    return replace(replicas, seqs_changes=seqs_changes, metrics=metrics, pods=signals,
                   held_requests=state.held_requests, **extra)


def _itl_cap(cap: int | None, changes: tuple[SeqsChange, ...], ready: Sequence[PodState], history,
             settings: Settings) -> tuple[SeqsChange, ...]:
    """SLO mode's max_num_seqs: with the ITL target binding, no pod runs above `cap` (the KV
    retune may still lower one further, never raise one past it)."""
    if cap is None:
        return changes
    by_pod = {c.pod: c for c in changes}
    out = []
    for pod in ready:
        samples = history.get(pod.name, ())
        running = effective_seqs(pod, samples[-1] if samples else None, settings)
        change = by_pod.get(pod.name)
        target = change.to_max_num_seqs if change is not None else running
        if target > cap:
            out.append(SeqsChange(pod.name, running, cap, "itl_target",
                                  f"the ITL target allows max_num_seqs {cap} (pod runs {running})"))
        elif change is not None:
            out.append(change)
    return tuple(c for c in out if c.to_max_num_seqs != c.from_max_num_seqs)


def _metrics_status(signals: Sequence[PodSignal], state: State) -> MetricsStatus:
    measured = [s for s in signals if s.state == "measured"]
    failed = [s for s in signals if s.state in ("unreadable", "stale")]
    errors = "; ".join(f"{s.pod}: {s.error}" for s in failed)
    if measured:
        if failed:
            return MetricsStatus(True, "PartialMetrics",
                                 f"{len(measured)} of {len(signals)} ready pods read; left out {errors}")
        return MetricsStatus(True, "MetricsRead", f"{len(measured)} ready pods read")
    if failed:
        return MetricsStatus(False, "NoPodReadable", f"no ready pod could be read: {errors}")
    if signals:
        return MetricsStatus(False, "WarmingUp", f"all {len(signals)} ready pods are still warming up")
    return MetricsStatus(False, "NoReadyPods", f"none of {len(state.pods)} pods is ready")


def _hold(state: State, settings: Settings, reason: str, message: str) -> Decision:
    desired = _clamp(state.replicas, settings)
    if desired != state.replicas:
        direction = "up" if desired > state.replicas else "down"
        reason = "below_min_replicas" if direction == "up" else "above_max_replicas"
        message = f"{message}; replicas {state.replicas} outside [{settings.min_replicas}, {settings.max_replicas}]"
        return Decision(state.replicas, desired, direction, reason, message, None, (),
                        MetricsStatus(False, "", ""), True, message,
                        "TooFewReplicas" if direction == "up" else "TooManyReplicas")
    return Decision(state.replicas, desired, "none", reason, message, None, (), MetricsStatus(False, "", ""))


def _clamp(replicas: int, settings: Settings) -> int:
    return max(settings.min_replicas, min(settings.max_replicas, replicas))


@dataclass(frozen=True)
class _Reading:
    """What the pool's signal says this tick, over its measured pods."""

    replicas: float  # what the signal alone asks for, unrounded (HPA's usage ratio x replicas)
    value: float | None  # per read replica (waiting, queued prompt tokens) or the windowed p95 TTFT
    over_target: list[str]  # pods whose own reading is above the target: they block scale-down
    note: str
    above: str  # the reason codes when the signal asks for more, or for fewer, replicas
    below: str


def _read_signal(settings: Settings, pool: Pool, state: State, history, measured: list[PodSignal],
                 now: float) -> _Reading:
    target, count = pool.target, len(measured)
    if pool.signal == WAITING:
        held = state.held_requests or 0.0  # requests the router holds wait too
        total = sum(s.waiting for s in measured) + held
        return _Reading(total / target, total / count, [s.pod for s in measured if s.waiting > target],
                        f"waiting {total:g} on {count} read pods" + (f" ({held:g} held at the router)" if held else "")
                        + f" (target {target:g}/replica)",
                        "waiting_above_target", "waiting_below_target")
    if pool.signal == QUEUED_PROMPT_TOKENS:
        total = sum(s.queued_prompt_tokens for s in measured)
        return _Reading(total / target, total / count, [s.pod for s in measured if s.queued_prompt_tokens > target],
                        f"queued prompt tokens {total:g} on {count} read pods "
                        f"({total / count:.0f}/replica, target {target:g}/replica)",
                        "queued_prompt_tokens_above_target", "queued_prompt_tokens_below_target")
    pods = {p.name: p for p in state.pods}
    p95, observed = windowed_ttft_quantile(
        0.95, [usable_samples(history.get(s.pod, ()), pods[s.pod], settings) for s in measured], now,
        pool.ttft_window_seconds)
    if p95 is None:
        return _Reading(0.0, None, [], f"no first token in the last {pool.ttft_window_seconds:g} s on "
                        f"{count} read pods", "ttft_above_target", "ttft_below_target")
    return _Reading(count * p95 / target, p95, [s.pod for s in measured] if p95 > target else [],
                    f"p95 TTFT {p95:.3f} s over {observed} requests in {pool.ttft_window_seconds:g} s on "
                    f"{count} read pods (target {target:g} s)", "ttft_above_target", "ttft_below_target")


def _replica_decision(settings: Settings, pool: Pool, state: State, history, signals, measured, metrics,
                      now: float) -> Decision:
    """`settings` carry the pool's replica bounds."""
    current = state.replicas
    if settings.mode == "External":
        return Decision(current, current, "none", "external_mode",
                        f"mode External: an external autoscaler owns {pool.replicas_field}", None, (), metrics)
    zero = _scale_to_zero(settings, pool, state, history, signals, measured, metrics, now)
    if zero is not None:
        return zero
    if _keeps_one(settings, pool):
        # Scale to zero is the idle timer's alone: the signals' own zero stops at one replica.
        settings = replace(settings, min_replicas=1)
    if not measured:
        where = "" if pool.role == DECODE else f"{pool.role} pool "
        return _hold(state, settings, "metrics_unavailable", f"{where}holding at {current}: {metrics.message}")

    slo = None
    if settings.slo is not None and pool.role == DECODE:
        pods = {p.name: p for p in state.pods}
        seqs_now = min(s.max_num_seqs for s in measured)
        slo = slo_reading(settings, current, seqs_now, [s.pod for s in measured], pods, history, now)
    reading = _read_signal(settings, pool, state, history, measured, now)
    if slo is not None and slo.proposal is not None:
        reading = _slo_as_reading(slo, settings.slo, measured)
    total_waiting = sum(s.waiting for s in measured)
    total_running = sum(s.running for s in measured)
    rate_per_replica = sum(s.preemptions_per_minute or 0.0 for s in measured) / len(measured)
    notes = [reading.note] if slo is None or slo.proposal is not None else [slo.note, reading.note]
    if pool.holds_sequences:
        notes.append(f"preemptions {rate_per_replica:.2f}/min/replica "
                     f"(threshold {settings.preemptions_per_minute_threshold:g})")

    if slo is not None and slo.proposal is not None:
        proposal, reason = slo.proposal, slo.reason  # the hysteresis band, not HPA's tolerance
    elif current > 0 and abs(reading.replicas / current - 1.0) <= settings.tolerance:
        proposal, reason = current, "within_tolerance"
    else:
        proposal = math.ceil(reading.replicas)
        reason = reading.above if proposal > current else reading.below

    busy = total_waiting + total_running > 0
    if (pool.holds_sequences and busy and rate_per_replica > settings.preemptions_per_minute_threshold
            and proposal <= current):
        proposal, reason = current + 1, "preemptions"
    if proposal < current:
        proposal, reason = _scale_down_floor(settings, pool, state, history, signals, measured, reading,
                                             proposal, reason, notes, now)

    # The preemption rule's +1 and the TTFT rule's replicas x p95 / target are relative to the
    # replicas asked for; the queue rules' proposals are absolute (total / target), so they pass
    # while pods load (see _carry_out).
    decision = _carry_out(settings, state, proposal, reason, notes, metrics, signals, now,
                          relative=reason == "preemptions" or pool.signal == TTFT)
    return replace(decision, total_waiting=total_waiting, total_running=total_running,
                   preemptions_per_minute_per_replica=rate_per_replica, signal_value=reading.value,
                   metric_replicas=reading.replicas, slo=slo)


def _slo_as_reading(slo: SloOutcome, slo_settings, measured: list[PodSignal]) -> _Reading:
    """SLO mode's proposal in the shape the shared rules read: a measured p95 above its target
    blocks scale-down, as a queue above target does."""
    missed = any(value is not None and target is not None and value > target for value, target in (
        (slo.measured_ttft_p95_s, slo_settings.ttft_p95_s), (slo.measured_itl_p95_s, slo_settings.itl_p95_s)))
    predicted = slo.predicted
    value = None
    if predicted is not None:
        value = predicted.ttft_p95_s if slo_settings.ttft_p95_s is not None else predicted.itl_p95_s
        value = None if math.isinf(value) else value
    return _Reading(float(slo.proposal), value, [s.pod for s in measured] if missed else [], slo.note,
                    "slo_predicted_miss", "slo_met_with_fewer")


def _keeps_one(settings: Settings, pool: Pool) -> bool:
    return pool.role == DECODE and settings.min_replicas == 0 and settings.scale_to_zero_after_seconds is not None


def _scale_to_zero(settings: Settings, pool: Pool, state: State, history, signals, measured, metrics,
                   now: float) -> Decision | None:
    """The decode pool with minReplicas 0. At zero: held requests at the router bring one replica
    (reason held_requests), else it stays at zero. Above zero with scaleToZeroAfterSeconds: zero
    once every ready pod is read idle (nothing waiting or running) and no request finished on any
    of them for that long, nothing is held and nothing is loading (idle_scale_to_zero). The idle
    timer is this rule's own stabilization: the scale-down window does not apply. None: the
    other rules decide."""
    if pool.role != DECODE or settings.min_replicas != 0:
        return None
    current, held = state.replicas, state.held_requests or 0.0
    if current == 0:
        if held > 0:
            decision = _carry_out(settings, state, 1, "held_requests",
                                  [f"the router holds {held:g} requests and no replica exists"], metrics, signals, now)
            return replace(decision, metric_replicas=1.0, total_waiting=held)
        return Decision(0, 0, "none", "scaled_to_zero", "at zero replicas; no request held at the router", None, (),
                        MetricsStatus(False, "ScaledToZero", "no replicas: nothing to read"))
    after = settings.scale_to_zero_after_seconds
    if after is None or held > 0 or not measured or len(measured) != len(signals) or len(signals) != len(state.pods):
        return None
    if any(s.waiting or s.running for s in measured):
        return None
    pods = {p.name: p for p in state.pods}
    for signal in measured:
        samples = usable_samples(history.get(signal.pod, ()), pods[signal.pod], settings)
        counted = [s for s in samples if s.ok and s.requests_total is not None]
        recent = [s for s in counted if s.at >= now - after]
        if not counted or counted[0].at > now - after + 1e-9:
            return None  # no reading from that long ago: idle for less than the timer, as far as we know
        base = counted[len(counted) - len(recent) - 1] if len(recent) < len(counted) else counted[0]
        if any(s.requests_total != base.requests_total for s in recent):
            return None
    message = (f"replicas {current} -> 0: no request on {len(measured)} read pods for {after:g} s "
               "(scaleToZeroAfterSeconds); the router holds new requests until a replica is ready")
    return Decision(current, 0, "down", "idle_scale_to_zero", message, Recommendation(now, 0), (), metrics,
                    pods=tuple(signals), total_waiting=0.0, total_running=0.0)


def _carry_out(settings: Settings, state: State, proposal: int, reason: str, notes: list[str],
               metrics: MetricsStatus, signals: Sequence[PodSignal], now: float, relative: bool = False) -> Decision:
    """A raw proposal through the machinery both pools share: stabilization windows, capacity
    still loading, rate policies and replica bounds, in HPA's order.

    Capacity still loading holds only a `relative` proposal (one computed from the replicas
    themselves: the preemption rule's current + 1, the TTFT rule's replicas x p95 / target):
    repeated while pods load, it would compound (2 -> 4 -> 8 -> 16). An absolute proposal
    (total waiting or queued prompt tokens / target) is what the demand needs however many pods
    are loading; `current` already counts them, so it scales up only past them (HPA and KPA keep
    scaling on such proposals while pods start)."""
    current = state.replicas
    recommendation = Recommendation(now, proposal)
    desired, held_by = _stabilize(settings, state, proposal, now), None
    if desired != proposal:
        notes.append(f"proposal {proposal} stabilized to {desired}")
        held_by = "stabilization_window"
    if desired > current and relative:
        pending = _pending(settings, state, now)
        if pending:
            notes.append(f"{pending}; no further {reason} scale-up until they are ready or "
                         f"{settings.cold_start_seconds:g} s pass")
            desired, held_by = current, "pending_replicas"
    limited, limited_reason = [], ""
    allowed = _rate_limit(settings, state, current, desired, now)
    if allowed != desired:
        limited.append(f"rate policy allows {allowed} (wanted {desired})")
        limited_reason = "ScaleUpLimit" if desired > current else "ScaleDownLimit"
        desired, held_by = allowed, "rate_limited"
    bounded = _clamp(desired, settings)
    if bounded != desired:
        limited.append(f"bounded to [{settings.min_replicas}, {settings.max_replicas}] (wanted {desired})")
        limited_reason = "TooManyReplicas" if desired > bounded else "TooFewReplicas"
        desired, held_by = bounded, "at_replica_bounds"

    if desired == current and proposal != current:
        reason = held_by or "at_replica_bounds"
    elif desired != current and (proposal == current or (desired > current) != (proposal > current)):
        reason = "below_min_replicas" if desired > current else "above_max_replicas"

    direction = "up" if desired > current else "down" if desired < current else "none"
    message = f"replicas {current} -> {desired}: " + "; ".join(notes + limited)
    return Decision(current, desired, direction, reason, message, recommendation, (), metrics,
                    scaling_limited=bool(limited), limited_message="; ".join(limited),
                    limited_reason=limited_reason, pods=tuple(signals))


def _sequence_capacity(signal: PodSignal) -> float:
    """Sequences one replica can hold: max_num_seqs, or fewer when its KV pool fills first
    (running / KV usage extrapolates from what the pool holds now)."""
    if signal.kv_usage and signal.running:
        return max(1.0, min(signal.max_num_seqs, signal.running / signal.kv_usage))
    return signal.max_num_seqs


def _scale_down_floor(settings, pool, state, history, signals, measured, reading, proposal, reason, notes, now):
    """How far down the replicas may go: never below what the pods left unmeasured or (in a pool
    that holds sequences) the running sequences need, and not at all while a pod's reading is
    above target, a pod is still loading or warming up (its numbers do not mean anything yet),
    or (in a pool that holds sequences) preemptions happen."""
    current = state.replicas
    total_running = sum(s.running for s in measured)
    unmeasured = len(signals) - len(measured)
    if pool.holds_sequences and sum(s.waiting for s in measured) == 0 and total_running == 0 and not unmeasured:
        reason = "zero_traffic"
    if unmeasured:
        # HPA's rule for pods without metrics: on the way down, assume each is exactly at target.
        assumed = math.ceil(reading.replicas + unmeasured)
        if assumed > proposal:
            notes.append(f"{unmeasured} unmeasured ready pods assumed at target: {assumed}")
            proposal = assumed
            reason = "unmeasured_pods_assumed_at_target" if proposal >= current else reason
    if pool.holds_sequences:
        mean_capacity = sum(_sequence_capacity(s) for s in measured) / len(measured)
        busy_floor = math.ceil(total_running / mean_capacity) + unmeasured
        if busy_floor > proposal:
            notes.append(f"{total_running:g} running sequences ({mean_capacity:.3g} fit per replica) need {busy_floor}")
            proposal = busy_floor
            reason = "running_sequences" if proposal >= current else reason
    if proposal >= current:
        return current, reason

    blocked = _scale_down_blocked(settings, pool, state, history, signals, reading, now)
    if blocked is not None:
        notes.append(blocked[1])
        return current, blocked[0]
    return proposal, reason


def _scale_down_blocked(settings, pool, state, history, signals, reading, now) -> tuple[str, str] | None:
    """(reason, note) when something forbids scaling down this tick, else None."""
    preempting = [p.name for p in state.pods if pool.holds_sequences and p.ready_at is not None and _preempted_within(
        usable_samples(history.get(p.name, ()), p, settings), now, settings.preemption_window_seconds)]
    coming = [p.name for p in state.pods if p.ready_at is None and now - p.created_at < settings.cold_start_seconds]
    coming += [s.pod for s in signals if s.state == "warming"]
    if preempting:
        return "scale_down_blocked_preemptions", f"preemptions on {', '.join(preempting)}"
    if reading.over_target:
        return "scale_down_blocked_queue", f"{pool.signal} above target on {', '.join(reading.over_target)}"
    if coming:
        return "scale_down_blocked_warming", f"pods loading or warming up: {', '.join(coming)}"
    return None


def _stabilize(settings: Settings, state: State, proposal: int, now: float) -> int:
    """HPA's rule: scale up to the lowest, down to the highest proposal within each window."""
    up_from = now - settings.scale_up.stabilization_window_seconds
    down_from = now - settings.scale_down.stabilization_window_seconds
    up_limit = min([proposal] + [r.replicas for r in state.recommendations if r.at > up_from])
    down_limit = max([proposal] + [r.replicas for r in state.recommendations if r.at > down_from])
    desired = state.replicas
    if desired < up_limit:
        desired = up_limit
    if desired > down_limit:
        desired = down_limit
    return desired


def _pending(settings: Settings, state: State, now: float) -> str:
    """Capacity already on its way: pods not ready yet, or asked for but not created yet."""
    loading = [p for p in state.pods if p.ready_at is None and now - p.created_at < settings.cold_start_seconds]
    if loading:
        return f"{len(loading)} pods still loading ({', '.join(p.name for p in loading)})"
    uncreated = state.replicas - len(state.pods)
    if (uncreated > 0 and state.last_scale_up_at is not None
            and now - state.last_scale_up_at < settings.cold_start_seconds):
        return f"{uncreated} pods asked for but not created yet"
    return ""


def _rate_limit(settings: Settings, state: State, current: int, desired: int, now: float) -> int:
    """HPA behavior policies: how far replicas may move from where they stood at each period's start."""
    if desired == current:
        return desired
    rules = settings.scale_up if desired > current else settings.scale_down
    if rules.select_policy == "Disabled":
        return current
    if not rules.policies:
        return desired
    limits = []
    for policy in rules.policies:
        since = now - policy.period_seconds
        added = sum(e.to_replicas - e.from_replicas for e in state.scale_events
                    if e.at > since and e.to_replicas > e.from_replicas)
        removed = sum(e.from_replicas - e.to_replicas for e in state.scale_events
                      if e.at > since and e.to_replicas < e.from_replicas)
        start = current - added + removed
        if desired > current:
            limits.append(start + policy.value if policy.kind == "Pods"
                          else math.ceil(start * (1 + policy.value / 100)))
        else:
            limits.append(start - policy.value if policy.kind == "Pods"
                          else math.floor(start * (1 - policy.value / 100)))
    if desired > current:
        limit = max(limits) if rules.select_policy == "Max" else min(limits)
        return max(current, min(desired, limit))
    limit = min(limits) if rules.select_policy == "Max" else max(limits)
    return min(current, max(desired, limit))
