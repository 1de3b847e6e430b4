"""Small helpers every local process harness needs: a free loopback port, polling, and stopping a
child process."""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Callable


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for(predicate: Callable[[], object], timeout: float = 30, interval: float = 0.25,
             what: str | Callable[[], str] = "condition"):
    """Polls until predicate() is truthy and returns its value; `what` (or what(), evaluated at the
    timeout) says in the TimeoutError what was awaited."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what() if callable(what) else what}")
        time.sleep(interval)


def stop_process(proc: subprocess.Popen | None, grace: float = 10) -> None:
    """SIGTERM, up to `grace` seconds to exit, then SIGKILL; nothing if it has already exited."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
