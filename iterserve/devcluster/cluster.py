"""A real Kubernetes control plane on loopback: etcd, kube-apiserver, kube-controller-manager,
kube-scheduler and kwok (fake nodes), each a child process logging into one folder.

Every address is in 127.0.0.0/8: the API server, the service range (127.96.0.0/16) and the
pod IPs kwok hands out (127.10.0.0/16), so anything a test dials stays on this machine.
"""

from __future__ import annotations

import ctypes
import ipaddress
import json
import os
import random
import shutil
import signal
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from importlib import resources
from pathlib import Path

from iterserve.devcluster import tools
from iterserve.devcluster.handle import ClusterHandle
from iterserve.devcluster.kubeconfig import client_cert_user, cluster_entry, write_kubeconfig
from iterserve.devcluster.pki import FRONT_PROXY_CLIENT, write_pki
from iterserve.devcluster.waiting import free_port

SERVICE_CIDR = "127.96.0.0/16"
POD_CIDR = "127.10.0.0/16"  # each cluster takes a random /24 of it, see pod_subnet()
NODE_IP = "127.0.0.1"
STATE_FILE = "cluster.json"
# Written into a folder the cluster makes its own; only such a folder (or an empty one) is used, so
# that `--dir ~` cannot have its etcd/, pki/ or logs/ wiped or its kubeconfig overwritten.
MARKER_FILE = ".iterserve-dev-cluster"
# Folders a fresh start wipes; anything else the user keeps in the folder is left alone.
GENERATED = ("etcd", "pki", "logs", "stages")
SHUTDOWN_ORDER = (("kwok", "kube-scheduler", "kube-controller-manager"), ("kube-apiserver",), ("etcd",))


class ClusterStartError(RuntimeError):
    pass


def pod_subnet() -> str:
    """A random /24 of POD_CIDR: KWOK hands out pod IPs from the start of its range, so clusters
    running at the same time on one machine (parallel test sessions) would otherwise all give
    their first pod 127.10.0.1, and a process serving one cluster's pod would answer for another's."""
    network = ipaddress.ip_network(POD_CIDR)
    return str(list(network.subnets(new_prefix=24))[random.randrange(2 ** (24 - network.prefixlen))])


def _die_with_parent() -> None:
    """Runs in the child before exec: kill it when the parent dies without stopping it. SIGKILL,
    because an API server told to stop at the same moment as its etcd can hang for minutes."""
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"


class LocalCluster:
    """Start with `start()` (or `with LocalCluster(dir) as cluster:`), stop with `stop()`.

    detach=True starts the processes in their own session so they outlive this Python process
    (`iterserve dev-cluster up`); `stop_in(dir)` stops them later from their recorded PIDs.
    """

    def __init__(self, workdir: Path, detach: bool = False, log=print):
        self.workdir = Path(workdir).resolve()
        self.detach = detach
        self.log = log
        self.pki = self.workdir / "pki"
        self.logs = self.workdir / "logs"
        self.kubeconfig = self.workdir / "kubeconfig"
        self.processes: dict[str, subprocess.Popen] = {}
        self.ports: dict[str, int] = {}
        self.pod_cidr = pod_subnet()
        self.startup_seconds: float | None = None

    @property
    def api_url(self) -> str:
        return f"https://127.0.0.1:{self.ports['apiserver']}"

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self, timeout: float = 60) -> LocalCluster:
        claim_folder(self.workdir)
        tools.check_control_plane()
        if running_pids(self.workdir):
            raise ClusterStartError(
                f"a cluster is already running in {self.workdir}: stop it first with "
                f"`iterserve dev-cluster down --dir {self.workdir}`"
            )
        started = time.monotonic()
        deadline = started + timeout
        self._prepare_folder()
        try:
            self._spawn("etcd", self._etcd_args())
            self._spawn("kube-apiserver", self._apiserver_args())
            self._wait("etcd", deadline, self._etcd_healthy)
            self._wait("kube-apiserver", deadline, self._apiserver_ready)
            # These give up if the API server is not there yet, so they start after it.
            self._spawn("kube-controller-manager", self._controller_manager_args())
            self._spawn("kube-scheduler", self._scheduler_args())
            self._spawn("kwok", self._kwok_args())
            self._wait("kube-scheduler", deadline, self._scheduler_healthy)
            self._wait("kube-controller-manager", deadline, self._default_service_account_exists)
        except BaseException as exc:
            report = self.log_tails() if isinstance(exc, ClusterStartError | TimeoutError) else ""
            self.stop()
            if report:
                raise ClusterStartError(f"{exc}\n{report}") from exc
            raise
        self.startup_seconds = time.monotonic() - started
        self._write_state()
        return self

    def stop(self, grace: float = 10) -> None:
        """Stops the API server's clients first and etcd last: an API server whose etcd is gone
        keeps retrying instead of exiting."""
        for stage in SHUTDOWN_ORDER:
            procs = [self.processes[name] for name in stage if name in self.processes]
            for proc in procs:
                if proc.poll() is None:
                    proc.terminate()
            deadline = time.monotonic() + grace
            for proc in procs:
                try:
                    proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        self.processes.clear()
        (self.workdir / STATE_FILE).unlink(missing_ok=True)

    def memory_mb(self) -> dict[str, float]:
        """Resident memory of each component, from /proc."""
        usage = {}
        for name, proc in self.processes.items():
            status = Path(f"/proc/{proc.pid}/status").read_text()
            rss_kb = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:"))
            usage[name] = rss_kb / 1024
        return usage

    def log_tails(self, lines: int = 25) -> str:
        parts = []
        for name in ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok"):
            log_file = self.logs / f"{name}.log"
            if log_file.exists():
                parts.append(f"--- {name} ({log_file}) ---\n{_tail(log_file, lines)}")
        return "\n".join(parts)

    # --- start-up -------------------------------------------------------------------------

    def _prepare_folder(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        for name in GENERATED:
            shutil.rmtree(self.workdir / name, ignore_errors=True)
        self.logs.mkdir()
        write_pki(self.pki)
        for name in ("etcd_client", "etcd_peer", "apiserver", "controller_manager", "scheduler"):
            self.ports[name] = free_port()
        write_kubeconfig(
            self.kubeconfig,
            cluster_entry(self.api_url, self.pki / "ca.crt"),
            client_cert_user(self.pki / "admin.crt", self.pki / "admin.key"),
            "iterserve-dev",
        )
        stages = self.workdir / "stages"
        stages.mkdir()
        for stage in resources.files("iterserve.devcluster").joinpath("stages").iterdir():
            if stage.name.endswith(".yaml"):
                (stages / stage.name).write_text(stage.read_text())

    def _spawn(self, name: str, args: list[str]) -> None:
        log_file = open(self.logs / f"{name}.log", "ab")
        with log_file:
            self.processes[name] = subprocess.Popen(
                [str(tools.tool(name)), *args],
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                cwd=self.workdir,
                # Own process group either way: Ctrl-C reaches only us, and stop() shuts the
                # components down in order instead of all at once.
                start_new_session=self.detach,
                process_group=None if self.detach else 0,
                preexec_fn=None if self.detach else _die_with_parent,
            )

    def _wait(self, name: str, deadline: float, ready) -> None:
        while True:
            for proc_name, proc in self.processes.items():
                if proc.poll() is not None:
                    raise ClusterStartError(f"{proc_name} exited with code {proc.returncode} during start-up")
            try:
                if ready():
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} not ready in time")
            time.sleep(0.2)

    def _get(self, url: str, context: ssl.SSLContext | None = None) -> str:
        with urllib.request.urlopen(url, timeout=2, context=context) as response:
            return response.read().decode()

    def _admin_tls(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=str(self.pki / "ca.crt"))
        context.load_cert_chain(str(self.pki / "admin.crt"), str(self.pki / "admin.key"))
        return context

    def _etcd_healthy(self) -> bool:
        return '"health":"true"' in self._get(f"http://127.0.0.1:{self.ports['etcd_client']}/health")

    def _apiserver_ready(self) -> bool:
        return self._get(f"{self.api_url}/readyz", self._admin_tls()) == "ok"

    def _scheduler_healthy(self) -> bool:
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE  # self-signed serving certificate, loopback only
        return self._get(f"https://127.0.0.1:{self.ports['scheduler']}/healthz", context) == "ok"

    def _default_service_account_exists(self) -> bool:
        """Pods are only admitted once the controller manager has made this ServiceAccount."""
        try:
            self._get(f"{self.api_url}/api/v1/namespaces/default/serviceaccounts/default", self._admin_tls())
            return True
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return False
            raise

    # --- command lines --------------------------------------------------------------------

    def _etcd_args(self) -> list[str]:
        client = f"http://127.0.0.1:{self.ports['etcd_client']}"
        peer = f"http://127.0.0.1:{self.ports['etcd_peer']}"
        return [
            "--name=default",
            f"--data-dir={self.workdir / 'etcd'}",
            f"--listen-client-urls={client}",
            f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=default={peer}",
            "--unsafe-no-fsync",  # throwaway data; fsync only slows tests down
            "--log-level=warn",
        ]

    def _apiserver_args(self) -> list[str]:
        pki = self.pki
        return [
            "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1",
            "--endpoint-reconciler-type=none",  # else it refuses a loopback advertise address
            f"--secure-port={self.ports['apiserver']}",
            f"--etcd-servers=http://127.0.0.1:{self.ports['etcd_client']}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            f"--cert-dir={pki}",
            f"--tls-cert-file={pki / 'apiserver.crt'}",
            f"--tls-private-key-file={pki / 'apiserver.key'}",
            f"--client-ca-file={pki / 'ca.crt'}",
            f"--service-account-key-file={pki / 'sa.pub'}",
            f"--service-account-signing-key-file={pki / 'sa.key'}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            "--authorization-mode=Node,RBAC",
            # The aggregation layer: how it proxies to extension API servers (APIService objects)
            # and tells them who the user is.
            f"--requestheader-client-ca-file={pki / 'front-proxy-ca.crt'}",
            f"--requestheader-allowed-names={FRONT_PROXY_CLIENT}",
            "--requestheader-username-headers=X-Remote-User",
            "--requestheader-group-headers=X-Remote-Group",
            "--requestheader-extra-headers-prefix=X-Remote-Extra-",
            f"--proxy-client-cert-file={pki / 'front-proxy-client.crt'}",
            f"--proxy-client-key-file={pki / 'front-proxy-client.key'}",
            "--allow-privileged=true",
            "--profiling=false",
        ]

    def _component_args(self, port_name: str) -> list[str]:
        return [
            f"--kubeconfig={self.kubeconfig}",
            f"--authentication-kubeconfig={self.kubeconfig}",
            f"--authorization-kubeconfig={self.kubeconfig}",
            "--leader-elect=false",
            "--bind-address=127.0.0.1",
            f"--secure-port={self.ports[port_name]}",
            "--profiling=false",
        ]

    def _controller_manager_args(self) -> list[str]:
        pki = self.pki
        return [
            *self._component_args("controller_manager"),
            f"--service-account-private-key-file={pki / 'sa.key'}",
            f"--root-ca-file={pki / 'ca.crt'}",
            f"--cluster-signing-cert-file={pki / 'ca.crt'}",
            f"--cluster-signing-key-file={pki / 'ca.key'}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
        ]

    def _scheduler_args(self) -> list[str]:
        return self._component_args("scheduler")

    def _kwok_args(self) -> list[str]:
        stages = sorted(str(p) for p in (self.workdir / "stages").glob("*.yaml"))
        return [
            f"--kubeconfig={self.kubeconfig}",
            f"--config={','.join(stages)}",
            "--manage-all-nodes=false",
            "--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake",
            f"--cidr={self.pod_cidr}",
            f"--node-ip={NODE_IP}",
            # Heartbeats through node Leases; without them the node lifecycle controller marks every
            # KWOK node NotReady (and its pods unready) after its 50 s grace period, again and again.
            "--node-lease-duration-seconds=40",
        ]

    # --- detached clusters ----------------------------------------------------------------

    def _write_state(self) -> None:
        state = {
            "api_url": self.api_url,
            "kubeconfig": str(self.kubeconfig),
            "pids": {name: proc.pid for name, proc in self.processes.items()},
        }
        (self.workdir / STATE_FILE).write_text(json.dumps(state, indent=2))

    def cluster_handle(self) -> ClusterHandle:
        return ClusterHandle(self.kubeconfig, self.workdir, self.startup_seconds)


def claim_folder(workdir: Path) -> None:
    """Makes `workdir` the cluster's: creates it, or takes it when empty or already marked as one
    this module made. Raises ClusterStartError for a non-empty folder it did not create."""
    workdir = Path(workdir).resolve()
    if workdir.exists() and not workdir.is_dir():
        raise ClusterStartError(f"{workdir} is not a folder")
    marker = workdir / MARKER_FILE
    if workdir.is_dir() and not marker.exists() and any(workdir.iterdir()):
        raise ClusterStartError(
            f"{workdir} is not empty and was not created by `iterserve dev-cluster up`: the cluster wipes "
            f"{', '.join(GENERATED)} and writes kubeconfig there, so give it a new or empty folder")
    workdir.mkdir(parents=True, exist_ok=True)
    marker.write_text("made by iterserve dev-cluster: its etcd, pki, logs and stages are wiped on each start\n")


def running_pids(workdir: Path) -> dict[str, int]:
    """PIDs recorded for a detached cluster in `workdir` that still run our binaries."""
    state_file = Path(workdir).resolve() / STATE_FILE
    if not state_file.exists():
        return {}
    alive = {}
    for name, pid in json.loads(state_file.read_text())["pids"].items():
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except FileNotFoundError:
            continue
        if cmdline and Path(cmdline[0].decode()).name == name:
            alive[name] = pid
    return alive


def process_alive(pid: int) -> bool:
    """True unless the process is gone or a zombie (an exited child nobody reaped yet)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def stop_in(workdir: Path, grace: float = 10) -> list[str]:
    """Stops a detached cluster started in `workdir`; returns the names it stopped."""
    pids = running_pids(workdir)
    for stage in SHUTDOWN_ORDER:
        stage_pids = [pids[name] for name in stage if name in pids]
        for pid in stage_pids:
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for pid in stage_pids:
            while process_alive(pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            if process_alive(pid):
                os.kill(pid, signal.SIGKILL)
    (Path(workdir).resolve() / STATE_FILE).unlink(missing_ok=True)
    return list(pids)
