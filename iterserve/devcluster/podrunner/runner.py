"""The local pod runtime: watches the pods of the namespaces it is given (never the whole
cluster: only namespaces whose pods the person running it means to run), and runs as a real
process each one that is bound to a node labelled `iterserve.dev/local-runtime: "true"` and asks
for such a node in its nodeSelector (the same marker KWOK's pod stages test to leave these pods
alone). Each pod gets a PodWorker thread; the runtime itself only routes watch events to them.

Everything it dials is the API server and the pods' own 127.10.x.y addresses.
"""

from __future__ import annotations

import json
import logging
import tempfile
import threading
import time
from pathlib import Path

from iterserve.devcluster.podrunner.container import (
    ContainerOptions,
    ServiceAccountToken,
    new_runner_id,
    reap,
)
from iterserve.devcluster.podrunner.hosts import HostsFiles
from iterserve.devcluster.podrunner.worker import PodWorker, WorkerOptions

logger = logging.getLogger("iterserve.podrunner")

LOCAL_RUNTIME_LABEL = "iterserve.dev/local-runtime"
NODE_CACHE_SECONDS = 5.0
CONTAINER_RUNTIMES = ("process", "podman")
TOKEN_SECONDS = 86400  # a router pod's token (bound to the pod; a day outlasts any local run)


def wants_local_runtime(pod: dict) -> bool:
    selector = (pod.get("spec") or {}).get("nodeSelector") or {}
    return selector.get(LOCAL_RUNTIME_LABEL) == "true"


class KubeApi:
    """The few API calls the runtime makes, on dicts (admin kubeconfig)."""

    def __init__(self, api_client):
        from kubernetes import client

        self.api_client = api_client
        self.core = client.CoreV1Api(api_client)

    def _json(self, response) -> dict:
        return json.loads(response.data)

    def patch_status(self, namespace: str, name: str, status: dict) -> dict:
        return self._json(self.core.patch_namespaced_pod_status(name, namespace, {"status": status},
                                                                _preload_content=False))

    def delete_now(self, namespace: str, name: str, uid: str) -> None:
        from kubernetes import client

        self.core.delete_namespaced_pod(name, namespace, body=client.V1DeleteOptions(
            grace_period_seconds=0, preconditions=client.V1Preconditions(uid=uid)))

    def read(self, kind: str, namespace: str, name: str) -> dict | None:
        from kubernetes.client.exceptions import ApiException

        reader = {"ConfigMap": self.core.read_namespaced_config_map,
                  "Secret": self.core.read_namespaced_secret}[kind]
        try:
            return self._json(reader(name, namespace, _preload_content=False))
        except ApiException as error:
            if error.status == 404:
                return None
            raise

    def node_labels(self, name: str) -> dict[str, str] | None:
        from kubernetes.client.exceptions import ApiException

        try:
            return self._json(self.core.read_node(name, _preload_content=False))["metadata"].get("labels") or {}
        except ApiException as error:
            if error.status == 404:
                return None
            raise

    def service_account_kubeconfig(self, pod: dict, service_account: str, folder: Path) -> Path:
        """A kubeconfig holding a token of `service_account` bound to `pod` (TokenRequest API), as
        the kubelet projects one into a pod: it stops working when the pod is deleted."""
        import base64

        from iterserve.devcluster.kubeconfig import token_user, write_kubeconfig

        granted = self.service_account_token(pod, service_account)
        cluster = {"server": granted.server}
        if granted.ca_pem:
            cluster["certificate-authority-data"] = base64.b64encode(granted.ca_pem).decode()
        folder.mkdir(parents=True, exist_ok=True)
        meta = pod["metadata"]
        return write_kubeconfig(folder / "serviceaccount.kubeconfig", cluster, token_user(granted.token),
                                f"{meta['namespace']}-{service_account}")

    def service_account_token(self, pod: dict, service_account: str) -> ServiceAccountToken:
        """A token of `service_account` bound to `pod` (TokenRequest API), with the cluster's CA."""
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        from iterserve.devcluster.podrunner.launch import LaunchError

        meta = pod["metadata"]
        request = client.AuthenticationV1TokenRequest(spec=client.V1TokenRequestSpec(
            audiences=[], expiration_seconds=TOKEN_SECONDS,
            bound_object_ref=client.V1BoundObjectReference(api_version="v1", kind="Pod", name=meta["name"],
                                                           uid=meta["uid"])))
        try:
            token = self.core.create_namespaced_service_account_token(service_account, meta["namespace"], request)
        except ApiException as error:
            if error.status == 404:
                raise LaunchError(f"pod {meta['name']}: ServiceAccount {meta['namespace']}/{service_account} "
                                  "(spec.serviceAccountName) not found") from error
            raise LaunchError(f"pod {meta['name']}: no token for ServiceAccount {service_account}: "
                              f"{error.status} {error.reason}") from error
        configuration = self.api_client.configuration
        ca = Path(configuration.ssl_ca_cert).read_bytes() if configuration.ssl_ca_cert else b""
        return ServiceAccountToken(token.status.token, ca, meta["namespace"], configuration.host)

    def list_pods(self, namespace: str) -> dict:
        return self._json(self.core.list_namespaced_pod(namespace, _preload_content=False))


class PodRunner:
    """`start()` / `stop()`, or a context manager. Runs the pods of `namespaces` only; logs of
    each container go to log_dir. container_runtime "process" (the default) runs each container as
    a local `iterserve` process; "podman" runs the pod's image (container.py), and `stop()` removes
    every container this runner made."""

    def __init__(self, api_client, log_dir: Path, *, namespaces: list[str] | tuple[str, ...],
                 work_dir: Path | None = None, threads: int = 1, backoff_initial: float = 1.0,
                 label: str = LOCAL_RUNTIME_LABEL, container_runtime: str = "process"):
        if isinstance(namespaces, str) or not namespaces or not all(namespaces):
            raise ValueError("PodRunner needs the list of namespaces whose pods it runs")
        if container_runtime not in CONTAINER_RUNTIMES:
            raise ValueError(f"container_runtime {container_runtime!r}: use one of {', '.join(CONTAINER_RUNTIMES)}")
        container = None
        if container_runtime == "podman":
            from iterserve.devcluster import podman

            reason = podman.unavailable_reason()
            if reason:
                raise RuntimeError(f"container_runtime podman: {reason}; use container_runtime process")
            reaped = reap()  # containers of runners that died without stopping
            if reaped:
                logger.info("removed %d containers left by runners that no longer run: %s", len(reaped),
                            ", ".join(reaped))
            container = ContainerOptions(new_runner_id(), threads, api_client.configuration.host)
        self.namespaces = tuple(dict.fromkeys(namespaces))
        self.api = KubeApi(api_client)
        self.label = label
        self.options = WorkerOptions(Path(log_dir), Path(work_dir or tempfile.mkdtemp(prefix="podrunner-")),
                                     threads=threads, backoff_initial=backoff_initial, container=container)
        if container is None:
            self.options.hosts = HostsFiles(self.options.work_dir / "hosts")
        self.options.log_dir.mkdir(parents=True, exist_ok=True)
        self.workers: dict[str, PodWorker] = {}  # by pod uid
        self._nodes: dict[str, tuple[bool, float]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._watches: dict[str, object] = {}
        self._threads = [threading.Thread(target=self._watch_loop, args=(namespace,), daemon=True,
                                          name=f"podrunner watch {namespace}") for namespace in self.namespaces]

    def __enter__(self) -> PodRunner:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> PodRunner:
        for thread in self._threads:
            thread.start()
        return self

    def stop(self, timeout: float = 15) -> None:
        self._stop.set()
        for watch in list(self._watches.values()):
            watch.stop()
        with self._lock:
            workers = list(self.workers.values())
        for worker in workers:
            worker.shutdown()
        deadline = time.monotonic() + timeout
        for worker in workers:
            worker.thread.join(max(0.1, deadline - time.monotonic()))
        for thread in self._threads:
            thread.join(2)
        if self.options.container is not None:
            reap(self.options.container.runner_id)

    def worker_for(self, namespace: str, name: str) -> PodWorker | None:
        with self._lock:
            return next((w for w in self.workers.values() if (w.namespace, w.name) == (namespace, name)), None)

    # --- routing -------------------------------------------------------------------------------

    def _is_local_node(self, name: str | None) -> bool:
        if not name:
            return False
        cached = self._nodes.get(name)
        if cached is not None and time.monotonic() - cached[1] < NODE_CACHE_SECONDS:
            return cached[0]
        labels = self.api.node_labels(name)
        local = labels is not None and labels.get(self.label) == "true"
        self._nodes[name] = (local, time.monotonic())
        return local

    def _route(self, kind: str, pod: dict) -> None:
        if self.options.hosts is not None:
            self.options.hosts.seen(kind, pod)
        uid = pod["metadata"]["uid"]
        with self._lock:
            worker = self.workers.get(uid)
        if kind == "DELETED":
            if worker is not None:
                worker.gone()
            return
        if worker is not None:
            worker.update(pod)
            return
        if not wants_local_runtime(pod) or not self._is_local_node(pod["spec"].get("nodeName")):
            return
        phase = (pod.get("status") or {}).get("phase")
        if phase in ("Succeeded", "Failed"):
            return
        worker = PodWorker(pod, self.api, self.options, on_exit=self._forget)
        with self._lock:
            self.workers[uid] = worker
        logger.info("%s/%s: taking the pod (node %s)", worker.namespace, worker.name, pod["spec"]["nodeName"])
        worker.start()

    def _forget(self, worker: PodWorker) -> None:
        with self._lock:
            if self.workers.get(worker.uid) is worker:
                del self.workers[worker.uid]

    def _watch_loop(self, namespace: str) -> None:
        from kubernetes import watch

        while not self._stop.is_set():
            try:
                listing = self.api.list_pods(namespace)
                if self.options.hosts is not None:
                    self.options.hosts.listed(namespace, listing["items"])
                seen = set()
                for pod in listing["items"]:
                    seen.add(pod["metadata"]["uid"])
                    self._route("MODIFIED", pod)
                with self._lock:
                    vanished = [w for uid, w in self.workers.items() if w.namespace == namespace and uid not in seen]
                for worker in vanished:
                    worker.gone()
                version = listing["metadata"]["resourceVersion"]
                self._watches[namespace] = stream = watch.Watch(return_type="object")  # plain dicts, as raw_object
                for event in stream.stream(self.api.core.list_namespaced_pod, namespace, resource_version=version,
                                           timeout_seconds=60, allow_watch_bookmarks=True):
                    if self._stop.is_set():
                        return
                    kind, pod = event["type"], event["raw_object"]
                    if kind == "ERROR":
                        break  # e.g. 410 Gone: list again
                    if kind != "BOOKMARK":
                        self._route(kind, pod)
            except Exception as error:  # noqa: BLE001 - the API server restarting, a timeout: list again
                if self._stop.is_set():
                    return
                logger.warning("pod watch of %s failed (%s); listing again", namespace, error)
                self._stop.wait(1.0)
