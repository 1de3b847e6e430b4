"""The autoscaler as a tick hook of the operator's per-InferenceService timer (handlers.py): after
each reconcile, when a tick is due, find the engine pods, run one Autoscaler tick, and hand what
it decided and did to the reconcile, which records it (status, ConfigMap, Events)."""

from __future__ import annotations

import asyncio

from iterserve.operator.autoscaling.loop import Autoscaler, admin_token_from_secret
from iterserve.operator.metrics import OperatorMetrics
from iterserve.operator.resources import ADMIN_TOKEN_KEY, ENGINE_PORT, secret_name, selector_string


class AutoscalerHook:
    def __init__(self, prometheus_url: str | None = None, metrics: OperatorMetrics | None = None,
                 autoscaler: Autoscaler | None = None):
        self.autoscaler = autoscaler or Autoscaler(metrics=metrics, prometheus_url=prometheus_url)

    def __call__(self, ctx) -> None:
        spec, kube = ctx.spec, ctx.kube
        if spec.autoscaling_mode == "Off":
            self.autoscaler.forget(ctx.namespace, ctx.name)
            return
        if not self.autoscaler.due(ctx.namespace, ctx.name, spec.autoscaling.interval_seconds):
            return
        pods = kube.list_pods(ctx.namespace, selector_string(ctx.name))
        token = admin_token_from_secret(kube.get("Secret", ctx.namespace, secret_name(ctx.name)), ADMIN_TOKEN_KEY)
        tick = asyncio.run(self.autoscaler.tick(
            namespace=ctx.namespace, name=ctx.name, spec=spec, replicas=spec.replicas, pods=pods,
            port=ENGINE_PORT, admin_token=token, kube=kube))
        ctx.reconciler.reconcile(ctx.namespace, ctx.name, tick=tick)
