"""The whole status one reconcile writes, as a pure function of what it read: the previous
status, the spec, the Deployments it just applied, the routing state and the autoscaler's tick.

Its shape: the decode pool (the engine Deployment) in the top-level fields, every other pool in
one nested object named by its role (status.prefill, when disaggregated), the autoscaler's tick
merged over both (autoscaling/report.py). prefillReplicas and prefillReadyReplicas are
deprecated copies of status.prefill's counts, kept readable for one release.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from iterserve.operator import disaggregation
from iterserve.operator.autoscaling.report import AutoscalerTick, status_patch
from iterserve.operator.models import DISAGGREGATION_INEFFECTIVE, InferenceServiceSpec
from iterserve.operator.status import find_condition, reconciled_status, set_condition

DEPRECATED_POOL_FIELDS = {"prefillReplicas": "replicas", "prefillReadyReplicas": "readyReplicas"}


@dataclass(frozen=True)
class Observed:
    """What one reconcile read and applied, for the status it writes."""

    spec: InferenceServiceSpec
    name: str
    generation: int | None
    deployment: dict  # the engine Deployment as applied
    max_num_seqs: int
    now: datetime
    routing: tuple[str, str, str]  # RoutingUnavailable's (status, reason, message)
    router: dict | None = None  # the router Deployment (Router mode)
    prefill: dict | None = None  # the prefill pool's Deployment (disaggregation)
    tick: AutoscalerTick | None = None
    selector: str | None = None  # the scale subresource's pod selector, when not every engine pod's (groups)


def service_status(previous: dict, seen: Observed) -> dict:
    """The status fields this reconcile wants (a merge patch over `previous`)."""
    status = reconciled_status(previous, seen.spec, seen.name, seen.generation, seen.deployment, seen.max_num_seqs,
                               seen.now, routing=seen.routing, router=seen.router)
    status.update(_extra_pools(previous, seen.spec, seen.prefill))
    if seen.selector is not None:  # multi-node groups: one pod per replica, its leader
        status["selector"] = seen.selector
    status["conditions"] = _ineffective(status["conditions"], seen)
    if seen.tick is not None:
        tick = seen.tick
        status.update(status_patch({**previous, **status}, tick.settings, tick.decision, tick.record,
                                   seen.max_num_seqs, tick.at, tick.extra_pools))
    return {**status, **_deprecated_copies(previous, status)}


def _extra_pools(previous: dict, spec: InferenceServiceSpec, prefill: dict | None) -> dict:
    """status.prefill's counts from the prefill Deployment; its desiredReplicas from the spec
    unless the builtin autoscaler recorded its own; None once disaggregation is off."""
    if not spec.disaggregation.enabled:
        return {"prefill": None} if previous.get("prefill") is not None else {}
    counts = (prefill or {}).get("status") or {}
    pool = {**(previous.get("prefill") or {}), "replicas": counts.get("replicas", 0),
            "readyReplicas": counts.get("readyReplicas", 0)}
    if spec.autoscaling_mode != "Builtin" or "desiredReplicas" not in pool:
        pool["desiredReplicas"] = spec.disaggregation.prefill.wanted_replicas
    return {"prefill": pool}


def _deprecated_copies(previous: dict, status: dict) -> dict:
    pool = status.get("prefill")
    if pool is None and all(previous.get(k) is None for k in DEPRECATED_POOL_FIELDS):
        return {}
    return {old: pool.get(new) if pool else None for old, new in DEPRECATED_POOL_FIELDS.items()}


def _ineffective(conditions: list[dict], seen: Observed) -> list[dict]:
    """DisaggregationIneffective: judged when a tick read prompts (Unknown until then), set to
    False once disaggregation is off, else left as it was."""
    enabled = seen.spec.disaggregation.enabled
    prompts = seen.tick.prompts if seen.tick is not None else None
    present = find_condition(conditions, DISAGGREGATION_INEFFECTIVE) is not None
    if enabled and (prompts or not present):
        average, requests = prompts or (None, 0)
    elif not enabled and present:
        average, requests = None, 0
    else:
        return conditions
    return set_condition(conditions, DISAGGREGATION_INEFFECTIVE,
                         *disaggregation.ineffective_condition(seen.spec, average, requests), seen.now,
                         seen.generation)
