"""Pod DNS names on the local runtime (iterserve/devcluster/podrunner/hosts.py): a pod with
spec.hostname and spec.subdomain is reachable as <hostname>.<subdomain>[.<ns>.svc[.cluster.local]]
from a pod process, through its own /etc/hosts in a private mount namespace, kept current in place
as pods come and go; the machine's own /etc/hosts is untouched."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from iterserve.devcluster.podrunner.hosts import HostsFiles, hosts_text, pod_names
from iterserve.devcluster.podrunner.launch import Launch
from iterserve.devcluster.podrunner.process import ContainerProcess


def pod(name: str, ip: str | None, hostname: str | None = None, subdomain: str | None = "llm-group") -> dict:
    spec = {"hostname": hostname or name, **({"subdomain": subdomain} if subdomain else {})}
    return {"metadata": {"name": name, "namespace": "team-a", "uid": f"uid-{name}"}, "spec": spec,
            "status": {"podIP": ip} if ip else {}}


def test_a_pod_behind_a_headless_service_gets_the_names_cluster_dns_gives_it():
    assert pod_names(pod("llm-g0-0", "127.10.0.5")) == [
        "llm-g0-0.llm-group.team-a.svc.cluster.local", "llm-g0-0.llm-group.team-a.svc", "llm-g0-0.llm-group"]
    assert pod_names(pod("web", "127.10.0.6", subdomain=None)) == []
    text = hosts_text([pod("llm-g0-1", "127.10.0.6"), pod("llm-g0-0", "127.10.0.5"), pod("pending", None)])
    assert text.splitlines()[0].startswith("127.0.0.1\tlocalhost")
    assert text.splitlines()[2:] == ["127.10.0.5\t" + " ".join(pod_names(pod("llm-g0-0", "x"))),
                                     "127.10.0.6\t" + " ".join(pod_names(pod("llm-g0-1", "x")))]


@pytest.mark.skipif(os.geteuid() != 0, reason="mount namespaces need root (the local runtime runs as root)")
def test_a_pod_process_resolves_its_group_members_by_name_and_sees_later_changes(tmp_path: Path):
    hosts = HostsFiles(tmp_path / "hosts")
    leader, worker = pod("llm-g0-0", "127.10.0.5"), pod("llm-g0-1", None)
    hosts.seen("ADDED", leader)
    hosts.seen("ADDED", worker)
    path = hosts.file_for(worker)
    before = Path("/etc/hosts").read_text()
    script = ("import socket, time\n"
              "print(socket.gethostbyname('llm-g0-0.llm-group'), flush=True)\n"
              "for _ in range(100):\n"
              "    try:\n"
              "        print(socket.gethostbyname('llm-g0-1.llm-group.team-a.svc'), flush=True); break\n"
              "    except OSError:\n"
              "        time.sleep(0.05)\n")
    launch = Launch([sys.executable, "-I", "-c", script], {"PATH": os.environ.get("PATH", "")}, "127.0.0.1", None, {},
                    hosts_file=str(path))
    process = ContainerProcess(launch, tmp_path / "pod.log", tmp_path / "work").start()
    time.sleep(0.3)
    hosts.seen("MODIFIED", pod("llm-g0-1", "127.10.0.6"))  # the worker got its IP after the start
    assert process.wait(20) and process.exit_code == 0, (tmp_path / "pod.log").read_text()
    lines = (tmp_path / "pod.log").read_text().splitlines()
    assert lines[-2:] == ["127.10.0.5", "127.10.0.6"]
    assert Path("/etc/hosts").read_text() == before


def test_a_fresh_listing_drops_the_pods_deleted_while_the_watch_was_broken(tmp_path: Path):
    hosts = HostsFiles(tmp_path / "hosts")
    leader, worker = pod("llm-g0-0", "127.10.0.5"), pod("llm-g0-1", "127.10.0.6")
    hosts.seen("ADDED", leader)
    hosts.seen("ADDED", worker)
    path = hosts.file_for(leader)
    assert "llm-g0-1.llm-group" in path.read_text()
    hosts.listed("team-a", [leader])  # llm-g0-1's DELETED event was missed
    assert "llm-g0-1.llm-group" not in path.read_text() and "llm-g0-0.llm-group" in path.read_text()
