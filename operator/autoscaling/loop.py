"""One autoscaler tick for one InferenceService: read its engine pods' metrics, decide for each of
its pools (policy.decide, once per pool), carry out the decisions, and hand back what happened. Plugged into the operator as a tick hook of its
per-InferenceService timer (operator/autoscaling/hook.py).

The tick's effects, in full: `PATCH /admin/config` on engines whose max_num_seqs changes (the
admin client, engine_admin.py: its only write to pods), and each pool's replicas in Builtin mode
(spec.replicas, spec.disaggregation.prefill.replicas, through operator/kube.py). Everything else it leaves to the reconcile, as an `AutoscalerTick`
(report.py): status, the ConfigMap new pods start from, and the Events.

Memory (recent samples, proposals, scale events, per-pod max_num_seqs) lives in this process,
one entry per pool of each InferenceService; see memory.py for why losing it on restart is safe.
In SLO mode each InferenceService also keeps its online step profile (step_feed.py), fed each
tick from its warm decode pods' step records; lost on restart, it starts again from the given one.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime

from iterserve import controller_chain
from iterserve.operator.autoscaling import memory as mem
from iterserve.operator.autoscaling.engine_admin import EngineAdmin, apply_seqs_changes
from iterserve.operator.autoscaling.metrics_source import (
    PodEndpoint,
    PrometheusSource,
    ScrapeSource,
)
from iterserve.operator.autoscaling.policy import PodSample, decide
from iterserve.operator.autoscaling.report import (
    AutoscalerTick,
    PoolTick,
    Record,
    average_prompt,
    seqs_by_pod,
    start_max_num_seqs,
)
from iterserve.operator.autoscaling.router_source import read_held_requests
from iterserve.operator.autoscaling.settings import (
    DECODE,
    PREFILL,
    Pool,
    Settings,
    settings_from_spec,
)
from iterserve.operator.autoscaling.step_feed import (
    StepFeed,
    StepSource,
    fingerprint,
    with_online_profile,
)
from iterserve.operator.kube import Kube
from iterserve.operator.metrics import OperatorMetrics
from iterserve.replica_model.online import OnlineProfile

logger = logging.getLogger("iterserve.autoscaler")


def _epoch(stamp: str | None) -> float | None:
    if not stamp:
        return None
    return datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC).timestamp()


REVISION_ANNOTATION = "deployment.kubernetes.io/revision"
TEMPLATE_HASH_LABEL = "pod-template-hash"


def _controller_uid(obj: dict) -> str | None:
    return next((r.get("uid") for r in obj["metadata"].get("ownerReferences") or [] if r.get("controller")), None)


def trusted_pods(pods: Sequence[dict], deployment: dict | None,
                 replica_sets: Sequence[dict]) -> tuple[list[dict], list[str]]:
    """The pods of the Deployment's current ReplicaSet (owned through it, same pod-template-hash),
    and the names of the other pods that carry the engine labels. Labels alone prove nothing:
    anyone who may create pods in the namespace can copy them, and such a pod must neither steer
    the replica count nor receive the admin token. Pods of an older revision are left out too
    (not counted as look-alikes): they are on their way out."""
    if deployment is None:
        return [], []
    revision = (deployment["metadata"].get("annotations") or {}).get(REVISION_ANNOTATION)
    ours = [rs for rs in replica_sets if _controller_uid(rs) == deployment["metadata"]["uid"]]
    current = next((rs for rs in ours if revision is not None
                    and (rs["metadata"].get("annotations") or {}).get(REVISION_ANNOTATION) == revision), None)
    by_uid = {rs["metadata"]["uid"]: rs for rs in ours}
    trusted, strangers = [], []
    for pod in pods:
        # The chain check (iterserve/controller_chain.py): owner, hash, creation time, and the template run.
        if controller_chain.check_pod(pod, by_uid) is not None:
            strangers.append(pod["metadata"]["name"])
        elif by_uid.get(_controller_uid(pod)) is current:
            trusted.append(pod)
    return trusted, strangers


def engine_pods(pods: Sequence[dict], port: int) -> tuple[list[mem.PodInfo], dict[str, str]]:
    """Live engine pods (not terminating, not finished) and the base URL of each one with an IP."""
    infos, urls = [], {}
    for pod in pods:
        meta, status = pod["metadata"], pod.get("status") or {}
        if meta.get("deletionTimestamp") or status.get("phase") in ("Succeeded", "Failed"):
            continue
        ready = next((c for c in status.get("conditions") or [] if c.get("type") == "Ready"), None)
        ready_at = _epoch(ready.get("lastTransitionTime")) if ready and ready.get("status") == "True" else None
        infos.append(mem.PodInfo(meta["name"], _epoch(meta.get("creationTimestamp")) or 0.0, ready_at))
        if status.get("podIP"):
            urls[meta["name"]] = f"http://{status['podIP']}:{port}"
    return infos, urls


@dataclass(frozen=True)
class PoolPods:
    """One pool as the tick finds it: its replicas now and its trusted pods (hook.py)."""

    replicas: int
    pods: Sequence[dict]


def _scaler(kube: Kube, pool: Pool) -> Callable[[str, str, int], object]:
    """The one spec write that sets the pool's replicas (`pool.replicas_field`)."""
    return kube.scale_prefill_pool if pool.role == PREFILL else kube.scale_inference_service


class Autoscaler:
    """Keeps one Memory per pool of each InferenceService and runs ticks. Thread-safe per object."""

    def __init__(self, metrics: OperatorMetrics | None = None, prometheus_url: str | None = None,
                 clock: Callable[[], float] = time.time, scrape_timeout: float = 2.0):
        self.metrics = metrics
        self.prometheus_url = prometheus_url
        self.clock = clock
        self.scrape_timeout = scrape_timeout
        self._memories: dict[tuple[str, str, str], mem.Memory] = {}  # (namespace, name, pool role)
        self._step_feeds: dict[tuple[str, str], StepFeed] = {}  # SLO mode's online step profile
        self._last_tick: dict[tuple[str, str], float] = {}
        self._guard = threading.Lock()

    def source_for(self, spec, namespace: str):
        if spec.autoscaling is not None and spec.autoscaling.metrics_source == "prometheus":
            if not self.prometheus_url:
                return _Unconfigured("metricsSource is prometheus but the operator has no Prometheus URL "
                                     "(start it with --prometheus-url)", self.clock)
            return PrometheusSource(self.prometheus_url, selector=f'namespace="{namespace}"',
                                    timeout=self.scrape_timeout, clock=self.clock)
        return ScrapeSource(timeout=self.scrape_timeout, clock=self.clock)

    def due(self, namespace: str, name: str, interval: float) -> bool:
        """Ticks at most every `interval` seconds (the timer may fire more often)."""
        last = self._last_tick.get((namespace, name))
        return last is None or self.clock() - last >= interval - 0.5

    def forget(self, namespace: str, name: str) -> None:
        with self._guard:
            for key in [k for k in self._memories if k[:2] == (namespace, name)]:
                del self._memories[key]
            self._last_tick.pop((namespace, name), None)
            self._step_feeds.pop((namespace, name), None)
        if self.metrics:
            self.metrics.forget(namespace, name)

    async def tick(self, *, namespace: str, name: str, spec, pools: Mapping[str, PoolPods], port: int,
                   admin_token: str | None, kube: Kube, router_urls: Sequence[str] = ()) -> AutoscalerTick:
        """Reads every pool's pods at once, then decides and acts for each pool the spec has
        (`settings.pools()`, the decode pool first) that `pools` names: engines' max_num_seqs
        through their admin API and, in Builtin mode, the pool's replicas through `kube`
        (blocking calls, run in a thread)."""
        if DECODE not in pools:
            raise ValueError("tick needs the decode pool's pods (pools[DECODE]): its decision is the one status shows")
        settings = settings_from_spec(spec)
        started = self.clock()
        self._last_tick[(namespace, name)] = started
        found = [(pool, pools[pool.role], *engine_pods(pools[pool.role].pods, port))
                 for pool in settings.pools() if pool.role in pools]
        readable = [PodEndpoint(p.name, urls[p.name]) for _, _, infos, urls in found for p in infos
                    if p.ready_at is not None and p.name in urls]
        feed = self._step_feed(namespace, name, spec, settings)
        read, held, _ = await asyncio.gather(
            self.source_for(spec, namespace).read(readable) if readable else _nothing(),
            read_held_requests(router_urls, self.scrape_timeout),
            feed.read(EngineAdmin(admin_token, self.scrape_timeout), _step_sources(found[0], settings), self.clock)
            if feed is not None else _nothing())
        if feed is not None:
            if feed.errors:
                logger.info("%s/%s: step records not read this tick: %s", namespace, name,
                            "; ".join(f"{pod}: {error}" for pod, error in sorted(feed.errors.items())))
            settings = with_online_profile(settings, feed.online)
        now = self.clock()
        ticks, samples_by_pool = [], []
        for pool, at, infos, urls in found:
            names = {p.name for p in infos}
            samples = [s for s in read if s.pod in names]
            ticks.append(await self._tick_pool(namespace, name, settings, pool, at.replicas, infos, urls, samples,
                                               admin_token, kube, started, now, named=len(found) > 1,
                                               held=held if pool.role == DECODE else None))
            samples_by_pool.append(samples)
        main, samples = ticks[0], samples_by_pool[0]
        if self.metrics:
            self.metrics.record(namespace, name, settings, main.decision, sum(1 for s in samples if not s.ok),
                                seqs_by_pod(main.decision, main.record.seqs.applied))
        return AutoscalerTick(settings, main.decision, main.record, datetime.fromtimestamp(now, UTC),
                              start_max_num_seqs(main.decision, main.record, settings), average_prompt(samples),
                              tuple(ticks[1:]))

    def _step_feed(self, namespace: str, name: str, spec, settings: Settings) -> StepFeed | None:
        """The InferenceService's online step profile, when SLO mode plans (Builtin) and fits one (a
        new one when what the steps describe changed); None otherwise."""
        if settings.slo is None or not settings.slo.fit_online or settings.mode != "Builtin":
            self._step_feeds.pop((namespace, name), None)
            return None
        key, prints = (namespace, name), fingerprint(spec)
        feed = self._step_feeds.get(key)
        if feed is None or feed.fingerprint != prints:
            feed = self._step_feeds[key] = StepFeed(OnlineProfile(settings.slo.profile), prints)
        return feed

    async def _tick_pool(self, namespace: str, name: str, settings: Settings, pool: Pool, replicas: int,
                         infos: list[mem.PodInfo], urls: dict[str, str], samples: list[PodSample],
                         admin_token: str | None, kube: Kube, started: float, now: float,
                         named: bool, held: float | None = None) -> PoolTick:
        """One pool's part of a tick: its memory, its decision, its replica and max_num_seqs changes."""
        key = (namespace, name, pool.role)
        memory = self._memories.get(key) or mem.fresh_memory(replicas, started)
        memory = mem.record_samples(memory, samples, [p.name for p in infos], settings, now)
        state = replace(mem.state_for(memory, replicas, infos), held_requests=held)
        decision = decide(settings, state, memory.history, now, pool.role)
        record = Record()
        if settings.mode == "Builtin" and decision.replicas_changed:
            try:
                await asyncio.to_thread(_scaler(kube, pool), namespace, name, decision.desired_replicas)
                record.replicas_applied = True
            except Exception as error:  # reported as a Warning Event; the next tick retries
                record.replicas_error = f"{type(error).__name__}: {error}"
        if decision.seqs_changes:
            record.seqs = await apply_seqs_changes(EngineAdmin(admin_token), decision.seqs_changes, urls)
        self._memories[key] = mem.record_decision(memory, decision, settings, now, record.replicas_applied,
                                                  record.seqs.applied)
        if decision.replicas_changed or record.seqs.applied or record.seqs.failed:
            logger.info("%s/%s: %s%s", namespace, name, f"{pool.role} pool: " if named else "", decision.message)
        return PoolTick(decision, record)


async def _nothing() -> list:
    return []


def _step_sources(found, settings: Settings) -> list[StepSource]:
    """The decode pool's ready pods the step feed may read, each with the end of its warm-up."""
    pool, _, infos, urls = found
    return [StepSource(p.name, urls[p.name], p.ready_at + settings.warmup_seconds) for p in infos
            if pool.role == DECODE and p.ready_at is not None and p.name in urls]


class _Unconfigured:
    """A source that cannot work, saying why for every pod (so the status shows it)."""

    def __init__(self, reason: str, clock: Callable[[], float]):
        self.reason = reason
        self.clock = clock

    async def read(self, pods: Sequence[PodEndpoint]) -> list[PodSample]:
        return [PodSample(p.name, self.clock(), error=self.reason) for p in pods]


def admin_token_from_secret(secret: dict | None, key: str) -> str | None:
    if not secret:
        return None
    if (secret.get("stringData") or {}).get(key):
        return secret["stringData"][key]
    raw = (secret.get("data") or {}).get(key)
    return base64.b64decode(raw).decode() if raw else None
