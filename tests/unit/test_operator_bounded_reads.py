"""A tenant's pod cannot OOM or stall the operator through what it answers: real sockets on
loopback serve the autoscaler's scrape and admin client a huge body, a declared-huge body, a
compressed body and a body trickled a byte at a time, and each read ends early with the limit
named. Before the caps, the huge body was read whole into memory and the trickle kept every
per-read timeout happy for as long as the pod liked."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from types import SimpleNamespace

import pytest

from iterserve.operator.autoscaling.bounded_http import (
    TIMEOUT,
    TOO_LARGE,
    BoundedReadError,
    bounded_request,
)
from iterserve.operator.autoscaling.engine_admin import AdminError, EngineAdmin
from iterserve.operator.autoscaling.metrics_source import PodEndpoint, ScrapeSource

HUGE = 1 << 30  # what the hostile pod offers: 1 GiB


class HostilePod:
    """A one-connection-at-a-time HTTP server on loopback that answers every request per `mode`,
    counting the body bytes it managed to write before the client hung up."""

    def __init__(self, mode: str):
        self.mode, self.sent = mode, 0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self._stop = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def close(self) -> None:
        self._stop.set()
        self.listener.close()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            conn.recv(65536)  # the request; its content does not matter here
            try:
                getattr(self, f"_{self.mode}")(conn)
            except OSError:  # the client gave up: what the test wants
                pass

    def _huge(self, conn):
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\n")  # no length: until close
        line = b"# padding padding padding padding padding padding padding padding\n" * 1024
        while self.sent < HUGE and not self._stop.is_set():
            conn.sendall(line)
            self.sent += len(line)

    def _declared_huge(self, conn):
        conn.sendall(f"HTTP/1.1 200 OK\r\nContent-Length: {HUGE}\r\n\r\n".encode())
        self._stop.wait(5)

    def _gzip(self, conn):
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: 4\r\n\r\nabcd")

    def _trickle(self, conn):
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 100000\r\n\r\n")
        while not self._stop.is_set():  # a byte every 0.2 s: every single read is quick
            conn.sendall(b"#")
            self.sent += 1
            time.sleep(0.2)


@pytest.fixture
def pod(request):
    server = HostilePod(request.param)
    yield server
    server.close()


def _scrape(url: str, timeout: float = 1.0) -> str:
    [sample] = asyncio.run(ScrapeSource(timeout=timeout).read([PodEndpoint("p", url)]))
    assert not sample.ok
    return sample.error


@pytest.mark.parametrize("pod", ["huge"], indirect=True)
def test_a_scrape_of_a_huge_metrics_body_stops_at_the_cap(pod):
    started = time.monotonic()
    error = _scrape(pod.url, timeout=10.0)
    assert "4194304-byte cap" in error
    assert time.monotonic() - started < 5
    time.sleep(0.2)
    # The pod offered 1 GiB; what it got out before we hung up is the cap plus socket buffers.
    assert pod.sent < 32 * 1024 * 1024


@pytest.mark.parametrize("pod", ["declared_huge"], indirect=True)
def test_a_declared_huge_body_is_refused_before_a_byte_of_it_is_read(pod):
    error = _scrape(pod.url)
    assert f"body of {HUGE} bytes is over the 4194304-byte cap" in error


@pytest.mark.parametrize("pod", ["gzip"], indirect=True)
def test_a_compressed_metrics_body_is_refused(pod):
    assert "Content-Encoding 'gzip' refused" in _scrape(pod.url)


@pytest.mark.parametrize("pod", ["trickle"], indirect=True)
def test_a_trickled_metrics_body_ends_at_the_total_deadline(pod):
    started = time.monotonic()
    error = _scrape(pod.url, timeout=1.0)
    took = time.monotonic() - started
    assert error.startswith(f"{pod.url}/metrics: timeout")
    assert 0.9 < took < 2.0, took
    assert pod.sent >= 3  # bytes kept coming, so a per-read timeout alone would never have fired


@pytest.mark.parametrize("pod", ["huge", "trickle"], indirect=True)
def test_the_admin_client_bounds_a_hostile_answer(pod):
    admin = EngineAdmin("token", timeout=1.0)
    started = time.monotonic()
    with pytest.raises(AdminError, match="65536-byte cap|timeout"):
        asyncio.run(admin.set_max_num_seqs(pod.url, 4))
    assert time.monotonic() - started < 2.5


@pytest.mark.parametrize("pod", ["trickle"], indirect=True)
def test_bounded_request_says_which_limit_was_hit(pod):
    import httpx

    async def read(max_bytes, deadline_s):
        async with httpx.AsyncClient(timeout=5) as client:
            return await bounded_request(client, "GET", pod.url, max_bytes=max_bytes, deadline_s=deadline_s)

    with pytest.raises(BoundedReadError) as late:
        asyncio.run(read(1 << 20, 0.5))
    assert late.value.kind == TIMEOUT
    with pytest.raises(BoundedReadError) as big:
        asyncio.run(read(10, 5))
    assert big.value.kind == TOO_LARGE


def test_an_autoscaler_tick_past_its_deadline_is_dropped_and_the_reconcile_still_runs():
    from iterserve.operator.autoscaling.hook import AutoscalerHook

    class SlowAutoscaler:
        metrics = None

        def due(self, *_):
            return True

        async def tick(self, **_):
            await asyncio.sleep(30)

    reconciled = []
    kube = SimpleNamespace(list_pods=lambda *_: [], list_replica_sets=lambda *_: [], get=lambda *_: None)
    spec = SimpleNamespace(autoscaling_mode="Builtin", autoscaling=SimpleNamespace(interval_seconds=10, min_replicas=1),
                           disaggregation=SimpleNamespace(enabled=False), replicas=1,
                           engine=SimpleNamespace(parallelism=SimpleNamespace(tensor=1, pipeline=1, nodes=1)))
    ctx = SimpleNamespace(spec=spec, kube=kube, namespace="ns", name="svc",
                          body={"metadata": {"name": "svc", "namespace": "ns", "uid": "u1"}},
                          reconciler=SimpleNamespace(reconcile=lambda ns, name, tick: reconciled.append(tick)))
    hook = AutoscalerHook(autoscaler=SlowAutoscaler())
    hook.tick_deadline_s = 0.5
    started = time.monotonic()
    hook(ctx)
    assert time.monotonic() - started < 2
    assert reconciled == [None]
