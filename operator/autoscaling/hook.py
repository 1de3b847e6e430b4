"""The autoscaler as a tick hook of the operator's per-InferenceService resync (handlers.py): after
each reconcile, when a tick is due, find the InferenceService's own engine pods, run one
Autoscaler tick, and hand what it decided and did to the reconcile, which records it (status,
ConfigMap, Events). `forget` drops everything kept for an InferenceService that is gone."""

from __future__ import annotations

import asyncio
import logging

from iterserve.operator.autoscaling.loop import Autoscaler, admin_token_from_secret, trusted_pods
from iterserve.operator.metrics import OperatorMetrics
from iterserve.operator.resources import (
    ADMIN_TOKEN_KEY,
    ENGINE_PORT,
    Owner,
    controlled_by,
    deployment_name,
    secret_name,
    selector_string,
)

logger = logging.getLogger("iterserve.autoscaler")


class AutoscalerHook:
    def __init__(self, prometheus_url: str | None = None, metrics: OperatorMetrics | None = None,
                 autoscaler: Autoscaler | None = None):
        self.autoscaler = autoscaler or Autoscaler(metrics=metrics, prometheus_url=prometheus_url)
        self._strangers: dict[tuple[str, str], list[str]] = {}

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
        deployment = kube.get("Deployment", ctx.namespace, deployment_name(ctx.name))
        selector = selector_string(ctx.name)
        pods, strangers = trusted_pods(
            kube.list_pods(ctx.namespace, selector),
            deployment if deployment is not None and controlled_by(deployment, owner) else None,
            kube.list_replica_sets(ctx.namespace, selector))
        self._report_strangers(ctx.namespace, ctx.name, strangers)
        secret = kube.get("Secret", ctx.namespace, secret_name(ctx.name))
        token = admin_token_from_secret(secret, ADMIN_TOKEN_KEY) if secret and controlled_by(secret, owner) else None
        tick = asyncio.run(self.autoscaler.tick(
            namespace=ctx.namespace, name=ctx.name, spec=spec, replicas=spec.replicas, pods=pods,
            port=ENGINE_PORT, admin_token=token, kube=kube))
        ctx.reconciler.reconcile(ctx.namespace, ctx.name, tick=tick)

    def _report_strangers(self, namespace: str, name: str, strangers: list[str]) -> None:
        if self.autoscaler.metrics:
            self.autoscaler.metrics.record_untrusted(namespace, name, len(strangers))
        if strangers and strangers != self._strangers.get((namespace, name)):
            logger.warning("%s/%s: ignoring pods with the engine labels that are not its Deployment's: %s",
                           namespace, name, ", ".join(strangers))
        self._strangers[(namespace, name)] = strangers
