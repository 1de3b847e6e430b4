"""One container as a local child process, its output appended to the pod's log file."""

from __future__ import annotations

import ctypes
import signal
import subprocess
import time
from datetime import UTC, datetime
from pathlib import Path

from iterserve.devcluster.podrunner.hosts import isolate_hosts
from iterserve.devcluster.podrunner.launch import Launch


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL it if the runtime dies, so no engine outlives its kubelet."""
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def now_iso() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


class ContainerProcess:
    # Process mode cannot run a command inside the container: exec probes count as successes and
    # an exec preStop is skipped (logged). Container mode (container.py) runs them.
    runs_exec = False

    def __init__(self, launch: Launch, log_path: Path, cwd: Path):
        self.launch = launch
        self.log_path = log_path
        self.cwd = cwd
        self.proc: subprocess.Popen | None = None
        self.started_at = ""  # RFC 3339, for the container status
        self.started_monotonic = 0.0
        self.finished_at = ""

    def start(self) -> ContainerProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.cwd.mkdir(parents=True, exist_ok=True)
        hosts_file = self.launch.hosts_file

        def before_exec() -> None:
            _die_with_parent()
            if hosts_file:
                isolate_hosts(hosts_file)

        with open(self.log_path, "ab") as log:
            log.write(f"--- {now_iso()} start: {' '.join(self.launch.argv)}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(self.launch.argv, env=self.launch.env, cwd=self.cwd,
                                         stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         preexec_fn=before_exec)
        self.started_at, self.started_monotonic = now_iso(), time.monotonic()
        return self

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def poll(self) -> int | None:
        code = self.proc.poll() if self.proc else None
        if code is not None and not self.finished_at:
            self.finished_at = now_iso()
        return code

    @property
    def exit_code(self) -> int | None:
        """As a container runtime reports it: 128 + signal for a process killed by a signal."""
        code = self.poll()
        if code is None:
            return None
        return 128 - code if code < 0 else code

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def wait(self, timeout: float) -> bool:
        """True once the process has exited (within timeout seconds)."""
        if self.proc is None:
            return True
        try:
            self.proc.wait(timeout=max(0.0, timeout))
        except subprocess.TimeoutExpired:
            return False
        self.poll()
        return True

    def stop(self, grace: float) -> int | None:
        """SIGTERM, up to `grace` seconds, then SIGKILL. Returns the exit code."""
        self.signal(signal.SIGTERM)
        if not self.wait(grace):
            self.signal(signal.SIGKILL)
            self.wait(10)
        return self.exit_code

    def exec(self, command: list[str], timeout: float) -> bool:
        """Run `command` in the container (only where runs_exec): True when it exits 0 in time."""
        raise NotImplementedError("process mode runs no command inside a container")
