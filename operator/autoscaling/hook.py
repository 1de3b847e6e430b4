"""The autoscaler as a tick hook of the operator's per-InferenceService resync (handlers.py): after
each reconcile, when a tick is due, find the InferenceService's own engine pods, run one
Autoscaler tick, and hand what it decided and did to the reconcile, which records it (status,
ConfigMap, Events). `forget` drops everything kept for an InferenceService that is gone."""

from __future__ import annotations

import asyncio
import logging

from iterserve import controller_chain
from iterserve.labels import DECODE, PREFILL, ROLE_LABEL, is_leader, selector_string
from iterserve.operator import groups
from iterserve.operator.autoscaling.loop import (
    Autoscaler,
    PoolPods,
    admin_token_from_secret,
    trusted_pods,
)
from iterserve.operator.disaggregation import prefill_name
from iterserve.operator.metrics import OperatorMetrics
from iterserve.operator.resources import (
    ADMIN_TOKEN_KEY,
    ENGINE_PORT,
    Owner,
    controlled_by,
    deployment_name,
    secret_name,
)
from iterserve.operator.routing import ROUTER, ROUTER_PORT, router_labels, router_name

logger = logging.getLogger("iterserve.autoscaler")

# One tick's whole budget: scrapes and step-record reads (2 s each, concurrent) + admin calls
# (5 s each, concurrent) + a scale patch, with room to spare. Past it the tick is dropped and the
# reconcile runs without it, so no tenant's pod can hold the operator's timer for its InferenceService.
TICK_DEADLINE_S = 20.0


class AutoscalerHook:
    def __init__(self, prometheus_url: str | None = None, metrics: OperatorMetrics | None = None,
                 autoscaler: Autoscaler | None = None):
        self.autoscaler = autoscaler or Autoscaler(metrics=metrics, prometheus_url=prometheus_url)
        self._strangers: dict[tuple[str, str], list[str]] = {}
        self.tick_deadline_s = TICK_DEADLINE_S

    def forget(self, namespace: str, name: str) -> None:
        self.autoscaler.forget(namespace, name)
        self._strangers.pop((namespace, name), None)

    def __call__(self, ctx) -> None:
        spec, kube = ctx.spec, ctx.kube
        if spec.autoscaling_mode == "Off":
            self.forget(ctx.namespace, ctx.name)
            return
        if not self.autoscaler.due(ctx.namespace, ctx.name, spec.autoscaling.interval_seconds):
            return
        owner = Owner.from_body(ctx.body)
        pools = self._pools(kube, ctx.namespace, ctx.name, spec, owner)
        secret = kube.get("Secret", ctx.namespace, secret_name(ctx.name))
        token = admin_token_from_secret(secret, ADMIN_TOKEN_KEY) if secret and controlled_by(secret, owner) else None
        routers = self._router_urls(kube, ctx.namespace, ctx.name, spec, owner)
        try:
            tick = asyncio.run(asyncio.wait_for(self.autoscaler.tick(
                namespace=ctx.namespace, name=ctx.name, spec=spec, pools=pools, port=ENGINE_PORT,
                admin_token=token, kube=kube, router_urls=routers), self.tick_deadline_s))
        except TimeoutError:
            logger.warning("%s/%s: autoscaler tick dropped: not done within %g s", ctx.namespace, ctx.name,
                           self.tick_deadline_s)
            tick = None
        ctx.reconciler.reconcile(ctx.namespace, ctx.name, tick=tick)

    def _pools(self, kube, namespace: str, name: str, spec, owner: Owner) -> dict[str, PoolPods]:
        """Each pool's replicas and trusted pods. Pods split by the role label: the engine
        Deployment is the decode pool, NAME-prefill the prefill pool; each pool's pods are trusted
        only through their own Deployment."""
        selector = selector_string(name)
        disaggregated = spec.disaggregation.enabled
        if groups.is_group(spec):
            leaders = self._group_leaders(kube, namespace, name, owner, selector)
            pools = {DECODE: PoolPods(spec.replicas, [p for p in leaders if _role(p) != PREFILL])}
            if disaggregated:
                pools[PREFILL] = PoolPods(spec.disaggregation.prefill.wanted_replicas,
                                          [p for p in leaders if _role(p) == PREFILL])
            return pools
        listed, replica_sets = kube.list_pods(namespace, selector), kube.list_replica_sets(namespace, selector)
        pods, strangers = self._trusted(kube, namespace, deployment_name(name), owner,
                                        [p for p in listed if not disaggregated or _role(p) != PREFILL], replica_sets)
        pools = {DECODE: PoolPods(spec.replicas, pods)}
        if disaggregated:
            prefill_pods, more = self._trusted(kube, namespace, prefill_name(name), owner,
                                               [p for p in listed if _role(p) == PREFILL], replica_sets)
            pools[PREFILL] = PoolPods(spec.disaggregation.prefill.wanted_replicas, prefill_pods)
            strangers += more
        self._report_strangers(namespace, name, strangers)
        return pools

    def _group_leaders(self, kube, namespace: str, name: str, owner: Owner, selector: str) -> list[dict]:
        """Multi-node groups: the leaders (index 0) of the InferenceService's StatefulSets (both
        pools' when disaggregated), each verified through its StatefulSet and ControllerRevision; a
        group is one replica, and its metrics and max_num_seqs are its leader's."""
        listed = kube.list_stateful_sets(namespace, selector)
        sets_by_uid = {}
        for base in (name, prefill_name(name)):  # each pool's LeaderWorkerSet, where there is one
            lws = kube.get(groups.LEADER_WORKER_SET, namespace, base)
            for sts in controller_chain.stateful_sets_owned(listed, name, owner.uid, lws):
                sets_by_uid[sts["metadata"]["uid"]] = sts
        sets = list(sets_by_uid.values())
        pods = kube.list_pods(namespace, selector)
        verified, refused = controller_chain.verify(pods, [], [], sets, kube.list_controller_revisions(namespace, selector)
                                                    if sets else [])
        self._report_strangers(namespace, name, [r.pod for r in refused])
        return [p for p in verified if is_leader(p)]

    def _router_urls(self, kube, namespace: str, name: str, spec, owner: Owner) -> list[str]:
        """The trusted router pods' URLs, when the pool may be at zero (minReplicas 0 in Router mode):
        their held-request count is the signal that brings it back (router_source.py)."""
        if spec.autoscaling is None or spec.autoscaling.min_replicas != 0 or spec.routing.mode != ROUTER:
            return []
        selector = ",".join(f"{k}={v}" for k, v in router_labels(name).items())
        pods, _ = self._trusted(kube, namespace, router_name(name), owner, kube.list_pods(namespace, selector),
                                kube.list_replica_sets(namespace, selector))
        return [f"http://{p['status']['podIP']}:{ROUTER_PORT}" for p in pods
                if (p.get("status") or {}).get("podIP") and not p["metadata"].get("deletionTimestamp")]

    @staticmethod
    def _trusted(kube, namespace: str, deployment: str, owner: Owner, pods: list[dict],
                 replica_sets: list[dict]) -> tuple[list[dict], list[str]]:
        live = kube.get("Deployment", namespace, deployment)
        return trusted_pods(pods, live if live is not None and controlled_by(live, owner) else None, replica_sets)

    def _report_strangers(self, namespace: str, name: str, strangers: list[str]) -> None:
        if self.autoscaler.metrics:
            self.autoscaler.metrics.record_untrusted(namespace, name, len(strangers))
        if strangers and strangers != self._strangers.get((namespace, name)):
            logger.warning("%s/%s: ignoring pods with the engine labels that are not its Deployment's: %s",
                           namespace, name, ", ".join(strangers))
        self._strangers[(namespace, name)] = strangers


def _role(pod: dict) -> str | None:
    return (pod["metadata"].get("labels") or {}).get(ROLE_LABEL)
