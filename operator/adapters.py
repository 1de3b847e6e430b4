"""spec.adapters on running engine pods: after each resync's reconcile, read what every Ready pod
of the InferenceService serves (GET /v1/models), load the listed adapters it lacks and unload the
ones it has that the spec no longer lists (vLLM's POST /v1/load_lora_adapter and
/v1/unload_lora_adapter, with the admin token), and hand what happened to the reconcile, which
records it (status.adapters, Events). New pods start with the list from the ConfigMap
(resources.py, `--lora-modules`), so this only closes the gap for pods already running.

- `start_adapters` is the rule for that list, pure: spec.adapters less the ones whose load failed
  on some pod in the last pass and that no pod serves. The engine refuses a bad `--lora-modules`
  item at start, so a bad source in the list would stop every new pod (a scale-up, a restart);
  held back, the new pods start without it and the next pass retries it like any missing one.

- `plan` is the rule, pure: what one pod must load and unload to serve exactly the spec's list
  (an adapter whose directory changed is unloaded and loaded again). With spec.adapters empty
  nothing is managed, so adapters loaded by hand on a server that only has --enable-lora stay.
- One writer: only this hook writes adapters to pods, and only to the pods of the
  InferenceService's own Deployments (the controller-chain check the autoscaler uses: the admin
  token never goes to a look-alike pod). The reconcile alone writes status and Events.
- Bounded: every call has a byte cap and a total deadline (autoscaling/bounded_http.py), a pod's
  calls share one deadline, so a slow or hostile pod holds the resync for at most SYNC_DEADLINE_S;
  what did not finish is retried next resync (the pass is level-triggered).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import httpx

from iterserve.labels import PREFILL, ROLE_LABEL, selector_string
from iterserve.operator.autoscaling.bounded_http import (
    ADMIN_MAX_BYTES,
    BoundedReadError,
    bounded_request,
)
from iterserve.operator.autoscaling.loop import admin_token_from_secret, engine_pods, trusted_pods
from iterserve.operator.disaggregation import prefill_name
from iterserve.operator.models import MAX_ADAPTERS, AdapterSpec, InferenceServiceSpec
from iterserve.operator.resources import (
    ADMIN_TOKEN_KEY,
    ENGINE_PORT,
    Owner,
    controlled_by,
    deployment_name,
    secret_name,
)

logger = logging.getLogger("iterserve.adapters")

MODELS_MAX_BYTES = 1024 * 1024  # GET /v1/models: MAX_ADAPTERS entries with long paths fit many times
CALL_TIMEOUT_S = 20.0  # one call (a load reads the adapter's files)
SYNC_DEADLINE_S = 45.0  # all of one pod's calls in one pass
MAX_ERROR_CHARS = 300
# Event reasons (machine-readable: tests read these, not the messages).
LOADED = "AdapterLoaded"
UNLOADED = "AdapterUnloaded"
FAILED = "AdapterSyncFailed"


class AdapterCallError(RuntimeError):
    pass


@dataclass(frozen=True)
class Plan:
    unload: tuple[str, ...]
    load: tuple[tuple[str, str], ...]  # (name, path)


def plan(wanted: Mapping[str, str], served: Mapping[str, str | None]) -> Plan:
    """What a pod serving `served` (adapter name -> its directory) must unload and load to serve
    exactly `wanted` (name -> directory). Unloads come first: they free slots and names."""
    moved = [n for n, path in wanted.items() if n in served and served[n] is not None and served[n] != path]
    unload = sorted({*(n for n in served if n not in wanted), *moved})
    load = tuple((n, path) for n, path in wanted.items() if n not in served or n in moved)
    return Plan(tuple(unload), load)


def wanted_adapters(spec: InferenceServiceSpec) -> dict[str, str]:
    return {a.name: a.engine_path(spec.model) for a in spec.adapters}


def start_adapters(spec: InferenceServiceSpec, recorded: Sequence[dict] | None) -> list[AdapterSpec]:
    """The adapters new pods start with, from the last pass's status.adapters entries: every
    listed one but those that failed to load somewhere and are loaded nowhere."""
    entries = [e for e in recorded or () if isinstance(e, dict)]
    loaded = {n for e in entries for n in e.get("loaded") or ()}
    failed = {n for e in entries for n in e.get("failed") or ()} - loaded
    return [a for a in spec.adapters if a.name not in failed]


@dataclass(frozen=True)
class PodAdapters:
    """One pod after a pass: what it serves now, what this pass changed, what failed to load, the
    last error."""

    pod: str
    loaded: tuple[str, ...]
    error: str | None = None
    did_load: tuple[str, ...] = ()
    did_unload: tuple[str, ...] = ()
    failed: tuple[str, ...] = ()

    def status(self) -> dict:
        entry = {"pod": self.pod, "loaded": list(self.loaded[:2 * MAX_ADAPTERS])}
        if self.failed:
            entry["failed"] = list(self.failed[:MAX_ADAPTERS])
        if self.error:
            entry["error"] = self.error
        return entry


@dataclass(frozen=True)
class AdapterReport:
    """What one pass found and did on every Ready pod; the reconcile records it."""

    pods: tuple[PodAdapters, ...] = field(default_factory=tuple)

    def status(self) -> list[dict]:
        return [p.status() for p in sorted(self.pods, key=lambda p: p.pod)]

    def events(self, previous: Sequence[dict]) -> list[tuple[str, str, str]]:
        """(type, reason, message): one per adapter loaded or unloaded (naming its pods), one per
        pod whose error is new (a failure repeated every resync is announced once)."""
        out = []
        for reason, verb, attr in ((LOADED, "Loaded", "did_load"), (UNLOADED, "Unloaded", "did_unload")):
            names = sorted({n for p in self.pods for n in getattr(p, attr)})
            for name in names:
                pods = sorted(p.pod for p in self.pods if name in getattr(p, attr))
                out.append(("Normal", reason, f"{verb} LoRA adapter {name} on {len(pods)} pod(s): {', '.join(pods)}"))
        before = {e.get("pod"): e.get("error") for e in previous if isinstance(e, dict)}
        for p in sorted(self.pods, key=lambda p: p.pod):
            if p.error and p.error != before.get(p.pod):
                out.append(("Warning", FAILED, f"pod {p.pod}: {p.error}"))
        return out


class AdapterAdmin:
    """The engine's OpenAI model list and vLLM's adapter endpoints, each call bounded."""

    def __init__(self, token: str | None, timeout: float = CALL_TIMEOUT_S):
        self.token = token
        self.timeout = timeout

    async def _call(self, client: httpx.AsyncClient, method: str, url: str, deadline: float,
                    body: dict | None = None, max_bytes: int = ADMIN_MAX_BYTES) -> tuple[int, bytes]:
        left = min(self.timeout, deadline - time.monotonic())
        if left <= 0:
            raise AdapterCallError(f"{method} {url}: out of time this pass (retried next resync)")
        headers = {"Authorization": f"Bearer {self.token}"} if self.token and method == "POST" else {}
        try:
            answer = await bounded_request(client, method, url, json=body, headers=headers, max_bytes=max_bytes,
                                           deadline_s=left)
        except BoundedReadError as error:
            raise AdapterCallError(f"{method} {url}: {error}") from None
        return answer.status, answer.body

    async def served(self, client: httpx.AsyncClient, base: str, deadline: float) -> dict[str, str | None]:
        """Adapter name -> its directory (`root`), from GET /v1/models: the entries with a parent."""
        url = f"{base}/v1/models"
        status, body = await self._call(client, "GET", url, deadline, max_bytes=MODELS_MAX_BYTES)
        if status != 200:
            raise AdapterCallError(f"GET {url}: HTTP {status}")
        try:
            cards = json.loads(body)["data"]
            return {str(c["id"]): (str(c["root"]) if c.get("root") is not None else None)
                    for c in cards if c.get("parent") is not None}
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
            raise AdapterCallError(f"GET {url}: not an OpenAI model list") from None

    async def load(self, client: httpx.AsyncClient, base: str, name: str, path: str, deadline: float) -> None:
        url = f"{base}/v1/load_lora_adapter"
        status, body = await self._call(client, "POST", url, deadline, {"lora_name": name, "lora_path": path})
        if status != 200:
            raise AdapterCallError(f"load {name} from {path}: HTTP {status}: {_message(body)}")

    async def unload(self, client: httpx.AsyncClient, base: str, name: str, deadline: float) -> None:
        url = f"{base}/v1/unload_lora_adapter"
        status, body = await self._call(client, "POST", url, deadline, {"lora_name": name})
        if status not in (200, 404):  # 404: not loaded, which is what was wanted
            raise AdapterCallError(f"unload {name}: HTTP {status}: {_message(body)}")


def _message(body: bytes) -> str:
    try:
        return str(json.loads(body)["error"]["message"])[:MAX_ERROR_CHARS]
    except (ValueError, KeyError, TypeError, RecursionError):
        return body[:MAX_ERROR_CHARS].decode("utf-8", "replace")


async def sync_pod(admin: AdapterAdmin, pod: str, base: str, wanted: Mapping[str, str],
                   deadline_s: float = SYNC_DEADLINE_S) -> PodAdapters:
    """One pod to `wanted`: its list, then the plan's unloads and loads in order, each failure
    recorded and the rest still tried; what it serves at the end is read back from the plan."""
    deadline = time.monotonic() + deadline_s
    async with httpx.AsyncClient(timeout=admin.timeout) as client:
        try:
            served = await admin.served(client, base, deadline)
        except AdapterCallError as error:
            return PodAdapters(pod, (), str(error)[:MAX_ERROR_CHARS])
        steps = plan(wanted, served)
        now = dict(served)
        errors, loaded, unloaded, failed = [], [], [], []
        for name in steps.unload:
            try:
                await admin.unload(client, base, name, deadline)
            except AdapterCallError as error:
                errors.append(str(error))
                continue
            now.pop(name, None)
            unloaded.append(name)
        for name, path in steps.load:
            if name in now:  # its unload failed: loading the new directory would be refused
                continue
            try:
                await admin.load(client, base, name, path, deadline)
            except AdapterCallError as error:
                errors.append(str(error))
                failed.append(name)
                continue
            now[name] = path
            loaded.append(name)
    error = "; ".join(errors)[:MAX_ERROR_CHARS] or None
    return PodAdapters(pod, tuple(sorted(now)), error, tuple(loaded), tuple(unloaded), tuple(failed))


async def sync_pods(admin: AdapterAdmin, urls: Mapping[str, str], wanted: Mapping[str, str],
                    deadline_s: float = SYNC_DEADLINE_S) -> AdapterReport:
    """Every pod at once (each within its own deadline): a failing pod never stops the others."""
    results = await asyncio.gather(*(sync_pod(admin, pod, url, wanted, deadline_s) for pod, url in urls.items()))
    return AdapterReport(tuple(results))


class AdapterHook:
    """The tick hook (handlers.TickHook): one pass per resync of an InferenceService with adapters."""

    def __init__(self, deadline_s: float = SYNC_DEADLINE_S):
        self.deadline_s = deadline_s

    def forget(self, namespace: str, name: str) -> None:
        """Nothing is kept between passes: status holds the last report."""

    def __call__(self, ctx) -> None:
        spec: InferenceServiceSpec = ctx.spec
        previous = (ctx.body.get("status") or {}).get("adapters") or []
        if not spec.adapters:
            if previous:  # the last adapter went: the pods restart without LoRA; clear the record
                ctx.reconciler.reconcile(ctx.namespace, ctx.name, adapters=AdapterReport())
            return
        owner = Owner.from_body(ctx.body)
        urls = ready_pod_urls(ctx.kube, ctx.namespace, ctx.name, spec, owner)
        secret = ctx.kube.get("Secret", ctx.namespace, secret_name(ctx.name))
        token = admin_token_from_secret(secret, ADMIN_TOKEN_KEY) if secret and controlled_by(secret, owner) else None
        if token is None:
            report = AdapterReport(tuple(PodAdapters(pod, (), f"no admin token: Secret {secret_name(ctx.name)} is "
                                                              "missing or not this InferenceService's") for pod in urls))
        else:
            report = asyncio.run(sync_pods(AdapterAdmin(token), urls, wanted_adapters(spec), self.deadline_s))
        for kind, _reason, message in report.events(previous):
            (logger.warning if kind == "Warning" else logger.info)("%s/%s: %s", ctx.namespace, ctx.name, message)
        if report.status() != previous or any(p.did_load or p.did_unload for p in report.pods):
            ctx.reconciler.reconcile(ctx.namespace, ctx.name, adapters=report)


def ready_pod_urls(kube, namespace: str, name: str, spec: InferenceServiceSpec, owner: Owner) -> dict[str, str]:
    """The Ready engine pods (both pools when disaggregated) of the InferenceService's own
    Deployments' current ReplicaSets, by name -> base URL."""
    listed = kube.list_pods(namespace, selector_string(name))
    replica_sets = kube.list_replica_sets(namespace, selector_string(name))
    pools = [(deployment_name(name), [p for p in listed if _role(p) != PREFILL])]
    if spec.disaggregation.enabled:
        pools.append((prefill_name(name), [p for p in listed if _role(p) == PREFILL]))
    urls: dict[str, str] = {}
    for deployment, pods in pools:
        live = kube.get("Deployment", namespace, deployment)
        trusted, _ = trusted_pods(pods, live if live is not None and controlled_by(live, owner) else None, replica_sets)
        infos, found = engine_pods(trusted, ENGINE_PORT)
        urls.update({p.name: found[p.name] for p in infos if p.ready_at is not None and p.name in found})
    return urls


def _role(pod: dict) -> str | None:
    return (pod["metadata"].get("labels") or {}).get(ROLE_LABEL)
