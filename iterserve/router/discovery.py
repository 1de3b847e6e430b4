"""Where the replicas are: a static list, or the Ready, non-terminating pods of one
InferenceService, watched on the API server (not polled).

Pods rather than EndpointSlices: the slices cannot hold loopback addresses, so on the local
control plane (pod IPs 127.10.x.y) they stay empty; the Gateway API Inference Extension's endpoint
picker watches pods too. A terminating pod leaves the list at once, before its engine drains.

For prefill/decode disaggregation the pods carry their engine's role in the ROLE_LABEL label
(set by the operator): `prefill` pods form the router's prefill pool; `decode`, `both` and
unlabelled pods take requests.

Labels prove nothing (anyone who may create pods in the namespace can copy them), so with
`infsvc` set the watch routes only to pods whose controller chain holds (ChainReader, over
iterserve/controller_chain.py): the InferenceService's Deployment -> its ReplicaSet -> the pod,
running that ReplicaSet's template (for a multi-node group: its StatefulSet -> the pod, running
the template of its ControllerRevision). A look-alike pod gets no request, and so sees no user's
prompt and no signed KV parameters. The router's Role lets it read exactly these objects.

A multi-node group is one replica: only its leader (index 0, iterserve/labels.py `is_leader`)
takes requests; its workers serve nothing but /health and /ready.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from iterserve import controller_chain
from iterserve.labels import PREFILL as PREFILL_ROLE
from iterserve.labels import ROLE_LABEL as ROLE_LABEL
from iterserve.labels import is_leader, selector_string

logger = logging.getLogger("iterserve.router")


@dataclass(frozen=True, slots=True)
class RolePools:
    prefill: list[str]  # the prefill pool (pods labelled ROLE_LABEL=prefill)
    serving: list[str]  # where requests go: decode and aggregated pods


def parse_endpoints(text: str) -> list[str]:
    """'http://a:1,http://b:2' (or bare host:port) -> base URLs."""
    urls = []
    for part in text.split(","):
        part = part.strip().rstrip("/")
        if part:
            urls.append(part if "://" in part else f"http://{part}")
    return urls


def ready_urls(pods: list[dict], port_name: str) -> list[str]:
    """Base URLs of the Ready, non-terminating pods, at the container port named port_name."""
    return sorted(url for _, url in _ready(pods, port_name))


def ready_pools(pods: list[dict], port_name: str) -> RolePools:
    """The Ready, non-terminating pods' base URLs, split by their ROLE_LABEL."""
    ready = _ready(pods, port_name)
    return RolePools(prefill=sorted(url for pod, url in ready if _role(pod) == PREFILL_ROLE),
                     serving=sorted(url for pod, url in ready if _role(pod) != PREFILL_ROLE))


def _role(pod: dict) -> str | None:
    return ((pod.get("metadata") or {}).get("labels") or {}).get(ROLE_LABEL)


def _ready(pods: list[dict], port_name: str) -> list[tuple[dict, str]]:
    found = []
    for pod in pods:
        status = pod.get("status") or {}
        ready = any(c["type"] == "Ready" and c["status"] == "True" for c in status.get("conditions") or [])
        if not ready or pod["metadata"].get("deletionTimestamp") or not status.get("podIP") or not is_leader(pod):
            continue
        ports = [p for c in pod["spec"]["containers"] for p in c.get("ports") or [] if p.get("name") == port_name]
        if ports:
            found.append((pod, f"http://{status['podIP']}:{ports[0]['containerPort']}"))
    return found


def inference_service_selector(name: str) -> str:
    return selector_string(name)


def api_client(kubeconfig: str | None = None):
    from kubernetes import client, config

    if kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
        config.load_incluster_config()
        return client.ApiClient()
    return config.new_client_from_config(config_file=kubeconfig)


class ChainReader:
    """The InferenceService's own Deployments (the engine one and NAME-prefill, each checked to be
    controlled by it) and the ReplicaSets of its pods, read from the API server when a pod names a
    ReplicaSet not seen yet or the last read is over `max_age_s` old; at most one read per
    `min_interval_s`, so pods naming made-up owners cannot make the router hammer the API."""

    def __init__(self, api, namespace: str, infsvc: str, selector: str, max_age_s: float = 10.0,
                 min_interval_s: float = 1.0, clock: Callable[[], float] = time.monotonic):
        self.api, self.namespace, self.infsvc, self.selector = api, namespace, infsvc, selector
        self.max_age_s, self.min_interval_s, self.clock = max_age_s, min_interval_s, clock
        self._read_at: float | None = None
        self._deployments: list[dict] = []
        self._replica_sets: list[dict] = []
        self._stateful_sets: list[dict] = []
        self._revisions: list[dict] = []

    def verified(self, pods: list[dict]) -> list[dict]:
        wanted = {(controller_chain.controller(p) or {}).get("uid") for p in pods}
        known = {o["metadata"]["uid"] for o in (*self._replica_sets, *self._stateful_sets)}
        now = self.clock()
        stale = self._read_at is None or now - self._read_at > self.max_age_s or not wanted <= known
        if stale and (self._read_at is None or now - self._read_at >= self.min_interval_s):
            self._read_at = now
            self._deployments, self._replica_sets = self._read()
            if any((controller_chain.controller(p) or {}).get("kind") == "StatefulSet" for p in pods):
                self._stateful_sets, self._revisions = self._read_groups()
        verified, refused = controller_chain.verify(pods, self._deployments, self._replica_sets,
                                                    self._stateful_sets, self._revisions)
        if refused:
            logger.warning("pod watch: not routing to pods whose controller chain does not hold: %s",
                           ", ".join(f"{r.pod} ({r.reason})" for r in refused))
        return verified

    def _read(self) -> tuple[list[dict], list[dict]]:
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        apps = client.AppsV1Api(self.api)
        deployments = []
        for name in (self.infsvc, f"{self.infsvc}-prefill"):
            try:
                found = json.loads(apps.read_namespaced_deployment(name, self.namespace, _preload_content=False).data)
            except ApiException as error:
                if error.status != 404:
                    raise
                continue
            if controller_chain.deployment_is_owned(found, self.infsvc):
                deployments.append(found)
        listing = json.loads(apps.list_namespaced_replica_set(
            self.namespace, label_selector=self.selector, _preload_content=False).data)
        return deployments, listing["items"]

    def _read_groups(self) -> tuple[list[dict], list[dict]]:
        """The InferenceService's group StatefulSets (directly, or through its LeaderWorkerSet) and
        their ControllerRevisions (read only when a pod names a StatefulSet as its controller)."""
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        apps = client.AppsV1Api(self.api)
        listing = json.loads(apps.list_namespaced_stateful_set(
            self.namespace, label_selector=self.selector, _preload_content=False).data)["items"]
        if not listing:
            return [], []
        owned = controller_chain.stateful_sets_owned(listing, self.infsvc)
        if any((controller_chain.controller(s) or {}).get("kind") == "LeaderWorkerSet" for s in listing):
            for name in (self.infsvc, f"{self.infsvc}-prefill"):  # each pool's LeaderWorkerSet
                try:
                    lws = client.CustomObjectsApi(self.api).get_namespaced_custom_object(
                        "leaderworkerset.x-k8s.io", "v1", self.namespace, "leaderworkersets", name)
                except ApiException as error:
                    if error.status not in (403, 404):
                        raise
                    continue
                owned += [s for s in controller_chain.stateful_sets_owned(listing, self.infsvc, leader_worker_set=lws)
                          if s not in owned]
        revisions = json.loads(apps.list_namespaced_controller_revision(
            self.namespace, label_selector=self.selector, _preload_content=False).data)["items"] if owned else []
        return owned, revisions


class PodWatch:
    """Calls on_change(urls) (from its own thread) whenever the set of ready URLs changes; with
    by_role, on_change(RolePools) whenever either pool changes."""

    def __init__(self, api, namespace: str, selector: str, on_change: Callable[[list[str]], None],
                 port_name: str = "http", by_role: bool = False, infsvc: str | None = None):
        """`infsvc`: route only to pods whose controller chain reaches this InferenceService."""
        self.api, self.namespace, self.selector = api, namespace, selector
        self.on_change, self.port_name, self.by_role = on_change, port_name, by_role
        self.chain = ChainReader(api, namespace, infsvc, selector) if infsvc else None
        self._stop = threading.Event()
        self._last: list[str] | RolePools | None = None
        self._thread = threading.Thread(target=self._run, name="pod watch", daemon=True)

    def start(self) -> PodWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _emit(self, pods: dict[str, dict]) -> None:
        pods_ = list(pods.values())
        if self.chain is not None:
            pods_ = self.chain.verified(pods_)
        urls = ready_pools(pods_, self.port_name) if self.by_role else ready_urls(pods_, self.port_name)
        if urls != self._last:
            self._last = urls
            self.on_change(urls)

    def _run(self) -> None:
        from kubernetes import client, watch
        from kubernetes.client.exceptions import ApiException

        core = client.CoreV1Api(self.api)
        while not self._stop.is_set():
            try:
                listing = json.loads(core.list_namespaced_pod(
                    self.namespace, label_selector=self.selector, _preload_content=False).data)
                pods = {p["metadata"]["name"]: p for p in listing["items"]}
                self._emit(pods)
                version = listing["metadata"]["resourceVersion"]
                while not self._stop.is_set():
                    stream = watch.Watch().stream(core.list_namespaced_pod, self.namespace,
                                                  label_selector=self.selector, resource_version=version,
                                                  timeout_seconds=30, allow_watch_bookmarks=True)
                    for event in stream:
                        pod = event["raw_object"]
                        version = pod["metadata"].get("resourceVersion", version)
                        if event["type"] == "ERROR":
                            raise ApiException(status=pod.get("code", 500), reason=pod.get("message"))
                        if event["type"] == "BOOKMARK":
                            continue
                        if event["type"] == "DELETED":
                            pods.pop(pod["metadata"]["name"], None)
                        else:
                            pods[pod["metadata"]["name"]] = pod
                        self._emit(pods)
                        if self._stop.is_set():
                            return
            except ApiException as error:
                if error.status != 410:  # 410: our resourceVersion is too old; list again
                    logger.warning("pod watch: %s %s; listing again in 1 s", error.status, error.reason)
                    self._stop.wait(1)
            except Exception as error:  # noqa: BLE001 - keep the last list, try again
                logger.warning("pod watch: %s: %s; listing again in 1 s", type(error).__name__, error)
                self._stop.wait(1)
