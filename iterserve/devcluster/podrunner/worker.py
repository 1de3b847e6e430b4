"""One pod's life on the local runtime, in its own thread: start the container process, probe
it, restart it when it dies (restartPolicy, with back-off), write the pod status whenever it
changes, and on deletion run preStop, SIGTERM, wait out the grace period, SIGKILL, and only then
remove the pod object (delete with grace period 0), as the kubelet's graceful deletion does."""

from __future__ import annotations

import logging
import re
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from iterserve.devcluster.podrunner.container import (
    ContainerOptions,
    PodmanContainer,
    ServiceAccountToken,
    build_container_launch,
)
from iterserve.devcluster.podrunner.hosts import HostsFiles, wants_names
from iterserve.devcluster.podrunner.launch import Launch, LaunchError, build_launch, secret_data
from iterserve.devcluster.podrunner.probes import ProbeState, check
from iterserve.devcluster.podrunner.process import ContainerProcess
from iterserve.devcluster.podrunner.status import ContainerView, StatusWriter

logger = logging.getLogger("iterserve.podrunner")
DEFAULT_GRACE_SECONDS = 30
# After preStop the kubelet gives the container at least this long to stop on SIGTERM.
MIN_GRACE_AFTER_PRESTOP = 2.0
_SLEEP_COMMAND = re.compile(r"^(?:/bin/)?sleep\s+(\d+(?:\.\d+)?)$")


class PodApi(Protocol):
    def patch_status(self, namespace: str, name: str, status: dict) -> dict: ...
    def delete_now(self, namespace: str, name: str, uid: str) -> None: ...
    def read(self, kind: str, namespace: str, name: str) -> dict | None: ...
    def service_account_kubeconfig(self, pod: dict, service_account: str, folder: Path) -> Path: ...
    def service_account_token(self, pod: dict, service_account: str) -> ServiceAccountToken: ...


@dataclass
class WorkerOptions:
    log_dir: Path
    work_dir: Path
    threads: int = 1
    tick_seconds: float = 0.2
    backoff_initial: float = 1.0
    backoff_max: float = 30.0
    backoff_reset_after: float = 60.0  # running this long clears the back-off
    container: ContainerOptions | None = None  # container mode (podman); None: local processes
    hosts: HostsFiles | None = None  # the pods' DNS names (hosts.py), process mode


def _restarts(policy: str, exit_code: int) -> bool:
    return policy == "Always" or (policy == "OnFailure" and exit_code != 0)


def _listening(host: str, port: int) -> bool:
    with socket.socket() as probe:
        probe.settimeout(0.5)
        return probe.connect_ex((host, port)) == 0


def prestop_seconds(hook: dict | None) -> float | None:
    """The seconds a sleep preStop (the sleep action, or exec of `sleep N`) asks for."""
    if not hook:
        return None
    if "sleep" in hook:
        return float(hook["sleep"]["seconds"])
    command = (hook.get("exec") or {}).get("command") or []
    text = " ".join(command[2:] if command[:2] in (["sh", "-c"], ["/bin/sh", "-c"]) else command)
    match = _SLEEP_COMMAND.match(text.strip())
    return float(match.group(1)) if match else None


class PodWorker:
    def __init__(self, pod: dict, api: PodApi, options: WorkerOptions,
                 on_exit: Callable[[PodWorker], None] = lambda worker: None):
        meta = pod["metadata"]
        self.namespace, self.name, self.uid = meta["namespace"], meta["name"], meta["uid"]
        self.api, self.options, self.on_exit = api, options, on_exit
        self._pod = pod
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._gone = False  # the pod object was removed from the API (force deletion, or ours)
        self._shutdown = False  # the runtime is stopping
        self.process: ContainerProcess | None = None
        container = pod["spec"]["containers"][0]
        self.view = ContainerView(container["name"], container.get("image", ""))
        self.writer = StatusWriter()
        self.probes: dict[str, ProbeState] = {}
        self._written_version = 0  # resourceVersion our last status write produced
        self.thread = threading.Thread(target=self._run, name=f"pod {self.namespace}/{self.name}", daemon=True)

    # --- called by the runtime's watch thread --------------------------------------------------

    def start(self) -> PodWorker:
        self.thread.start()
        return self

    def update(self, pod: dict) -> None:
        with self._lock:
            self._pod = pod
        self._wake.set()

    def gone(self) -> None:
        self._gone = True
        self._wake.set()

    def shutdown(self) -> None:
        self._shutdown = True
        self._wake.set()

    @property
    def pod(self) -> dict:
        with self._lock:
            return self._pod

    @property
    def log_path(self) -> Path:
        return self.options.log_dir / f"{self.namespace}_{self.name}_{self.view.name}.log"

    # --- the pod's life ------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._live()
        except Exception:  # noqa: BLE001 - a bug here must not leave an engine running unseen
            logger.exception("%s/%s: worker failed; stopping its process", self.namespace, self.name)
            if self.process is not None:
                self.process.stop(2)
        finally:
            self.on_exit(self)

    def _live(self) -> None:
        backoff, retry_at, finished = self.options.backoff_initial, 0.0, False
        while True:
            pod = self.pod
            if self._shutdown or self._gone:
                if self.process is not None:
                    self.process.stop(2)
                return
            if pod["metadata"].get("deletionTimestamp"):
                self._terminate(pod)
                return
            now = time.monotonic()
            if self.process is not None and self.process.poll() is not None:
                finished, retry_at, backoff = self._exited(pod, now, backoff)
            if self.process is None and not finished and now >= retry_at:
                retry_at = self._start(pod, now)
            if self.process is not None:
                self._probe(now)
                if now - self.process.started_monotonic > self.options.backoff_reset_after:
                    backoff = self.options.backoff_initial
            self._write_status(self._phase(finished))
            self._wake.wait(self.options.tick_seconds)
            self._wake.clear()

    def _launch(self, pod: dict) -> Launch:
        lookup = lambda name, kind: self._lookup(kind, name)  # noqa: E731
        workdir = self.options.work_dir / f"{self.namespace}_{self.name}"
        if self.options.container is None:
            launch = build_launch(pod, lookup, lookup, workdir, self.options.threads,
                                  self.api.service_account_kubeconfig)
            if self.options.hosts is not None and wants_names(pod):
                launch.hosts_file = str(self.options.hosts.file_for(pod))
            return launch
        return build_container_launch(pod, lookup, lookup, workdir, self.options.container,
                                      self.api.service_account_token, self._log_line)

    def _log_line(self, text: str) -> None:
        """A line of the runtime's own in the pod's log (and the runtime's), e.g. a limit not enforced."""
        logger.info("%s/%s: %s", self.namespace, self.name, text)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "a") as log:
            log.write(f"--- {text}\n")

    def _start(self, pod: dict, now: float) -> float:
        try:
            launch = self._launch(pod)
        except (LaunchError, ValueError) as error:
            reason = error.reason if isinstance(error, LaunchError) else "CreateContainerConfigError"
            if (self.view.waiting_reason, self.view.waiting_message) != (reason, str(error)):
                (logger.info if reason == "ContainerCreating" else logger.warning)(
                    "%s/%s: cannot start yet: %s", self.namespace, self.name, error)
            self.view.waiting_reason, self.view.waiting_message = reason, str(error)
            return now + 1.0
        if launch.port and _listening(launch.host, launch.port):
            message = (f"{launch.host}:{launch.port} is already served by another process (a second cluster "
                       "on this machine handing out the same pod IP?)")
            if self.view.waiting_message != message:
                logger.warning("%s/%s: cannot start: %s", self.namespace, self.name, message)
            self.view.waiting_reason, self.view.waiting_message = "RunContainerError", message
            return now + 1.0
        kind = ContainerProcess if self.options.container is None else PodmanContainer
        self.process = kind(launch, self.log_path, self.options.work_dir / f"{self.namespace}_{self.name}")
        self.process.start()
        logger.info("%s/%s: started pid %d on %s:%s (restart %d)", self.namespace, self.name, self.process.pid,
                    launch.host, launch.port, self.view.restart_count)
        container = launch.container
        self.probes = {kind: ProbeState.for_container(kind, container[f"{kind}Probe"], now)
                       for kind in ("startup", "liveness", "readiness") if container.get(f"{kind}Probe")}
        view = self.view
        view.running_since, view.pid = self.process.started_at, self.process.pid
        view.waiting_reason, view.waiting_message, view.terminated = None, "", None
        view.started = "startup" not in self.probes
        view.ready = view.started and "readiness" not in self.probes
        return now

    def _lookup(self, kind: str, name: str) -> dict[str, str] | None:
        if kind in ("configMapRef", "configMapKeyRef"):
            configmap = self.api.read("ConfigMap", self.namespace, name)
            return None if configmap is None else {**(configmap.get("data") or {})}
        secret = self.api.read("Secret", self.namespace, name)
        return None if secret is None else secret_data(secret)

    def _exited(self, pod: dict, now: float, backoff: float) -> tuple[bool, float, float]:
        """Records the exit; returns (finished for good, when to restart, next back-off)."""
        process, view = self.process, self.view
        code = process.exit_code
        terminated = {"exitCode": code, "reason": "Completed" if code == 0 else "Error",
                      "startedAt": process.started_at, "finishedAt": process.finished_at}
        self.process, self.probes = None, {}
        view.running_since, view.pid, view.ready, view.started = None, None, False, False
        policy = pod["spec"].get("restartPolicy", "Always")
        if not _restarts(policy, code):
            logger.info("%s/%s: container exited %d; restartPolicy %s: not restarting",
                        self.namespace, self.name, code, policy)
            view.terminated = terminated
            return True, now, backoff
        view.last_terminated = terminated
        view.restart_count += 1
        view.waiting_reason = "CrashLoopBackOff"
        view.waiting_message = f"back-off {backoff:.0f}s restarting failed container={view.name} pod={self.name}"
        logger.warning("%s/%s: container exited %d; restarting in %.1f s (restart %d), log %s",
                       self.namespace, self.name, code, backoff, view.restart_count, self.log_path)
        return False, now + backoff, min(backoff * 2, self.options.backoff_max)

    def _probe(self, now: float) -> None:
        host, container, view = self.process.launch.host, self.process.launch.container, self.view
        run_exec = self.process.exec if self.process.runs_exec else None
        startup = self.probes.get("startup")
        if startup is not None and not view.started:
            if startup.due(now) and startup.run(now, host, container, run_exec):
                view.started = True
                view.ready = "readiness" not in self.probes
                for kind in ("liveness", "readiness"):  # they begin once startup has passed
                    if kind in self.probes:
                        self.probes[kind].next_at = now
            elif startup.failed_out:
                self._kill_unhealthy("startup")
            return
        liveness = self.probes.get("liveness")
        if liveness is not None and liveness.due(now) and not liveness.run(now, host, container, run_exec):
            self._kill_unhealthy("liveness")
            return
        readiness = self.probes.get("readiness")
        if readiness is not None and readiness.due(now):
            view.ready = readiness.run(now, host, container, run_exec)

    def _kill_unhealthy(self, kind: str) -> None:
        grace = self.pod["spec"].get("terminationGracePeriodSeconds", DEFAULT_GRACE_SECONDS)
        logger.warning("%s/%s: %s probe failed; killing the container", self.namespace, self.name, kind)
        self.process.stop(grace)

    def _phase(self, finished: bool) -> str:
        if finished:
            return "Succeeded" if (self.view.terminated or {}).get("exitCode") == 0 else "Failed"
        if self.process is not None or self.view.restart_count:
            return "Running"
        return "Pending"

    def _write_status(self, phase: str) -> None:
        status = self.writer.build(self.view, phase)
        pod = self.pod
        # Until the watch brings back our own write, the pod it last delivered is older than it.
        fresh = int(pod["metadata"].get("resourceVersion") or 0) >= self._written_version
        if not self.writer.changed(status, pod.get("status") if fresh else None):
            return
        try:
            written = self.api.patch_status(self.namespace, self.name, status)
            self.writer.last_written = status
            self._written_version = int(written["metadata"]["resourceVersion"])
        except Exception as error:  # noqa: BLE001 - retried on the next tick
            if getattr(error, "status", None) == 404:
                self._gone = True
            else:
                logger.warning("%s/%s: status write failed: %s", self.namespace, self.name, error)

    # --- graceful deletion ---------------------------------------------------------------------

    def _terminate(self, pod: dict) -> None:
        meta, spec = pod["metadata"], pod["spec"]
        grace = meta.get("deletionGracePeriodSeconds")
        grace = spec.get("terminationGracePeriodSeconds", DEFAULT_GRACE_SECONDS) if grace is None else grace
        deadline = time.monotonic() + grace
        process = self.process
        if process is not None and process.poll() is None:
            logger.info("%s/%s: deleted; preStop, then SIGTERM, within %d s", self.namespace, self.name, grace)
            self._prestop(process, deadline)
            process.signal(signal.SIGTERM)
            remaining = max(MIN_GRACE_AFTER_PRESTOP, deadline - time.monotonic())
            if not self._wait_exit(process, remaining):
                if self._shutdown:
                    logger.info("%s/%s: the runtime is stopping; SIGKILL", self.namespace, self.name)
                else:
                    logger.warning("%s/%s: still running after the grace period; SIGKILL", self.namespace, self.name)
                process.signal(signal.SIGKILL)
                process.wait(10)
            code = process.exit_code
            logger.info("%s/%s: container exited %s", self.namespace, self.name, code)
            self.view.terminated = {"exitCode": code, "reason": "Completed" if code == 0 else "Error",
                                    "startedAt": process.started_at, "finishedAt": process.finished_at}
            self.view.running_since, self.view.pid, self.view.ready = None, None, False
            self.process = None
            if not self._gone:
                self._write_status("Succeeded" if code == 0 else "Failed")
        if not self._gone:
            try:
                self.api.delete_now(self.namespace, self.name, self.uid)
            except Exception as error:  # noqa: BLE001 - 404: somebody else removed it already
                if getattr(error, "status", None) != 404:
                    logger.warning("%s/%s: final delete failed: %s", self.namespace, self.name, error)

    def _prestop(self, process: ContainerProcess, deadline: float) -> None:
        hook = (process.launch.container.get("lifecycle") or {}).get("preStop")
        if not hook:
            return
        seconds = prestop_seconds(hook)
        if seconds is not None:
            end = min(deadline, time.monotonic() + seconds)
            while time.monotonic() < end and not self._gone and not self._shutdown and process.poll() is None:
                self._wake.wait(min(0.2, end - time.monotonic()))
                self._wake.clear()
        elif "httpGet" in hook:
            check({"httpGet": hook["httpGet"]}, process.launch.host, process.launch.container,
                  max(0.1, deadline - time.monotonic()))
        elif "exec" in hook and process.runs_exec:
            process.exec(list((hook["exec"] or {}).get("command") or []), max(0.1, deadline - time.monotonic()))
        else:
            logger.warning("%s/%s: preStop %s is not run by the local runtime", self.namespace, self.name,
                           ", ".join(hook))

    def _wait_exit(self, process: ContainerProcess, seconds: float) -> bool:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if process.wait(min(0.2, end - time.monotonic())):
                return True
            if self._shutdown or self._gone:
                break
        return process.wait(0)
