"""kopf wiring: which events lead to a reconcile. All real work is in reconcile.py.

- InferenceService created, updated, or found at operator start (resume) -> reconcile it.
- An owned Deployment, StatefulSet, Service or ConfigMap changed or deleted -> reconcile its owner (drift is
  repaired, a deleted object recreated, status follows the Deployment).
- A resync per InferenceService (every `resync_seconds`) -> reconcile, then the tick hooks: the
  seam where the autoscaler plugs in its decision loop (it hands its decisions back to
  `reconciler.reconcile(..., tick=)`, the one writer of status and the owned objects).
- An InferenceService deleted -> its resync stops and the reconciler and hooks forget it (locks,
  autoscaler memory, metric series).

No finalizer: nothing has to happen before an InferenceService goes (the owned objects carry
owner references, so Kubernetes' garbage collector deletes them), and a finalizer would make
deleting it, or its namespace, hang whenever the operator is not running. That is why the
resync is a task of our own and not a kopf timer (kopf timers always add a finalizer).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import kopf
from kubernetes.client.exceptions import ApiException

from iterserve.operator.kube import Kube
from iterserve.operator.models import GROUP, KIND, PLURAL, VERSION, InferenceServiceSpec
from iterserve.operator.reconcile import Outcome, Reconciler
from iterserve.operator.resources import MANAGED_BY

FINALIZER = f"{GROUP}/finalizer"  # never added now; kopf removes it from objects of older versions
OWNED = (("apps", "v1", "deployments"), ("apps", "v1", "statefulsets"), ("", "v1", "services"),
         ("", "v1", "configmaps"))
RETRY_DELAY_SECONDS = 2.0


@dataclass
class TickContext:
    """What a tick hook gets: the freshly reconciled object and the means to act on it."""

    namespace: str
    name: str
    body: dict
    spec: InferenceServiceSpec
    reconciler: Reconciler  # reconcile(namespace, name, tick=...) records what a hook decided
    kube: Kube
    logger: logging.Logger | logging.LoggerAdapter


class TickHook(Protocol):
    def __call__(self, context: TickContext) -> None: ...

    def forget(self, namespace: str, name: str) -> None: ...


def configure_settings(settings: kopf.OperatorSettings) -> None:
    """kopf keeps its bookkeeping in annotations under iterserve.dev (status is the CRD's own,
    structural and pruned), and posts only warnings as Events: the reconcile posts its own."""
    # No watching of CRDs and namespaces (that would need cluster-wide list/watch on both): the
    # CRD must exist when the operator starts, and namespaces are named, not globbed.
    settings.scanning.disabled = True
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration")
    settings.posting.level = logging.WARNING
    settings.posting.reporting_component = f"{GROUP}/operator"
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330


def _owner_name(body: Any) -> str | None:
    for ref in body.get("metadata", {}).get("ownerReferences") or []:
        if ref.get("kind") == KIND and ref.get("apiVersion", "").startswith(f"{GROUP}/") and ref.get("controller"):
            return ref.get("name")
    return None


def _retryable(exc: ApiException) -> bool:
    return exc.status in (409, 429) or exc.status >= 500 or exc.status == 0


class _Resyncs:
    """One resync task per InferenceService: reconcile every `every_s`, then the tick hooks;
    started by the object's first event, stopped (and its state forgotten) when it is deleted."""

    def __init__(self, reconciler: Reconciler, hooks: Sequence[TickHook], every_s: float):
        self.reconciler, self.hooks, self.every_s = reconciler, hooks, every_s
        self.tasks: dict[tuple[str, str], asyncio.Task] = {}

    def reconcile(self, namespace: str, name: str, logger) -> Outcome:
        try:
            outcome = self.reconciler.reconcile(namespace, name)
        except ApiException as exc:
            if _retryable(exc):
                raise kopf.TemporaryError(f"API error {exc.status} {exc.reason}; retrying",
                                          delay=RETRY_DELAY_SECONDS) from exc
            raise
        for change in outcome.changes:
            logger.info(change)
        return outcome

    def track(self, namespace: str, name: str, logger) -> None:
        if (namespace, name) not in self.tasks:
            self.tasks[(namespace, name)] = asyncio.create_task(self._forever(namespace, name, logger))

    def forget(self, namespace: str, name: str) -> None:
        task = self.tasks.pop((namespace, name), None)
        if task is not None and task is not asyncio.current_task():
            task.cancel()
        self._drop_state(namespace, name)

    def stop(self) -> None:
        for task in self.tasks.values():
            task.cancel()
        self.tasks.clear()

    def _once(self, namespace: str, name: str, logger) -> bool:
        """One resync; False when the object is gone (nothing more to do for it)."""
        outcome = self.reconcile(namespace, name, logger)
        if outcome.result == "gone":  # deleted, or being deleted (then kept until it is gone)
            return self.reconciler.kube.get_inference_service(namespace, name) is not None
        if outcome.result not in ("applied", "unchanged") or not self.hooks:
            return True
        context = TickContext(namespace, name, outcome.body, outcome.spec, self.reconciler,
                              self.reconciler.kube, logger)
        for hook in self.hooks:
            hook(context)
        return True

    def _drop_state(self, namespace: str, name: str) -> None:
        self.reconciler.forget(namespace, name)
        for hook in self.hooks:
            hook.forget(namespace, name)

    async def _forever(self, namespace: str, name: str, logger) -> None:
        delay = self.every_s
        while True:
            await asyncio.sleep(delay)
            run = asyncio.ensure_future(asyncio.to_thread(self._once, namespace, name, logger))
            try:
                alive = await asyncio.shield(run)
            except asyncio.CancelledError:  # deleted meanwhile: what the resync in flight
                await asyncio.wait([run])   # records (autoscaler memory, series) must go too
                self._drop_state(namespace, name)
                raise
            except Exception as exc:  # retried sooner than the next resync, like a kopf TemporaryError
                logger.warning("resync of %s/%s failed: %s", namespace, name, exc)
                delay = min(RETRY_DELAY_SECONDS, self.every_s)
                continue
            if not alive:
                self.forget(namespace, name)
                return
            delay = self.every_s


def register(registry: kopf.OperatorRegistry, reconciler: Reconciler, resync_seconds: float = 15.0,
             tick_hooks: Sequence[TickHook] = ()) -> None:
    resyncs = _Resyncs(reconciler, tick_hooks, resync_seconds)

    @kopf.on.login(id="login", registry=registry)
    def login(**kwargs):
        # In-cluster service account, else $KUBECONFIG, as the kubernetes client finds them.
        return kopf.login_via_client(**kwargs)

    @kopf.on.startup(id="settings", registry=registry)
    def startup(settings: kopf.OperatorSettings, **_):
        configure_settings(settings)

    @kopf.on.resume(GROUP, VERSION, PLURAL, id="reconcile", registry=registry)
    @kopf.on.create(GROUP, VERSION, PLURAL, id="reconcile", registry=registry)
    @kopf.on.update(GROUP, VERSION, PLURAL, id="reconcile", registry=registry)
    def inference_service_changed(namespace, name, logger, **_):
        resyncs.reconcile(namespace, name, logger)

    def owned_object_event(type, body, namespace, logger, **_):
        owner = _owner_name(body)
        if owner is None or type is None:  # type None: the initial listing; resume covers it
            return
        try:
            resyncs.reconcile(namespace, owner, logger)
        except Exception as exc:  # watch-event handlers are not retried: the resync will be
            logger.warning("reconcile of %s/%s after a %s event failed: %s", namespace, owner, type, exc)

    for group, version, plural in OWNED:
        kopf.on.event(group, version, plural, labels={"app.kubernetes.io/managed-by": MANAGED_BY},
                      id=f"owned-{plural}", registry=registry)(owned_object_event)

    @kopf.on.event(GROUP, VERSION, PLURAL, id="track", registry=registry)
    async def inference_service_event(type, namespace, name, logger, **_):
        if type == "DELETED":
            resyncs.forget(namespace, name)
        else:
            resyncs.track(namespace, name, logger)

    @kopf.on.cleanup(id="stop-resyncs", registry=registry)
    async def stop_resyncs(**_):
        resyncs.stop()
