"""Carries out a Decision: spec.replicas (Builtin mode only; External never writes it), each
engine's max_num_seqs through its admin API, the tuned value into the ConfigMap so new pods start
with it, and the record of it all: status fields, scalingHistory, Events and the operator's own
Prometheus metrics.

The Kubernetes writes go through `KubeWriter` (the official client, blocking: call it from a
thread); the status patch and the Events are returned as data, for the caller (a kopf handler)
to apply, so the pure parts are testable without an API server.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime

import httpx
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge

from iterserve.engine import metrics as names
from iterserve.operator import status as status_rules
from iterserve.operator.autoscaling.policy import Decision, SeqsChange, Settings

# ------------------------------------------------------------------------- operator metrics


class OperatorMetrics:
    """The autoscaler's series, labelled like the engine's so alerts can join them."""

    def __init__(self, registry: CollectorRegistry = REGISTRY):
        labels = ["namespace", "inferenceservice"]
        self.desired_replicas = Gauge(names.AUTOSCALER_DESIRED_REPLICAS,
                                      "Replicas the autoscaler wants", labels, registry=registry)
        self.max_replicas = Gauge(names.AUTOSCALER_MAX_REPLICAS,
                                  "spec.autoscaling.maxReplicas", labels, registry=registry)
        self.decisions = Counter(names.AUTOSCALER_DECISIONS_TOTAL, "Autoscaler decisions",
                                 labels + ["direction", "reason"], registry=registry)
        self.scrape_errors = Counter(names.METRICS_SCRAPE_ERRORS_TOTAL,
                                     "Engine pods whose metrics could not be read", labels, registry=registry)
        self.effective_max_num_seqs = Gauge(names.EFFECTIVE_MAX_NUM_SEQS,
                                            "max_num_seqs in effect on each engine pod",
                                            labels + ["pod"], registry=registry)
        self._pods: dict[tuple[str, str], set[str]] = {}

    def record(self, namespace: str, name: str, settings: Settings, decision: Decision,
               scrape_errors: int, seqs_by_pod: dict[str, int]) -> None:
        self.desired_replicas.labels(namespace, name).set(decision.desired_replicas)
        self.max_replicas.labels(namespace, name).set(settings.max_replicas)
        self.decisions.labels(namespace, name, decision.direction, decision.reason).inc()
        if scrape_errors:
            self.scrape_errors.labels(namespace, name).inc(scrape_errors)
        for pod, value in seqs_by_pod.items():
            self.effective_max_num_seqs.labels(namespace, name, pod).set(value)
        for gone in self._pods.get((namespace, name), set()) - set(seqs_by_pod):
            self.effective_max_num_seqs.remove(namespace, name, gone)
        self._pods[(namespace, name)] = set(seqs_by_pod)

    def forget(self, namespace: str, name: str) -> None:
        for gauge in (self.desired_replicas, self.max_replicas):
            try:
                gauge.remove(namespace, name)
            except KeyError:
                pass
        for pod in self._pods.pop((namespace, name), set()):
            self.effective_max_num_seqs.remove(namespace, name, pod)


# ------------------------------------------------------------------------------ engine admin


class AdminError(RuntimeError):
    pass


class EngineAdmin:
    """PATCH /admin/config on one engine, with the admin token."""

    def __init__(self, token: str | None, timeout: float = 5.0):
        self.token = token
        self.timeout = timeout

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    async def set_max_num_seqs(self, url: str, value: int) -> int:
        """Returns the value the engine reports back; raises AdminError with the engine's reason."""
        try:
            async with httpx.AsyncClient(timeout=self.timeout) as client:
                response = await client.patch(f"{url.rstrip('/')}/admin/config", json={"max_num_seqs": value},
                                              headers=self._headers())
        except httpx.HTTPError as error:
            raise AdminError(f"{url}/admin/config: {type(error).__name__}: {error}") from None
        if response.status_code != 200:
            try:
                message = response.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = response.text[:200]
            raise AdminError(f"{url}/admin/config: HTTP {response.status_code}: {message}")
        return int(response.json()["max_num_seqs"])

    async def get_max_num_seqs(self, url: str) -> int:
        async with httpx.AsyncClient(timeout=self.timeout) as client:
            response = await client.get(f"{url.rstrip('/')}/admin/config", headers=self._headers())
        response.raise_for_status()
        return int(response.json()["max_num_seqs"])


@dataclass(frozen=True)
class SeqsOutcome:
    applied: tuple[SeqsChange, ...]
    failed: tuple[tuple[SeqsChange, str], ...]


async def apply_seqs_changes(admin: EngineAdmin, changes: Sequence[SeqsChange], urls: dict[str, str]) -> SeqsOutcome:
    """Applies each change to its pod's engine, concurrently; a failure on one pod never stops the others."""
    async def one(change: SeqsChange):
        url = urls.get(change.pod)
        if url is None:
            return change, "pod has no address"
        try:
            await admin.set_max_num_seqs(url, change.to_max_num_seqs)
        except AdminError as error:
            return change, str(error)
        return change, None

    results = await asyncio.gather(*(one(c) for c in changes))
    return SeqsOutcome(tuple(c for c, e in results if e is None), tuple((c, e) for c, e in results if e is not None))


# ------------------------------------------------------------------------------- Kubernetes


class KubeWriter:
    """The two objects the autoscaler writes besides status: spec.replicas and the ConfigMap."""

    def __init__(self, api_client):
        from kubernetes import client

        self.custom = client.CustomObjectsApi(api_client)
        self.core = client.CoreV1Api(api_client)

    def patch_replicas(self, namespace: str, name: str, replicas: int) -> None:
        from iterserve.operator.models import GROUP, PLURAL, VERSION

        self.custom.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name,
                                                   {"spec": {"replicas": replicas}})

    def patch_configmap_max_num_seqs(self, namespace: str, configmap: str, value: int) -> None:
        from iterserve.operator.resources import MAX_NUM_SEQS_KEY

        self.core.patch_namespaced_config_map(configmap, namespace, {"data": {MAX_NUM_SEQS_KEY: str(value)}})


def config_max_num_seqs(decision: Decision, applied: Sequence[SeqsChange], spec_max_num_seqs: int) -> int:
    """The value new pods should start with: the lowest now in effect on a live pod."""
    seqs = seqs_by_pod(decision, applied)
    return min(seqs.values()) if seqs else spec_max_num_seqs


def seqs_by_pod(decision: Decision, applied: Sequence[SeqsChange]) -> dict[str, int]:
    seqs = {p.pod: p.max_num_seqs for p in decision.pods if p.max_num_seqs is not None}
    seqs.update({c.pod: c.to_max_num_seqs for c in applied})
    return seqs


# ------------------------------------------------------------------------- status and events


@dataclass(frozen=True)
class Event:
    type: str  # Normal | Warning
    reason: str
    message: str


@dataclass
class Record:
    """What a tick changed, for status and Events."""

    replicas_applied: bool = False
    seqs: SeqsOutcome = field(default_factory=lambda: SeqsOutcome((), ()))
    replicas_error: str | None = None


def events_for(decision: Decision, record: Record) -> list[Event]:
    events = []
    if record.replicas_applied:
        action = "ScaleUp" if decision.direction == "up" else "ScaleDown"
        events.append(Event("Normal", action, f"{decision.reason}: {decision.message}"))
    if record.replicas_error:
        events.append(Event("Warning", "ScaleFailed", f"could not set spec.replicas to "
                                                      f"{decision.desired_replicas}: {record.replicas_error}"))
    for change in record.seqs.applied:
        action = "RetuneDown" if change.to_max_num_seqs < change.from_max_num_seqs else "RetuneUp"
        events.append(Event("Normal", action, f"pod {change.pod}: {change.reason}: {change.message}"))
    for change, error in record.seqs.failed:
        events.append(Event("Warning", "RetuneFailed",
                            f"pod {change.pod}: max_num_seqs {change.from_max_num_seqs} -> "
                            f"{change.to_max_num_seqs} not applied: {error}"))
    return events


def _history_records(decision: Decision, record: Record, now: datetime) -> list[dict]:
    stamp = status_rules.timestamp(now)
    out = []
    if record.replicas_applied:
        out.append({"time": stamp, "action": "ScaleUp" if decision.direction == "up" else "ScaleDown",
                    "reason": decision.reason, "message": decision.message[:1000],
                    "fromReplicas": decision.current_replicas, "toReplicas": decision.desired_replicas})
    for change in record.seqs.applied:
        out.append({"time": stamp,
                    "action": "RetuneDown" if change.to_max_num_seqs < change.from_max_num_seqs else "RetuneUp",
                    "reason": change.reason, "message": change.message[:1000], "pod": change.pod,
                    "fromMaxNumSeqs": change.from_max_num_seqs, "toMaxNumSeqs": change.to_max_num_seqs})
    return out


def status_patch(previous: dict | None, settings: Settings, decision: Decision, record: Record,
                 effective_max_num_seqs: int, now: datetime) -> dict:
    """The status fields the autoscaler owns, as a merge patch for the status subresource."""
    previous = previous or {}
    conditions = previous.get("conditions") or []
    metrics = decision.metrics
    conditions = status_rules.set_condition(conditions, "MetricsAvailable",
                                            "True" if metrics.available else "False",
                                            metrics.reason or "Unknown", metrics.message, now)
    if decision.scaling_limited:
        conditions = status_rules.set_condition(conditions, "ScalingLimited", "True",
                                                decision.limited_reason or "Limited", decision.limited_message, now)
    else:
        conditions = status_rules.set_condition(conditions, "ScalingLimited", "False", "DesiredWithinRange",
                                                f"desired {decision.desired_replicas} within "
                                                f"[{settings.min_replicas}, {settings.max_replicas}]", now)
    patch: dict = {"conditions": conditions}
    if settings.mode == "Builtin":  # in External mode the reconcile keeps both at the spec's values
        patch["desiredReplicas"] = decision.desired_replicas
        patch["effectiveMaxNumSeqs"] = effective_max_num_seqs
    history = previous.get("scalingHistory") or []
    for entry in _history_records(decision, record, now):
        history = status_rules.append_history(history, entry)
    if history != (previous.get("scalingHistory") or []):
        patch["scalingHistory"] = history
    if record.replicas_applied:
        patch["lastScaleTime"] = status_rules.timestamp(now)
    measured = [p for p in decision.pods if p.state == "measured"]
    patch["waitingRequests"] = int(sum(p.waiting for p in measured)) if measured else None
    patch["kvCacheUsage"] = round(max(p.kv_usage for p in measured), 4) if measured else None
    patch["pods"] = [_pod_summary(p) for p in decision.pods]
    return patch


def _pod_summary(signal) -> dict:
    summary = {"name": signal.pod, "ready": True}
    if signal.state == "measured":
        summary.update(waitingRequests=int(signal.waiting), runningSeqs=int(signal.running),
                       kvCacheUsage=round(signal.kv_usage, 4), maxNumSeqs=signal.max_num_seqs)
        if signal.preemptions_per_minute is not None:
            summary["preemptionsPerMinute"] = round(signal.preemptions_per_minute, 3)
    return summary
