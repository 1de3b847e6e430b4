"""The autoscaler as a tick hook of the operator's per-InferenceService timer (handlers.py): after
each reconcile, list the engine pods, run one Autoscaler tick, and write what it decided through
the operator's own Kube client (spec.replicas, ConfigMap, status with 409 retries, Events)."""

from __future__ import annotations

import asyncio
import json

from iterserve.operator.autoscaling.actuator import OperatorMetrics
from iterserve.operator.autoscaling.loop import Autoscaler, admin_token_from_secret
from iterserve.operator.models import GROUP, PLURAL, VERSION
from iterserve.operator.resources import (
    ADMIN_TOKEN_KEY,
    ENGINE_PORT,
    Owner,
    build_configmap,
    secret_name,
    selector_string,
)


class AutoscalerHook:
    def __init__(self, prometheus_url: str | None = None, metrics: OperatorMetrics | None = None,
                 autoscaler: Autoscaler | None = None):
        self.autoscaler = autoscaler or Autoscaler(metrics=metrics, prometheus_url=prometheus_url)

    def __call__(self, ctx) -> None:
        spec, body = ctx.spec, ctx.body
        if spec.autoscaling is None or spec.autoscaling.mode == "Off":
            self.autoscaler.forget(ctx.namespace, ctx.name)
            return
        if not self.autoscaler.due(ctx.namespace, ctx.name, spec.autoscaling.interval_seconds):
            return
        kube = ctx.kube
        pods = json.loads(kube.core.list_namespaced_pod(
            ctx.namespace, label_selector=selector_string(ctx.name), _preload_content=False).data)["items"]
        token = admin_token_from_secret(kube.get("Secret", ctx.namespace, secret_name(ctx.name)), ADMIN_TOKEN_KEY)
        owner = Owner.from_body(body)

        def patch_replicas(replicas: int) -> None:
            kube.custom.patch_namespaced_custom_object(GROUP, VERSION, ctx.namespace, PLURAL, ctx.name,
                                                       {"spec": {"replicas": replicas}})

        def write_config(max_num_seqs: int) -> None:
            kube.apply(build_configmap(owner, spec, max_num_seqs))

        result = asyncio.run(self.autoscaler.tick(
            namespace=ctx.namespace, name=ctx.name, spec=spec, status=body.get("status"),
            replicas=spec.replicas, pods=pods, port=ENGINE_PORT, admin_token=token,
            patch_replicas=patch_replicas, write_config_max_num_seqs=write_config))

        ctx.reconciler.write_status(body, lambda previous: {**previous, **result.status})
        for event in result.events:
            try:
                kube.post_event(body, event.type, event.reason, event.message)
            except Exception as error:  # an Event is a courtesy; the status has the record
                ctx.logger.warning("could not post Event %s: %s", event.reason, error)
