"""The Service's ready endpoints, refreshed in the background: what a kube-proxy would route to.
With spec.routing.mode Router (the whole loop's) that is the router pod: the load goes through
the product's own routing, never to engine pods the harness picked. The Service's selector is
re-read on every refresh, since the operator moves it to the router once a router pod is ready.

Read as the EndpointSlice controller computes them, from the pods the Service selects: Ready,
not terminating, with the container port the Service's targetPort names. (The EndpointSlices
themselves stay empty here: the API refuses loopback addresses in them, and the pod IPs are
127.10.x.y.) A terminating pod leaves the list at once, during its preStop sleep, before its
engine starts to drain."""

from __future__ import annotations

import json
import threading

from iterserve.router.discovery import ready_urls


class ReadyEndpoints:
    def __init__(self, api_client, namespace: str, service: str, port_name: str = "http",
                 interval: float = 0.25):
        from kubernetes import client

        self.core = client.CoreV1Api(api_client)
        self.namespace, self.service, self.port_name, self.interval = namespace, service, port_name, interval
        self.selector: dict[str, str] | None = None
        self._urls: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="ready endpoints", daemon=True)

    def __call__(self) -> list[str]:
        return list(self._urls)

    def start(self) -> ReadyEndpoints:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _refresh(self) -> None:
        service = json.loads(self.core.read_namespaced_service(
            self.service, self.namespace, _preload_content=False).data)
        selector = service["spec"]["selector"]
        pods = json.loads(self.core.list_namespaced_pod(
            self.namespace, label_selector=",".join(f"{k}={v}" for k, v in selector.items()),
            _preload_content=False).data)["items"]
        self.selector, self._urls = selector, ready_urls(pods, self.port_name)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._refresh()
            except Exception:  # noqa: BLE001 - no Service yet, an API hiccup: keep the last list
                pass
            self._stop.wait(self.interval)
