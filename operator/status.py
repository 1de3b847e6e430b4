"""Pure status computation: conditions with stable transition times, the status the reconcile
writes from the Deployment it owns, and the bounded scaling history the autoscaler appends to.

Everything works on the wire form (camelCase dicts), the shape that is patched onto
the status subresource; the clock is a parameter.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from iterserve.operator.models import (
    CONDITION_TYPES,
    CONFLICT,
    DEGRADED,
    INVALID_SPEC,
    METRICS_AVAILABLE,
    PROGRESSING,
    READY,
    ROUTING_UNAVAILABLE,
    SCALING_HISTORY_LIMIT,
    SCALING_LIMITED,
    InferenceServiceSpec,
)
from iterserve.operator.resources import selector_string

TRUE, FALSE, UNKNOWN = "True", "False", "Unknown"


def timestamp(now: datetime) -> str:
    return now.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def utcnow() -> datetime:
    return datetime.now(UTC)


def find_condition(conditions: list[dict] | None, type_: str) -> dict | None:
    return next((c for c in conditions or [] if c.get("type") == type_), None)


def set_condition(conditions: list[dict] | None, type_: str, status: str, reason: str, message: str,
                  now: datetime, generation: int | None = None) -> list[dict]:
    """A new list with the condition set; lastTransitionTime moves only when status changes."""
    old = find_condition(conditions, type_)
    changed = old is None or old.get("status") != status
    new = {
        "type": type_, "status": status, "reason": reason, "message": message,
        "lastTransitionTime": timestamp(now) if changed else old["lastTransitionTime"],
    }
    if generation is not None:
        new["observedGeneration"] = generation
    others = [c for c in conditions or [] if c.get("type") != type_]
    return _ordered(others + [new])


_ORDER = CONDITION_TYPES  # conditions are listed in the order the model declares them


def _ordered(conditions: list[dict]) -> list[dict]:
    return sorted(conditions, key=lambda c: _ORDER.index(c["type"]) if c["type"] in _ORDER else len(_ORDER))


def ensure_condition(conditions: list[dict] | None, type_: str, reason: str, message: str,
                     now: datetime) -> list[dict]:
    """Adds the condition as Unknown only if absent (the autoscaler owns its later values)."""
    if find_condition(conditions, type_) is not None:
        return list(conditions or [])
    return set_condition(conditions, type_, UNKNOWN, reason, message, now)


def _deployment_condition(deployment: dict, type_: str) -> dict | None:
    return find_condition((deployment.get("status") or {}).get("conditions"), type_)


def reconciled_status(previous: dict | None, spec: InferenceServiceSpec, name: str, generation: int,
                      deployment: dict, max_num_seqs: int, now: datetime,
                      routing: tuple[str, str, str] | None = None, router: dict | None = None) -> dict[str, Any]:
    """The fields the reconcile owns, computed from the Deployment it just applied. `routing`: the
    RoutingUnavailable condition's (status, reason, message); `router`: the router Deployment in
    Router mode (Ready waits for a ready router pod too: requests reach engines only through it)."""
    previous = previous or {}
    dep_status = deployment.get("status") or {}
    desired = spec.replicas
    replicas = dep_status.get("replicas", 0)
    ready = dep_status.get("readyReplicas", 0)
    updated = dep_status.get("updatedReplicas", 0)
    rolled_out = (dep_status.get("observedGeneration", 0) >= deployment["metadata"].get("generation", 0)
                  and updated == desired and replicas == desired)

    conditions = previous.get("conditions") or []
    conditions = set_condition(conditions, INVALID_SPEC, FALSE, "Valid", "The spec is valid.", now, generation)
    conditions = set_condition(conditions, CONFLICT, FALSE, "NoConflict",
                               "Every owned object is this InferenceService's own.", now, generation)
    if desired == 0:
        conditions = set_condition(conditions, READY, FALSE, "ScaledToZero", "spec.replicas is 0.", now, generation)
    elif ready >= desired and rolled_out and router is not None and not (router.get("status") or {}).get("readyReplicas"):
        conditions = set_condition(conditions, READY, FALSE, "RouterNotReady",
                                   f"{ready}/{desired} engine pods ready; no router pod ready yet.", now, generation)
    elif ready >= desired and rolled_out:
        conditions = set_condition(conditions, READY, TRUE, "AllReplicasReady",
                                   f"{ready}/{desired} engine pods ready.", now, generation)
    else:
        conditions = set_condition(conditions, READY, FALSE, "ReplicasNotReady",
                                   f"{ready}/{desired} engine pods ready.", now, generation)
    if rolled_out:
        conditions = set_condition(conditions, PROGRESSING, FALSE, "RolloutComplete",
                                   "The engine Deployment is rolled out.", now, generation)
    else:
        conditions = set_condition(conditions, PROGRESSING, TRUE, "RollingOut",
                                   f"{updated} of {desired} engine pods updated, {replicas} exist.", now, generation)
    stuck = _deployment_condition(deployment, "Progressing")
    failure = _deployment_condition(deployment, "ReplicaFailure")
    if stuck is not None and stuck.get("reason") == "ProgressDeadlineExceeded":
        conditions = set_condition(conditions, DEGRADED, TRUE, "ProgressDeadlineExceeded",
                                   stuck.get("message", ""), now, generation)
    elif failure is not None and failure.get("status") == TRUE:
        conditions = set_condition(conditions, DEGRADED, TRUE, failure.get("reason") or "ReplicaFailure",
                                   failure.get("message", ""), now, generation)
    else:
        conditions = set_condition(conditions, DEGRADED, FALSE, "AsExpected", "", now, generation)
    if routing is not None:
        conditions = set_condition(conditions, ROUTING_UNAVAILABLE, *routing, now, generation)
    conditions = ensure_condition(conditions, METRICS_AVAILABLE, "NotCollected",
                                  "The autoscaler has not read engine metrics yet.", now)
    conditions = ensure_condition(conditions, SCALING_LIMITED, "NotEvaluated",
                                  "The autoscaler has not decided yet.", now)
    return {
        "observedGeneration": generation,
        "replicas": replicas,
        "readyReplicas": ready,
        "desiredReplicas": previous.get("desiredReplicas") if spec.autoscaling_mode == "Builtin"
        and previous.get("desiredReplicas") is not None else desired,
        "effectiveMaxNumSeqs": max_num_seqs,
        "selector": selector_string(name),
        "conditions": conditions,
    }


def invalid_status(previous: dict | None, generation: int, field: str, message: str, now: datetime) -> dict[str, Any]:
    conditions = set_condition((previous or {}).get("conditions"), INVALID_SPEC, TRUE, "InvalidField",
                               f"{field}: {message}", now, generation)
    conditions = set_condition(conditions, DEGRADED, TRUE, INVALID_SPEC,
                               f"Not applied: {field}: {message}", now, generation)
    return {"observedGeneration": generation, "conditions": conditions}


def conflict_status(previous: dict | None, generation: int, message: str, now: datetime) -> dict[str, Any]:
    """An object of an owned object's name belongs to someone else: nothing was written."""
    conditions = set_condition((previous or {}).get("conditions"), CONFLICT, TRUE, "NameTaken", message, now,
                               generation)
    conditions = set_condition(conditions, DEGRADED, TRUE, CONFLICT, f"Not applied: {message}", now, generation)
    return {"observedGeneration": generation, "conditions": conditions}


def changed_fields(previous: dict | None, new: dict[str, Any]) -> dict[str, Any]:
    """The part of `new` that differs from `previous` (empty: nothing to write)."""
    previous = previous or {}
    return {k: v for k, v in new.items() if previous.get(k) != v}


def append_history(history: list[dict] | None, record: dict, limit: int = SCALING_HISTORY_LIMIT) -> list[dict]:
    """The autoscaler's scalingHistory: newest last, at most `limit` entries."""
    return (list(history or []) + [record])[-limit:]
