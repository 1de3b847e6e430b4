"""Container probes with the kubelet's rules: a probe runs every periodSeconds after
initialDelaySeconds; its result flips after successThreshold successes or failureThreshold
failures in a row. Readiness and startup results start as failure, liveness as success; until
the startup probe succeeds the others do not run.

httpGet and tcpSocket probes dial the pod's own address (loopback here), whatever `host` the
probe names: a pod must not make the runtime dial another address for it. exec probes run in the
container where the runtime can (container mode: `podman exec`); in process mode they, and grpc
probes, count as successes."""

from __future__ import annotations

import http.client
import socket
from collections.abc import Callable
from dataclasses import dataclass, field

DEFAULTS = {"periodSeconds": 10, "timeoutSeconds": 1, "successThreshold": 1, "failureThreshold": 3,
            "initialDelaySeconds": 0}


def resolve_port(port: int | str, container: dict) -> int:
    if isinstance(port, int) or str(port).isdigit():
        return int(port)
    for entry in container.get("ports") or []:
        if entry.get("name") == port:
            return int(entry["containerPort"])
    raise ValueError(f"probe port {port!r} names no entry of the container's ports")


# (command, timeout) -> it exited 0 in time; None where the runtime cannot exec in the container
ExecCommand = Callable[[list[str], float], bool]


def check(probe: dict, host: str, container: dict, timeout: float, exec_command: ExecCommand | None = None) -> bool:
    """One probe attempt: True on success."""
    if "exec" in probe and exec_command is not None:
        return exec_command(list((probe["exec"] or {}).get("command") or []), timeout)
    if "httpGet" in probe:
        action = probe["httpGet"]
        conn = http.client.HTTPConnection(host, resolve_port(action["port"], container), timeout=timeout)
        try:
            headers = {h["name"]: h["value"] for h in action.get("httpHeaders") or []}
            conn.request("GET", action.get("path", "/"), headers={"User-Agent": "kube-probe/local", **headers})
            return 200 <= conn.getresponse().status < 400
        except OSError:
            return False
        finally:
            conn.close()
    if "tcpSocket" in probe:
        action = probe["tcpSocket"]
        try:
            with socket.create_connection((host, resolve_port(action["port"], container)),
                                          timeout=timeout):
                return True
        except OSError:
            return False
    return True


@dataclass
class ProbeState:
    kind: str  # startup, liveness, readiness
    spec: dict
    ok: bool
    next_at: float = 0.0
    successes: int = 0
    failures: int = 0
    settings: dict = field(default_factory=dict)

    @classmethod
    def for_container(cls, kind: str, spec: dict, started_at: float) -> ProbeState:
        settings = {**DEFAULTS, **{k: v for k, v in spec.items() if k in DEFAULTS}}
        return cls(kind, spec, ok=kind == "liveness", next_at=started_at + settings["initialDelaySeconds"],
                   settings=settings)

    def due(self, now: float) -> bool:
        return now >= self.next_at

    def run(self, now: float, host: str, container: dict, exec_command: ExecCommand | None = None) -> bool:
        """Probes once; returns the (possibly flipped) result."""
        self.next_at = now + self.settings["periodSeconds"]
        if check(self.spec, host, container, self.settings["timeoutSeconds"], exec_command):
            self.successes, self.failures = self.successes + 1, 0
            if self.successes >= self.settings["successThreshold"]:
                self.ok = True
        else:
            self.successes, self.failures = 0, self.failures + 1
            if self.failures >= self.settings["failureThreshold"]:
                self.ok = False
        return self.ok

    @property
    def failed_out(self) -> bool:
        return self.failures >= self.settings["failureThreshold"]
