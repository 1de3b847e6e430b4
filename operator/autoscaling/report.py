"""What one autoscaler tick decided and did, as data (`AutoscalerTick`), and how it reads in the
InferenceService's status and Events.

The autoscaler never writes status, the ConfigMap or the Deployment: it hands its tick to the
reconcile (operator/reconcile.py), the one writer of those, which merges `status_patch` into the
status it writes, starts new pods with `max_num_seqs`, and posts `events_for`. Pure: no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime

from iterserve.operator import status as status_rules
from iterserve.operator.autoscaling.engine_admin import SeqsOutcome
from iterserve.operator.autoscaling.policy import Decision, PodSignal, SeqsChange
from iterserve.operator.autoscaling.settings import REPLICAS_FIELDS, Settings
from iterserve.operator.models import METRICS_AVAILABLE, SCALING_LIMITED


@dataclass(frozen=True)
class Event:
    type: str  # Normal | Warning
    reason: str
    message: str


@dataclass(frozen=True)
class PoolTick:
    """One pool's part of a tick: its decision and what was carried out."""

    decision: Decision
    record: Record


@dataclass(frozen=True)
class AutoscalerTick:
    """One tick, handed to the reconcile to record. `decision` and `record` are the decode pool's
    (the engine Deployment's, whose numbers the status' top-level fields show); `extra_pools`
    every other pool's (the prefill pool's, when disaggregated), each shown as status.<role>."""

    settings: Settings
    decision: Decision
    record: Record
    at: datetime
    # The value new pods should start with (the lowest now in effect on a live pod); None when
    # nothing was read this tick: the reconcile keeps the value it recorded before.
    max_num_seqs: int | None
    # (average prompt tokens, finished requests) over the readable pods' lifetimes; None: none read.
    prompts: tuple[float, int] | None = None
    extra_pools: tuple[PoolTick, ...] = ()

    @property
    def pools(self) -> tuple[PoolTick, ...]:
        return (PoolTick(self.decision, self.record), *self.extra_pools)

    def pool(self, role: str) -> PoolTick | None:
        return next((p for p in self.pools if p.decision.pool == role), None)


def average_prompt(samples) -> tuple[float, int] | None:
    """(prompt tokens per finished request, finished requests) summed over the samples that have both."""
    both = [s for s in samples if s.ok and s.prompt_tokens_total is not None and s.requests_total is not None]
    requests = int(sum(s.requests_total for s in both))
    return (sum(s.prompt_tokens_total for s in both) / requests, requests) if requests else None


@dataclass
class Record:
    """What a tick carried out: spec.replicas, and each engine's max_num_seqs."""

    replicas_applied: bool = False
    seqs: SeqsOutcome = field(default_factory=lambda: SeqsOutcome((), ()))
    replicas_error: str | None = None


def seqs_by_pod(decision: Decision, applied: Sequence[SeqsChange]) -> dict[str, int]:
    """max_num_seqs in effect on each read pod after this tick's changes."""
    seqs = {p.pod: p.max_num_seqs for p in decision.pods if p.max_num_seqs is not None}
    seqs.update({c.pod: c.to_max_num_seqs for c in applied})
    return seqs


def config_max_num_seqs(decision: Decision, applied: Sequence[SeqsChange], spec_max_num_seqs: int) -> int:
    """The value new pods should start with: the lowest now in effect on a live pod."""
    seqs = seqs_by_pod(decision, applied)
    return min(seqs.values()) if seqs else spec_max_num_seqs


def start_max_num_seqs(decision: Decision, record: Record, settings: Settings) -> int | None:
    """`AutoscalerTick.max_num_seqs`: None when the tick read nothing and changed nothing."""
    if decision.metrics.available or record.seqs.applied:
        return config_max_num_seqs(decision, record.seqs.applied, settings.spec_max_num_seqs)
    return None


def tuned_max_num_seqs(settings: Settings, tick: AutoscalerTick | None, previous_status: dict) -> int | None:
    """What the KV retune wants new pods to start with: this tick's value, else the one recorded
    last; None (the spec's value) when the retune does not run."""
    if not settings.retunes:
        return None
    if tick is not None and tick.max_num_seqs is not None:
        return tick.max_num_seqs
    return previous_status.get("effectiveMaxNumSeqs")


def _scale_action(decision: Decision) -> str:
    return "ScaleUp" if decision.direction == "up" else "ScaleDown"


def _retune_action(change: SeqsChange) -> str:
    return "RetuneDown" if change.to_max_num_seqs < change.from_max_num_seqs else "RetuneUp"


def events_for(decision: Decision, record: Record, name_pool: bool = False) -> list[Event]:
    """`name_pool`: the InferenceService has more than one pool, so each replica Event says
    which pool it is about."""
    events = []
    pool = f"{decision.pool} pool: " if name_pool else ""
    if record.replicas_applied:
        events.append(Event("Normal", _scale_action(decision), f"{pool}{decision.reason}: {decision.message}"))
    if record.replicas_error:
        events.append(Event("Warning", "ScaleFailed", f"{pool}could not set {REPLICAS_FIELDS[decision.pool]} to "
                                                      f"{decision.desired_replicas}: {record.replicas_error}"))
    for change in record.seqs.applied:
        events.append(Event("Normal", _retune_action(change), f"pod {change.pod}: {change.reason}: {change.message}"))
    for change, error in record.seqs.failed:
        events.append(Event("Warning", "RetuneFailed",
                            f"pod {change.pod}: max_num_seqs {change.from_max_num_seqs} -> "
                            f"{change.to_max_num_seqs} not applied: {error}"))
    return events


def _history_records(decision: Decision, record: Record, now: datetime, name_pool: bool = False) -> list[dict]:
    """scalingHistory entries: the message for people, the numbers behind it as fields for tools."""
    stamp = status_rules.timestamp(now)
    out = []
    if record.replicas_applied:
        out.append({"time": stamp, "action": _scale_action(decision),
                    "reason": decision.reason, "message": decision.message[:1000],
                    "fromReplicas": decision.current_replicas, "toReplicas": decision.desired_replicas,
                    **({"pool": decision.pool} if name_pool else {}), **_signal_fields(decision)})
    for change in record.seqs.applied:
        out.append({"time": stamp, "action": _retune_action(change),
                    "reason": change.reason, "message": change.message[:1000], "pod": change.pod,
                    "fromMaxNumSeqs": change.from_max_num_seqs, "toMaxNumSeqs": change.to_max_num_seqs,
                    **({"kvUsageReadings": [round(v, 4) for v in change.kv_usage_readings],
                        "preemptionsAtReadings": list(change.preemptions_at_readings)}
                       if change.kv_usage_readings else {})})
    return out


def _signal_fields(decision: Decision) -> dict:
    if decision.metric_replicas is None:
        return {}  # no pod was read: the decision held or followed the bounds
    return {"signal": decision.signal, "signalValue": round(decision.signal_value, 3)
            if decision.signal_value is not None else None,
            "target": decision.signal_target, "metricReplicas": decision.metric_replicas}


def status_patch(previous: dict | None, settings: Settings, decision: Decision, record: Record,
                 effective_max_num_seqs: int, now: datetime, extra_pools: tuple[PoolTick, ...] = ()) -> dict:
    """The status fields that record a tick, as a merge patch over `previous`: the decode pool's
    (`decision`, `record`) at the top level, each of `extra_pools` in status.<role> and all of
    them in scalingHistory."""
    previous = previous or {}
    name_pool = bool(extra_pools)
    conditions = previous.get("conditions") or []
    metrics = decision.metrics
    conditions = status_rules.set_condition(conditions, METRICS_AVAILABLE,
                                            "True" if metrics.available else "False",
                                            metrics.reason or "Unknown", metrics.message, now)
    if decision.scaling_limited:
        conditions = status_rules.set_condition(conditions, SCALING_LIMITED, "True",
                                                decision.limited_reason or "Limited", decision.limited_message, now)
    else:
        conditions = status_rules.set_condition(conditions, SCALING_LIMITED, "False", "DesiredWithinRange",
                                                f"desired {decision.desired_replicas} within "
                                                f"[{settings.min_replicas}, {settings.max_replicas}]", now)
    patch: dict = {"conditions": conditions}
    if settings.mode == "Builtin":  # in External mode the reconcile keeps both at the spec's values
        patch["desiredReplicas"] = decision.desired_replicas
        patch["effectiveMaxNumSeqs"] = effective_max_num_seqs
    history = previous.get("scalingHistory") or []
    for pool in (PoolTick(decision, record), *extra_pools):
        for entry in _history_records(pool.decision, pool.record, now, name_pool):
            history = status_rules.append_history(history, entry)
    if history != (previous.get("scalingHistory") or []):
        patch["scalingHistory"] = history
    if record.replicas_applied:
        patch["lastScaleTime"] = status_rules.timestamp(now)
    measured = [p for p in decision.pods if p.state == "measured"]
    patch["waitingRequests"] = int(sum(p.waiting for p in measured)) if measured else None
    patch["kvCacheUsage"] = round(max(p.kv_usage for p in measured), 4) if measured else None
    patch["pods"] = [_pod_summary(p) for p in decision.pods]
    # SLO mode's and the activator's fields appear (and are cleared) only where they apply.
    if decision.slo is not None or previous.get("slo") is not None:
        patch["slo"] = slo_status(decision.slo) if decision.slo is not None else None
    if decision.held_requests is not None or previous.get("heldRequests") is not None:
        patch["heldRequests"] = None if decision.held_requests is None else int(decision.held_requests)
    for pool in extra_pools:
        patch[pool.decision.pool] = pool_status(previous.get(pool.decision.pool), settings, pool, now)
    return patch


def pool_status(previous: dict | None, settings: Settings, tick: PoolTick, now: datetime) -> dict:
    """status.<role>'s scaling fields from an extra pool's decision (the reconcile sets replicas
    and readyReplicas from the pool's Deployment)."""
    out = dict(previous or {})
    decision = tick.decision
    if settings.mode == "Builtin":
        out["desiredReplicas"] = decision.desired_replicas
    if tick.record.replicas_applied:
        out["lastScaleTime"] = status_rules.timestamp(now)
    out["signal"] = decision.signal
    out["signalValue"] = None if decision.signal_value is None else round(decision.signal_value, 3)
    out["target"] = decision.signal_target
    out["reason"] = decision.reason
    return out


def _seconds(value: float | None) -> float | None:
    return None if value is None or math.isinf(value) or math.isnan(value) else round(value, 4)


def slo_status(slo) -> dict:
    """status.slo from SLO mode's outcome (policy.Decision.slo); an unbounded prediction is null. Where SLO
    mode fell back (no proposal of its own), the prediction at the current replicas: what it compared
    with the measurement (predictionError), so the status shows why it fell back."""
    predicted = slo.predicted or slo.predicted_current
    return {
        "predictedTtftP95": _seconds(predicted.ttft_p95_s) if predicted else None,
        "predictedItlP95": _seconds(predicted.itl_p95_s) if predicted else None,
        "measuredTtftP95": _seconds(slo.measured_ttft_p95_s),
        "measuredItlP95": _seconds(slo.measured_itl_p95_s),
        "predictionError": None if slo.prediction_error is None or math.isinf(slo.prediction_error)
        else round(slo.prediction_error, 3),
        "fallback": slo.fallback,
        "maxNumSeqs": slo.max_num_seqs,
        "arrivalRate": round(slo.workload.arrival_rate, 4) if slo.workload else None,
        "stepProfile": slo.step_profile or None,
        "stepProfileReason": slo.profile_choice.reason,
        "stepProfileSteps": slo.profile_choice.steps,
        "message": slo.note[:1024],
    }


def _pod_summary(signal: PodSignal) -> dict:
    summary = {"name": signal.pod, "ready": True}
    if signal.state == "measured":
        summary.update(waitingRequests=int(signal.waiting), runningSeqs=int(signal.running),
                       kvCacheUsage=round(signal.kv_usage, 4), maxNumSeqs=signal.max_num_seqs)
        if signal.preemptions_per_minute is not None:
            summary["preemptionsPerMinute"] = round(signal.preemptions_per_minute, 3)
    return summary
