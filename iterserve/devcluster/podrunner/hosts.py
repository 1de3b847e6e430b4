"""Pod DNS names on the local runtime, as a cluster's DNS serves them for a headless Service:
`<hostname>.<subdomain>`, `.<namespace>.svc` and `.<namespace>.svc.cluster.local` -> the pod's IP,
for every pod that sets spec.hostname and spec.subdomain (a StatefulSet's pods do).

There is no cluster DNS here (pods are processes on 127.0.0.0/8 addresses), so a pod that sets
spec.subdomain runs in a private mount namespace with a hosts file of its own bind-mounted over
/etc/hosts, as the kubelet gives each pod a managed /etc/hosts: localhost, its own names, and
the names of every pod of its namespace that has them. The program resolves names with its libc
as on a cluster; nothing in the engine or the operator knows about this.

The runtime rewrites a namespace's files as its pods come, go or get an IP: in place (truncated
and written), never replaced, because a bind mount holds the file's inode. A name appears once
its pod has an IP (a cluster's DNS publishes a headless Service's not-ready pods only when the
Service says publishNotReadyAddresses; the operator's groups' Service does). Needs root (mount
namespaces); where it cannot isolate, the pod's start fails with the reason in its status.
"""

from __future__ import annotations

import ctypes
import os
import threading
from pathlib import Path

CLUSTER_DOMAIN = "cluster.local"
CLONE_NEWNS = 0x00020000
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 0x40000
LOCALHOST = "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n"


def pod_names(pod: dict) -> list[str]:
    """The DNS names a headless Service gives `pod` (none without spec.hostname and spec.subdomain)."""
    spec, namespace = pod.get("spec") or {}, pod["metadata"]["namespace"]
    host, sub = spec.get("hostname"), spec.get("subdomain")
    if not host or not sub:
        return []
    return [f"{host}.{sub}.{namespace}.svc.{CLUSTER_DOMAIN}", f"{host}.{sub}.{namespace}.svc", f"{host}.{sub}"]


def hosts_text(pods: list[dict]) -> str:
    lines = [LOCALHOST]
    for pod in sorted(pods, key=lambda p: p["metadata"]["name"]):
        address = (pod.get("status") or {}).get("podIP")
        names = pod_names(pod)
        if address and names and not pod["metadata"].get("deletionTimestamp"):
            lines.append(f"{address}\t{' '.join(names)}\n")
    return "".join(lines)


def wants_names(pod: dict) -> bool:
    return bool((pod.get("spec") or {}).get("subdomain"))


class HostsFiles:
    """The per-pod hosts files of the namespaces one runtime serves, kept current from its pod watch."""

    def __init__(self, folder: Path):
        self.folder = folder
        self._pods: dict[str, dict[str, dict]] = {}  # namespace -> pod uid -> pod
        self._files: dict[str, dict[str, Path]] = {}  # namespace -> pod uid -> its file
        self._text: dict[str, str] = {}
        self._lock = threading.Lock()

    def seen(self, kind: str, pod: dict) -> None:
        """A pod event of the runtime's watch (ADDED, MODIFIED, DELETED)."""
        meta = pod["metadata"]
        with self._lock:
            pods = self._pods.setdefault(meta["namespace"], {})
            if kind == "DELETED":
                pods.pop(meta["uid"], None)
                self._files.get(meta["namespace"], {}).pop(meta["uid"], None)
            elif pod_names(pod):
                pods[meta["uid"]] = pod
            else:
                pods.pop(meta["uid"], None)
            self._rewrite(meta["namespace"])

    def listed(self, namespace: str, pods: list[dict]) -> None:
        """A fresh listing of the namespace (after a watch broke): pods deleted meanwhile go."""
        with self._lock:
            self._pods[namespace] = {p["metadata"]["uid"]: p for p in pods if pod_names(p)}
            self._rewrite(namespace)

    def file_for(self, pod: dict) -> Path:
        """The hosts file `pod`'s process is to see as /etc/hosts (made now, kept current)."""
        meta = pod["metadata"]
        with self._lock:
            path = self.folder / f"{meta['namespace']}_{meta['name']}_{meta['uid']}.hosts"
            self._files.setdefault(meta["namespace"], {})[meta["uid"]] = path
            self.folder.mkdir(parents=True, exist_ok=True)
            _write_in_place(path, self._text.get(meta["namespace"]) or hosts_text(
                list(self._pods.get(meta["namespace"], {}).values())))
            return path

    def _rewrite(self, namespace: str) -> None:
        text = hosts_text(list(self._pods.get(namespace, {}).values()))
        if text == self._text.get(namespace):
            return
        self._text[namespace] = text
        for path in self._files.get(namespace, {}).values():
            _write_in_place(path, text)


def _write_in_place(path: Path, text: str) -> None:
    with open(path, "a+") as file:  # a+: made if missing; the same inode otherwise
        file.seek(0)
        file.truncate()
        file.write(text)


def isolate_hosts(hosts_file: str) -> None:
    """In the child before exec: a private mount namespace whose /etc/hosts is `hosts_file`."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    if libc.unshare(CLONE_NEWNS) != 0:
        raise OSError(ctypes.get_errno(), f"unshare(CLONE_NEWNS) for the pod's /etc/hosts: {os.strerror(ctypes.get_errno())}")
    if libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) != 0:
        raise OSError(ctypes.get_errno(), f"making / private: {os.strerror(ctypes.get_errno())}")
    if libc.mount(hosts_file.encode(), b"/etc/hosts", None, MS_BIND, None) != 0:
        raise OSError(ctypes.get_errno(), f"bind-mounting {hosts_file} on /etc/hosts: "
                                          f"{os.strerror(ctypes.get_errno())}")
