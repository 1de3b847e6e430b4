"""A live `iterserve serve` process on a free loopback port, for integration tests and benchmarks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from iterserve.devcluster.waiting import free_port  # noqa: F401  (re-exported to tests)

FAULT_SERVER = Path(__file__).with_name("fault_server.py")


def iterserve_command() -> list[str]:
    script = Path(sys.executable).parent / "iterserve"
    return [str(script)] if script.exists() else [sys.executable, "-m", "iterserve.cli"]


class ServerProcess:
    def __init__(self, args: list[str], env: dict[str, str] | None = None, log_path: Path | None = None,
                 fault: str | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        # fault: serve with a planted fault (tests/fault_server.py), for the fault-isolation tests.
        program = [sys.executable, str(FAULT_SERVER), fault] if fault else iterserve_command()
        command = [*program, "serve", "--host", "127.0.0.1", "--port", str(self.port), *args]
        self._log = open(log_path, "wb") if log_path else subprocess.DEVNULL  # noqa: SIM115
        # Not run from the repository root: its folder operator/ must not shadow the stdlib module.
        self.proc = subprocess.Popen(command, cwd=log_path.parent if log_path else "/", env={**os.environ, **(env or {})},
                                     stdout=self._log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode} before ready; log: {self.log()}")
            try:
                if httpx.get(f"{self.url}/ready", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"server not ready within {timeout} s; log: {self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:] if self.log_path else "(not captured)"

    def metrics(self) -> dict[str, float]:
        """Every sample as {'name{label="v",...}': value}, plus {'name': value} for unlabelled lookups
        of single-series metrics."""
        text = httpx.get(f"{self.url}/metrics", timeout=5.0).text
        samples: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
                samples[f"{sample.name}{{{labels}}}"] = sample.value
                samples.setdefault(sample.name, sample.value)
        return samples

    def wait_metric(self, name: str, predicate, timeout: float = 10.0) -> float:
        deadline = time.monotonic() + timeout
        while True:
            value = self.metrics().get(name)
            if value is not None and predicate(value):
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"{name} = {value} did not reach the expected value within {timeout} s")
            time.sleep(0.05)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._log is not subprocess.DEVNULL:
            self._log.close()
        return self.proc.returncode


@contextmanager
def running_server(args: list[str], env: dict[str, str] | None = None, log_path: Path | None = None,
                   ready_timeout: float = 60.0, fault: str | None = None):
    server = ServerProcess(args, env, log_path, fault)
    try:
        server.wait_ready(ready_timeout)
        yield server
    finally:
        server.stop()
