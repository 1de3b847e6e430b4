"""One level-triggered reconcile of one InferenceService: read it fresh, build the owned objects,
write only what differs, write status, and say what changed in Events.

The one writer of the Deployment, Service, ConfigMap and status, from the spec and the
autoscaler's recorded decisions: a tick the autoscaler hands over (`reconcile(..., tick=)`) is
recorded in status (with its Events) and sets the max_num_seqs new pods start with; without one,
the value status recorded last stands. docs/operator.md draws the flow.

Idempotent by construction: nothing is written when the live objects already match, so running it
again on an unchanged resource makes no API writes and no Events. Safe to call from any trigger
(create/update/resume, a timer, an owned object's event) and from several threads: calls for
the same object are serialized.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from iterserve.operator import (
    disaggregation,
    groups,
    kv_auth,
    metrics,
    network_policy,
    router_salt,
    routing,
)
from iterserve.operator.adapters import AdapterReport, start_adapters
from iterserve.operator.autoscaling.report import AutoscalerTick, events_for, tuned_max_num_seqs
from iterserve.operator.autoscaling.settings import settings_from_spec
from iterserve.operator.kube import Kube, conflict, invalid, not_found, server_message
from iterserve.operator.models import (
    CONFLICT,
    DEGRADED,
    DISAGGREGATION_INEFFECTIVE,
    INVALID_SPEC,
    READY,
    ROUTING_UNAVAILABLE,
    AdapterSpec,
    InferenceServiceSpec,
)
from iterserve.operator.resources import (
    Owner,
    build_admin_secret,
    build_configmap,
    build_deployment,
    build_service,
    controlled_by,
    deployment_name,
    effective_max_num_seqs,
    secret_name,
    selector_string,
    service_name,
)
from iterserve.operator.service_status import Observed, service_status
from iterserve.operator.status import (
    changed_fields,
    conflict_status,
    find_condition,
    invalid_status,
    utcnow,
)
from iterserve.operator.validation import SpecError, parse_spec

logger = logging.getLogger(__name__)
STATUS_WRITE_ATTEMPTS = 5


@dataclass
class Outcome:
    result: str  # "applied", "unchanged", "invalid", "conflict", "gone"
    changes: list[str] = field(default_factory=list)
    body: dict | None = None
    spec: InferenceServiceSpec | None = None


def first_difference(desired: Any, actual: Any, path: str = "") -> str | None:
    """Where `actual` fails to contain `desired` (extra fields in `actual`, such as the API
    server's defaults, are fine), or None when it contains all of it."""
    if isinstance(desired, dict):
        if not isinstance(actual, dict):
            return path or "."
        for key, value in desired.items():
            found = first_difference(value, actual.get(key), f"{path}.{key}")
            if found:
                return found
        return None
    if isinstance(desired, list):
        if not isinstance(actual, list):
            return path
        if all(isinstance(i, dict) and "name" in i for i in desired):
            by_name = {i.get("name"): i for i in actual if isinstance(i, dict)}
            for item in desired:
                found = first_difference(item, by_name.get(item["name"]), f"{path}[{item['name']}]")
                if found:
                    return found
            return None
        if len(desired) != len(actual):
            return path
        for i, (want, have) in enumerate(zip(desired, actual, strict=True)):
            found = first_difference(want, have, f"{path}[{i}]")
            if found:
                return found
        return None
    if desired == actual or (actual is not None and str(desired) == str(actual)):
        return None
    return path


def drift(desired: dict, actual: dict) -> str | None:
    """first_difference, and for a Deployment a pod label the operator no longer sets (e.g. the
    endpoint picker's, after leaving Gateway mode): pod labels decide what selects the pods."""
    found = first_difference(desired, actual)
    if found or desired["kind"] != "Deployment":
        return found
    want = desired["spec"]["template"]["metadata"].get("labels") or {}
    have = (((actual.get("spec") or {}).get("template") or {}).get("metadata") or {}).get("labels") or {}
    return None if set(have) <= set(want) else ".spec.template.metadata.labels"


def _key(manifest: dict) -> tuple[str, str]:
    return manifest["kind"], manifest["metadata"]["name"]


def wanted_objects(owner: Owner, spec: InferenceServiceSpec, max_num_seqs: int, router_serving: bool,
                   pool_served: bool,
                   network: network_policy.NetworkPolicySettings = network_policy.DEFAULT_SETTINGS,
                   lws: bool = False, start: Sequence[AdapterSpec] | None = None) -> list[dict]:
    """Every object the InferenceService should have, in apply order: the engine ConfigMap (new
    pods' max_num_seqs and adapters: `start`, by default spec.adapters), the
    engines' NetworkPolicy (before any engine pod), the routing mode's objects (a router exists
    before the Service is pointed at it), the Service, the engine Deployment (or with several
    nodes per replica the groups: operator/groups.py; `lws`: as a LeaderWorkerSet), then the
    prefill pool. Pure: the reconcile applies what differs."""
    engines = groups.build_groups(owner, spec, lws) if groups.is_group(spec) else [build_deployment(owner, spec)]
    return [build_configmap(owner, spec, max_num_seqs, start), *network_policy.build_for(owner, spec, network),
            *routing.build_routing(owner, spec, pool_served, lws),
            build_service(owner, spec, router_serving, lws), *engines,
            *disaggregation.build_disaggregation(owner, spec)]


class Reconciler:
    def __init__(self, kube: Kube, clock: Callable[[], datetime] = utcnow,
                 allowed_pod_security: frozenset[str] = frozenset(),
                 network: network_policy.NetworkPolicySettings = network_policy.DEFAULT_SETTINGS):
        """`allowed_pod_security`: operator/podsecurity.py rules the cluster admin allows."""
        self.kube = kube
        self.clock = clock
        self.allowed_pod_security = allowed_pod_security
        self.network_policy = network
        self._locks: dict[tuple[str, str], threading.Lock] = {}
        self._locks_guard = threading.Lock()

    def lock(self, namespace: str, name: str) -> threading.Lock:
        with self._locks_guard:
            return self._locks.setdefault((namespace, name), threading.Lock())

    def forget(self, namespace: str, name: str) -> None:
        """The object is gone: drop what this process kept for it."""
        with self._locks_guard:
            self._locks.pop((namespace, name), None)

    def reconcile(self, namespace: str, name: str, tick: AutoscalerTick | None = None,
                  adapters: AdapterReport | None = None) -> Outcome:
        """`tick`: what the autoscaler just decided and did, to record; `adapters`: what the adapter
        pass (operator/adapters.py) found and did on the pods, to record."""
        started = time.monotonic()
        try:
            with self.lock(namespace, name):
                outcome = self._reconcile(namespace, name, tick, adapters)
        except Exception:
            metrics.RECONCILES.labels(result="error").inc()
            raise
        finally:
            metrics.RECONCILE_SECONDS.observe(time.monotonic() - started)
        metrics.RECONCILES.labels(result=outcome.result).inc()
        if outcome.result == "gone":
            self.forget(namespace, name)
        return outcome

    def _reconcile(self, namespace: str, name: str, tick: AutoscalerTick | None,
                   adapters: AdapterReport | None = None) -> Outcome:
        body = self.kube.get_inference_service(namespace, name)
        if body is None or body["metadata"].get("deletionTimestamp"):
            return Outcome("gone")
        generation = body["metadata"].get("generation")
        try:
            spec = parse_spec(body.get("spec"), self.allowed_pod_security)
        except SpecError as error:
            return self._report_invalid(body, generation, error)

        owner = Owner.from_body(body)
        previous = body.get("status") or {}
        tuned = tuned_max_num_seqs(settings_from_spec(spec), tick, previous)
        max_num_seqs = effective_max_num_seqs(spec, tuned)
        mode = spec.routing.mode
        pool_served = mode != routing.GATEWAY or self.kube.api_resource_served(
            routing.INFERENCE_POOL_GROUP, routing.INFERENCE_POOL_VERSION, routing.INFERENCE_POOL_PLURAL)
        lws = groups.is_group(spec) and self.kube.api_resource_served(
            groups.LWS_GROUP, groups.LWS_VERSION, groups.LWS_PLURAL)
        start = start_adapters(spec, adapters.status() if adapters is not None else previous.get("adapters"))
        manifests, live, leftovers = self._read_live(owner, spec, max_num_seqs, pool_served, lws, start)
        secret = self.kube.get("Secret", namespace, secret_name(name))
        kv_secret = self.kube.get("Secret", namespace, kv_auth.secret_name(name)) if spec.disaggregation.enabled else None
        salt_secret = self.kube.get("Secret", namespace, router_salt.secret_name(name)) if router_salt.wanted(spec) else None
        taken = [obj for obj in (*live.values(), secret, kv_secret, salt_secret)
                 if obj is not None and not controlled_by(obj, owner)]
        if taken:
            return self._report_conflict(body, generation, taken[0])
        stale = [(m, drift(m, live[_key(m)]) if live[_key(m)] else None) for m in manifests]
        stale = [(m, difference) for m, difference in stale if live[_key(m)] is None or difference]
        refused = self._refused_by_server([m for m, _ in stale])
        if refused is not None:
            return self._report_invalid(body, generation, refused)

        changes = []
        if secret is None and self._create_secret(body, build_admin_secret(owner), "engine admin token"):
            changes.append(f"created Secret {secret_name(owner.name)}")
        if spec.disaggregation.enabled and kv_secret is None and self._create_secret(
                body, kv_auth.build_secret(owner), "KV transfer key"):
            changes.append(f"created Secret {kv_auth.secret_name(name)}")
        if router_salt.wanted(spec) and salt_secret is None and self._create_secret(
                body, router_salt.build_secret(owner), "router tenant salt key"):
            changes.append(f"created Secret {router_salt.secret_name(name)}")
        service_before = live.get(("Service", service_name(name)))
        for manifest, difference in stale:
            applied, change = self._write(body, manifest, live[_key(manifest)], difference)
            live[_key(manifest)] = applied
            if change:
                changes.append(change)
        engines = live.get(("Deployment", deployment_name(name)))
        prefill = live.get(("Deployment", disaggregation.prefill_name(name)))
        if groups.is_group(spec) or leftovers.get(("Service", groups.headless_service_name(name))) is not None:
            summaries, group_changes = self._sync_groups(body, owner, spec, lws, live)
            if groups.is_group(spec):
                engines, prefill = summaries[name], summaries[disaggregation.prefill_name(name)]
            changes += group_changes
        # Written after the Service stopped selecting them: a mode switch drops no request on the floor.
        for obj in leftovers.values():
            if obj is not None and controlled_by(obj, owner) and routing.may_delete_leftover(obj, name, service_before):
                of_prefill = obj["metadata"]["name"] == disaggregation.prefill_name(name)
                why = ("spec.disaggregation.enabled is false" if of_prefill and not spec.disaggregation.enabled
                       else "the operator runs with --no-network-policy" if obj["kind"] == network_policy.KIND
                       else groups.leftover_reason(spec, lws) if of_prefill or _key(obj) in groups.leftover_keys(name)
                       else f"spec.routing.mode is {mode}")
                changes.append(self._delete(body, obj, why))
        deployment = engines
        router = live.get(("Deployment", routing.router_name(name)))
        routing_state = routing.routing_condition(name, spec, pool_served, router)

        seen = Observed(spec, name, generation, deployment, max_num_seqs, self.clock(), routing_state, router,
                        prefill, tick, groups.leader_pod_selector(name, spec, lws))
        written, _ = self.write_status(body, lambda prev: {**service_status(prev, seen), **(
            {"adapters": adapters.status()} if adapters is not None else {})})
        if written is not None:
            self._announce_transitions(written, previous)
            for pool in tick.pools if tick is not None else ():
                for event in events_for(pool.decision, pool.record, name_pool=bool(tick.extra_pools)):
                    self._event(written, event.type, event.reason, event.message)
            for type_, reason, message in adapters.events(previous.get("adapters") or []) if adapters is not None else ():
                self._event(written, type_, reason, message)
        return Outcome("applied" if changes else "unchanged", changes, written, spec)

    def _read_live(self, owner: Owner, spec: InferenceServiceSpec, max_num_seqs: int, pool_served: bool,
                   lws: bool = False, start: Sequence[AdapterSpec] | None = None):
        """(the wanted objects in apply order, the live object of each by (kind, name), the live
        objects another routing mode or disaggregation left behind: to delete if ours)."""
        namespace, name = owner.namespace, owner.name
        # Every object some routing mode makes, read once: what this mode wants is applied, what
        # another mode left behind (and is ours) is deleted.
        leftovers = {key: self.kube.get(key[0], namespace, key[1])
                     for key in (*routing.routing_object_keys(name), *disaggregation.disaggregation_object_keys(name),
                                 (network_policy.KIND, network_policy.policy_name(name)),
                                 *groups.leftover_keys(name))}
        router = leftovers.get(("Deployment", routing.router_name(name)))
        service = self.kube.get("Service", namespace, service_name(name))
        router_serving = routing.router_ready(router) or (
            service is not None and (service.get("spec") or {}).get("selector") == routing.router_labels(name))
        manifests = wanted_objects(owner, spec, max_num_seqs, router_serving, pool_served, self.network_policy, lws,
                                   start)
        live = {}
        for m in manifests:
            key = _key(m)
            live[key] = service if key == ("Service", service_name(name)) else (
                leftovers.pop(key) if key in leftovers else self.kube.get(m["kind"], namespace, key[1]))
        return manifests, live, leftovers

    def _sync_groups(self, body: dict, owner: Owner, spec: InferenceServiceSpec, lws: bool,
                     live: dict) -> tuple[dict[str, dict], list[str]]:
        """StatefulSet groups (operator/groups.py): deletes the groups past their pool's replicas (or
        all, when the engines are no longer StatefulSet groups), restarts the groups that need it by
        deleting their pods, and returns each pool's groups (by the pool's base name) counted as a
        Deployment status counts pods."""
        namespace, name = owner.namespace, owner.name
        selector = selector_string(name)
        # list items carry no kind; delete() needs it
        listed = [{**s, "kind": "StatefulSet"} for s in self.kube.list_stateful_sets(namespace, selector)
                  if controlled_by(s, owner)]
        changes = []
        surplus = groups.surplus_statefulsets(name, spec, lws, listed)
        for sts, why in surplus:
            changes.append(self._delete(body, sts, why))
        gone = {sts["metadata"]["name"] for sts, _ in surplus}
        kept = [s for s in listed if s["metadata"]["name"] not in gone]
        kept = [live.get(("StatefulSet", s["metadata"]["name"])) or s for s in kept]
        if lws:
            return {base: groups.groups_summary(spec, [], [], live.get((groups.LEADER_WORKER_SET, base)) or {})
                    for base in groups.by_pool(name, [])}, changes
        pods = [{**p, "kind": "Pod"} for p in self.kube.list_pods(namespace, selector)] if kept else []
        pools = groups.by_pool(name, kept)
        for pool in pools.values():  # a rolling update goes a group at a time within each pool
            for sts, why in groups.groups_to_restart(pool, pods):
                for pod in groups.members(sts, pods):
                    if not pod["metadata"].get("deletionTimestamp"):
                        self.kube.delete(pod)
                metrics.OBJECT_WRITES.labels(kind="Pod", action="deleted").inc()
                message = f"Restarted group {sts['metadata']['name']}: {why}"
                self._event(body, "Normal", "GroupRestarted", message)
                changes.append(message)
        return {base: groups.groups_summary(spec, pool, pods) for base, pool in pools.items()}, changes

    def _delete(self, owner_body: dict, obj: dict, why: str) -> str:
        kind, obj_name = obj["kind"], obj["metadata"]["name"]
        self.kube.delete(obj)
        metrics.OBJECT_WRITES.labels(kind=kind, action="deleted").inc()
        self._event(owner_body, "Normal", "Deleted", f"Deleted {kind} {obj_name} ({why})")
        return f"deleted {kind} {obj_name} ({why})"

    def _create_secret(self, owner_body: dict, manifest: dict, what: str) -> bool:
        """Secrets (the admin token, the KV key, the tenant salt key) are generated once; an
        existing one is never rewritten."""
        try:
            self.kube.create_secret(manifest)
        except Exception as exc:
            if conflict(exc):  # another reconcile created it first
                return False
            raise
        metrics.OBJECT_WRITES.labels(kind="Secret", action="created").inc()
        self._event(owner_body, "Normal", "Created", f"Created Secret {manifest['metadata']['name']} ({what})")
        return True

    def _refused_by_server(self, manifests: list[dict]) -> SpecError | None:
        """Server-side dry runs of every write, before the first one: what the schema could not
        check (a pod template patch, a label) is refused whole, never half applied."""
        for manifest in manifests:
            try:
                self.kube.apply(manifest, dry_run=True)
            except Exception as exc:
                if manifest["kind"] == "RoleBinding" and not_found(exc):
                    continue  # its Role, written just before it, does not exist yet in a dry run
                if not invalid(exc):
                    raise
                return SpecError("spec", f"the {manifest['kind']} built from it is invalid: {server_message(exc)}")
        return None

    def _write(self, owner_body: dict, manifest: dict, live: dict | None, difference: str | None):
        kind, meta = manifest["kind"], manifest["metadata"]
        applied = self.kube.apply(manifest)
        if live is None:
            change = f"created {kind} {meta['name']}"
            metrics.OBJECT_WRITES.labels(kind=kind, action="created").inc()
            self._event(owner_body, "Normal", "Created", f"Created {kind} {meta['name']}")
        elif applied["metadata"]["resourceVersion"] != live["metadata"]["resourceVersion"]:
            change = f"updated {kind} {meta['name']} ({difference.lstrip('.')})"
            metrics.OBJECT_WRITES.labels(kind=kind, action="updated").inc()
            self._event(owner_body, "Normal", "Updated", f"Updated {kind} {meta['name']}: {difference.lstrip('.')} differed")
        else:
            change = None  # the server already had it (e.g. a quantity written another way)
        return applied, change

    def write_status(self, body: dict, compute: Callable[[dict], dict]) -> tuple[dict | None, bool]:
        """Patches the status fields `compute(previous_status)` changes, against the resourceVersion
        it read; on 409 re-reads the object and recomputes. Returns the object and whether it wrote."""
        meta = body["metadata"]
        for _ in range(STATUS_WRITE_ATTEMPTS):
            delta = changed_fields(body.get("status"), compute(body.get("status") or {}))
            if not delta:
                return body, False
            try:
                return self.kube.patch_status(meta["namespace"], meta["name"], delta,
                                              body["metadata"]["resourceVersion"]), True
            except Exception as exc:
                if not conflict(exc):
                    raise
                metrics.CONFLICTS.inc()
                body = self.kube.get_inference_service(meta["namespace"], meta["name"])
                if body is None:
                    return None, False
        raise RuntimeError(f"status of {meta['namespace']}/{meta['name']}: still conflicting after "
                           f"{STATUS_WRITE_ATTEMPTS} attempts")

    def _report_invalid(self, body: dict, generation: int | None, error: SpecError) -> Outcome:
        """No owned object is touched: a half-applied spec would be worse than the last good one."""
        now = self.clock()
        previous = find_condition((body.get("status") or {}).get("conditions"), INVALID_SPEC)
        body, _ = self.write_status(body, lambda prev: invalid_status(prev, generation, error.field, error.message, now))
        if body is not None:
            current = find_condition(body["status"]["conditions"], INVALID_SPEC)
            if previous is None or (previous["status"], previous["message"]) != (current["status"], current["message"]):
                self._event(body, "Warning", INVALID_SPEC, str(error))
        logger.warning("%s/%s: invalid spec: %s", body and body["metadata"]["namespace"],
                       body and body["metadata"]["name"], error)
        return Outcome("invalid", [str(error)], body)

    def _report_conflict(self, body: dict, generation: int | None, taken: dict) -> Outcome:
        """Never adopt: an object of an owned object's name that is not this InferenceService's
        is left exactly as it is, and so is everything else; the condition and Event name it."""
        meta = taken["metadata"]
        owners = [f"{r.get('kind')} {r.get('name')}" for r in meta.get("ownerReferences") or [] if r.get("controller")]
        message = (f"{taken['kind']} {meta['namespace']}/{meta['name']} already exists and is not this "
                   f"InferenceService's (controlled by {owners[0] if owners else 'nothing'}); nothing was "
                   f"changed. Delete or rename it, or choose another InferenceService name.")
        previous = find_condition((body.get("status") or {}).get("conditions"), CONFLICT)
        written, _ = self.write_status(body, lambda prev: conflict_status(prev, generation, message, self.clock()))
        if written is not None and (previous is None or (previous["status"], previous["message"]) != ("True", message)):
            self._event(written, "Warning", CONFLICT, message)
        logger.warning("%s/%s: %s", meta["namespace"], body["metadata"]["name"], message)
        return Outcome("conflict", [message], written)

    def _announce_transitions(self, body: dict, previous_status: dict) -> None:
        conditions = (body.get("status") or {}).get("conditions") or []
        before = {c["type"]: c["status"] for c in previous_status.get("conditions") or []}
        for condition in conditions:
            if before.get(condition["type"]) == condition["status"]:
                continue
            kind = condition["type"]
            if kind == READY and condition["status"] == "True":
                self._event(body, "Normal", READY, condition["message"])
            elif kind == DEGRADED and condition["status"] == "True":
                self._event(body, "Warning", condition["reason"], condition["message"] or DEGRADED)
            elif kind == INVALID_SPEC and condition["status"] == "False" and before.get(kind) == "True":
                self._event(body, "Normal", "SpecValid", "The spec is valid again and has been applied.")
            elif kind == DISAGGREGATION_INEFFECTIVE and condition["status"] == "True":
                self._event(body, "Warning", condition["reason"], condition["message"])
            elif kind == ROUTING_UNAVAILABLE and condition["status"] == "True":
                self._event(body, "Warning", condition["reason"], condition["message"])
            elif kind == ROUTING_UNAVAILABLE and before.get(kind) == "True":
                self._event(body, "Normal", "RoutingAvailable", condition["message"])
            elif kind == CONFLICT and condition["status"] == "False" and before.get(kind) == "True":
                self._event(body, "Normal", "ConflictResolved", "No other object holds an owned object's name now.")

    def _event(self, owner_body: dict, type_: str, reason: str, message: str) -> None:
        try:
            self.kube.post_event(owner_body, type_, reason, message)
        except Exception as exc:  # an Event is a courtesy; never fail the reconcile for it
            logger.warning("could not post Event %s: %s", reason, exc)
