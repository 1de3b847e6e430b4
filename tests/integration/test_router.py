"""`iterserve router` as a process in front of real `iterserve serve --fake-model` processes:
behaviours, not timings (those are in bench/routing/router.py)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from iterserve.devcluster.waiting import free_port, wait_for
from iterserve.engine import metrics as names
from tests.server_fixture import iterserve_command, running_server

pytestmark = pytest.mark.slow
FAULT_PROXY = Path(__file__).resolve().parents[2] / "bench" / "routing" / "fault_proxy.py"  # standalone: runs by its path


@contextmanager
def process(command: list[str], log: Path):
    with open(log, "wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd="/")
        try:
            yield proc
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@contextmanager
def router(urls: list[str], tmp_path: Path, *extra: str):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / f"router-{port}.log"
    with process([*iterserve_command(), "router", "--port", str(port), "--endpoints", ",".join(urls), *extra], log) as proc:
        wait_for(lambda: proc.poll() is not None or _status(f"{url}/health") == 200, 30, 0.1, what="router up")
        assert proc.poll() is None, log.read_text()
        yield url, log


@contextmanager
def fault_proxy(upstream: str, mode: str, tmp_path: Path):
    port = free_port()
    with process([sys.executable, str(FAULT_PROXY), str(port), upstream.rsplit(":", 1)[1], mode],
                 tmp_path / f"fault-{port}.log"):
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: _listening(port), 30, 0.1, what="fault proxy up")
        yield url


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def _status(url: str) -> int | None:
    try:
        return httpx.get(url, timeout=2).status_code
    except httpx.HTTPError:
        return None


def metric(url: str, name: str, **labels) -> float | None:
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=5).text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return None


def engine_requests(url: str, reason: str = "length") -> float:
    return metric(url, names.REQUESTS_TOTAL, model_name="fake", finished_reason=reason) or 0.0


def complete(url: str, max_tokens: int = 4, stream: bool = False, **kw) -> httpx.Response:
    body = {"model": "fake", "prompt": [101] * 8, "max_tokens": max_tokens, "ignore_eos": True, "stream": stream}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60, **kw)


ENGINE = ["--fake-model", "--max-num-seqs", "2"]


@pytest.fixture(scope="module")
def two_engines(tmp_path_factory):
    logs = tmp_path_factory.mktemp("engines")
    with ExitStack() as stack:
        yield [stack.enter_context(running_server(ENGINE, log_path=logs / f"engine{i}.log")) for i in range(2)]


def test_streams_pass_through_unchanged_and_least_load_wins(two_engines, tmp_path):
    a, b = two_engines
    with router([a.url, b.url], tmp_path, "--scrape-interval", "0.05") as (url, _):
        direct = complete(a.url, stream=True).text
        routed = complete(url, stream=True).text

        def events(text):
            return [json.loads(line[5:]) if line != "data: [DONE]" else line
                    for line in text.split("\n\n") if line.startswith("data:")]

        strip = lambda e: e if isinstance(e, str) else {**e, "id": None, "created": None}  # noqa: E731
        assert [strip(e) for e in events(routed)] == [strip(e) for e in events(direct)]
        assert routed.endswith("data: [DONE]\n\n")

        # A client that sends `Expect: 100-continue` (curl, for bodies over 1 KiB) is told to go on.
        body = json.dumps({"model": "fake", "prompt": "x" * 2000, "max_tokens": 1}).encode()
        with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=10) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: r\r\ncontent-type: application/json\r\n"
                         b"expect: 100-continue\r\ncontent-length: %d\r\n\r\n" % len(body))
            assert sock.recv(100).startswith(b"HTTP/1.1 100 Continue")
            sock.sendall(body)
            assert sock.recv(100).startswith(b"HTTP/1.1 200")

        # Fill engine a (2 running + 1 waiting, sent directly); the router must send the rest to b.
        busy = httpx.Client(timeout=120)
        long = {"model": "fake", "prompt": [101] * 8, "max_tokens": 2000, "ignore_eos": True, "stream": True}
        streams = [busy.stream("POST", f"{a.url}/v1/completions", json=long) for _ in range(3)]
        try:
            for s in streams:
                s.__enter__()
            wait_for(lambda: (metric(url, names.ROUTER_ENDPOINT_LOAD, endpoint=a.url) or 0) >= 3, 10, 0.05,
                     what="the router to see engine a loaded")
            before = engine_requests(b.url)
            for _ in range(6):
                assert complete(url).status_code == 200
            assert engine_requests(b.url) == before + 6
            assert metric(url, names.ROUTER_PICKS_TOTAL, reason="least_load") >= 6
        finally:
            for s in streams:
                s.__exit__(None, None, None)
            busy.close()


def test_client_disconnect_aborts_the_engine_request(two_engines, tmp_path):
    a, _ = two_engines
    with router([a.url], tmp_path) as (url, _):
        body = {"model": "fake", "prompt": [101] * 8, "max_tokens": 2000, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=30) as client, client.stream("POST", f"{url}/v1/completions", json=body) as r:
            assert r.status_code == 200
            next(r.iter_lines())
        wait_for(lambda: engine_requests(a.url, "abort") >= 1, 10, 0.05, what="the engine to abort the request")
        wait_for(lambda: metric(url, names.ROUTER_ENDPOINT_IN_FLIGHT, endpoint=a.url) == 0, 10, 0.05,
                 what="the router's in-flight count back to 0")


def test_failing_metrics_keep_the_replica_routable(two_engines, tmp_path):
    a, _ = two_engines
    with fault_proxy(a.url, "metrics-500", tmp_path) as faulty, router([faulty], tmp_path) as (url, log):
        wait_for(lambda: metric(url, names.ROUTER_STALE_ENDPOINTS) == 1, 10, 0.05, what="the endpoint counted stale")
        for _ in range(4):
            assert complete(url).status_code == 200
        assert metric(url, names.ROUTER_ENDPOINT_ROUTABLE, endpoint=faulty) == 1
        assert "routing on local counts" in log.read_text()


def test_refused_requests_eject_and_retry_elsewhere(two_engines, tmp_path):
    a, b = two_engines
    with fault_proxy(a.url, "reset-requests", tmp_path) as faulty, router([faulty, b.url], tmp_path) as (url, log):
        statuses = [complete(url).status_code for _ in range(12)]
        assert statuses == [200] * 12
        assert metric(url, names.ROUTER_RETRIES_TOTAL) >= 1
        assert metric(url, names.ROUTER_EJECTIONS_TOTAL, endpoint=faulty) >= 1
        assert f"ejected {faulty}" in log.read_text()


def test_saturated_is_429_with_retry_after_and_none_ready_is_503(tmp_path):
    with running_server(["--fake-model", "--max-num-seqs", "1", "--fake-step-time-scale", "5"],
                        log_path=tmp_path / "engine.log") as engine, \
            router([engine.url], tmp_path, "--max-queue", "0", "--queue-timeout", "0.3") as (url, _):
        wait_for(lambda: metric(url, names.ROUTER_STALE_ENDPOINTS) == 0
                 and metric(url, names.ROUTER_ENDPOINT_ROUTABLE, endpoint=engine.url) == 1, 10, 0.05,
                 what="a first scrape")
        time.sleep(0.3)
        body = {"model": "fake", "prompt": [101] * 8, "max_tokens": 2000, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=30) as client, client.stream("POST", f"{url}/v1/completions", json=body) as r:
            assert r.status_code == 200
            refused = complete(url)
            assert refused.status_code == 429
            assert refused.headers["retry-after"] == "1"
            assert refused.json()["error"]["code"] == "saturated"
        assert metric(url, names.ROUTER_PICKS_TOTAL, reason="saturated") == 1

    dead = f"http://127.0.0.1:{free_port()}"
    with router([dead], tmp_path) as (url, log):
        wait_for(lambda: metric(url, names.ROUTER_ENDPOINT_ROUTABLE, endpoint=dead) == 0, 10, 0.05,
                 what="the dead endpoint ejected")
        refused = complete(url)
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert _status(f"{url}/ready") == 503


def test_help_and_bad_arguments():
    out = subprocess.run([*iterserve_command(), "router", "--help"], capture_output=True, text=True, cwd="/")
    assert out.returncode == 0 and "--endpoints" in out.stdout and "--infsvc" in out.stdout
    out = subprocess.run([*iterserve_command(), "router"], capture_output=True, text=True, cwd="/")
    assert out.returncode == 2 and "exactly one of" in out.stderr


def test_prefix_affinity_keeps_a_prefix_on_one_replica(two_engines, tmp_path):
    a, b = two_engines
    with router([a.url, b.url], tmp_path, "--prefix-affinity") as (url, _):
        before = [engine_requests(e.url) for e in (a, b)]
        body = {"model": "fake", "prompt": list(range(100, 164)), "max_tokens": 2, "ignore_eos": True}
        for _ in range(5):
            assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200
        served = sorted(engine_requests(e.url) - n for e, n in zip((a, b), before, strict=True))
        assert served == [0, 5]
        assert metric(url, names.ROUTER_PICKS_TOTAL, reason="prefix_affinity") == 4
