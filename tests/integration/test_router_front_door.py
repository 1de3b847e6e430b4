"""The router as a public door: raw bytes from a hostile client over a socket to a real `iterserve
router` process in front of a real `iterserve serve --fake-model` engine. Each test says what the
attack did to the router's former hand-written HTTP/1.1 framing."""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import socketserver
import threading
import time
from contextlib import contextmanager

import httpx
import pytest

from iterserve.devcluster.waiting import free_port, wait_for
from iterserve.engine import metrics as names
from tests.integration.test_router import _status, process, router
from tests.server_fixture import iterserve_command, running_server

pytestmark = pytest.mark.slow
BODY = json.dumps({"model": "fake", "prompt": [101] * 8, "max_tokens": 2, "ignore_eos": True}).encode()
HEAD = b"POST /v1/completions HTTP/1.1\r\nhost: r\r\ncontent-type: application/json\r\nconnection: close\r\n"


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    # Slowed down 5x (about 12 ms a token) so a drain test's long stream outlives the grace period;
    # prefix caching on (the fake model's default is off) for the tenant-salt test.
    log = tmp_path_factory.mktemp("engine") / "engine.log"
    args = ["--fake-model", "--max-num-seqs", "8", "--fake-step-time-scale", "5", "--enable-prefix-caching"]
    with running_server(args, log_path=log) as e:
        yield e


@pytest.fixture(scope="module")
def door(engine, tmp_path_factory):
    """(router port, engine): a router with short client deadlines."""
    with router([engine.url], tmp_path_factory.mktemp("router"), "--client-header-timeout", "1",
                "--client-body-timeout", "1") as (url, _):
        yield int(url.rsplit(":", 1)[1]), engine


def exchange(port: int, data: bytes, wait_s: float = 5.0) -> bytes:
    """Sends data, then reads until the router closes the connection (or wait_s passes)."""
    with socket.create_connection(("127.0.0.1", port), timeout=wait_s) as sock:
        try:
            sock.sendall(data)
        except OSError:
            pass  # the router stopped reading (a refused body): its answer is still there to read
        out = b""
        try:
            while chunk := sock.recv(65536):
                out += chunk
        except OSError:
            pass
        return out


def status(answer: bytes) -> int | None:
    """The status code of the first answer in answer (aiohttp says HTTP/1.0 when it could not read
    the request's version)."""
    line = answer.split(b"\r\n", 1)[0].split(b" ")
    return int(line[1]) if len(line) > 2 and line[0].startswith(b"HTTP/1.") else None


def finished(engine) -> float:
    """Requests the engine has finished, for any reason."""
    return sum(v for k, v in engine.metrics().items() if k.startswith(names.REQUESTS_TOTAL + "{"))


def with_length(extra: bytes = b"", body: bytes = BODY) -> bytes:
    return HEAD + extra + b"content-length: %d\r\n\r\n" % len(body) + body


def chunked(first_size_line: bytes) -> bytes:
    return HEAD + b"transfer-encoding: chunked\r\n\r\n" + first_size_line + b"\r\n" + BODY + b"\r\n0\r\n\r\n"


def test_a_well_formed_request_is_answered(door):
    port, _ = door
    assert exchange(port, with_length()).startswith(b"HTTP/1.1 200")
    assert exchange(port, chunked(b"%x" % len(BODY))).startswith(b"HTTP/1.1 200")


# Each was forwarded to the engine (whose parser splits on a bare LF) and answered 200, or, for
# the chunk sizes, taken by int(line, 16) so the body cap never triggered and the connection hung.
REFUSED = {
    "bare LF in a header value": with_length(b"x-a: 1\nx-b: 2\r\n"),
    "a second request hidden after LF LF": with_length(b"x-a: 1\n\nGET /v1/models HTTP/1.1\nhost: r\r\n"),
    "bare CR in a header value": with_length(b"x-a: 1\rx-b: 2\r\n"),
    "NUL in a header value": with_length(b"x-a: 1\x002\r\n"),
    "bare LF in the request line": HEAD.replace(b"HTTP/1.1\r\n", b"HTTP/1.1\n", 1) + b"content-length: %d\r\n\r\n"
    % len(BODY) + BODY,
    "obs-fold": with_length(b"x-a: 1\r\n 2\r\n"),
    "whitespace in a header name": with_length(b"x-a : 1\r\n"),
    "two Content-Lengths": HEAD + b"content-length: %d\r\ncontent-length: %d\r\n\r\n" % (len(BODY), len(BODY)) + BODY,
    "conflicting Content-Lengths": HEAD + b"content-length: %d\r\ncontent-length: 5\r\n\r\n" % len(BODY) + BODY,
    "Content-Length beside Transfer-Encoding": with_length(b"transfer-encoding: chunked\r\n"),
    "a Content-Length with a sign": HEAD + b"content-length: +%d\r\n\r\n" % len(BODY) + BODY,
    "a hex Content-Length": HEAD + b"content-length: 0x%x\r\n\r\n" % len(BODY) + BODY,
    "a negative chunk size": chunked(b"-1"),
    "a 0x chunk size": chunked(b"0x%x" % len(BODY)),
    "an underscore in a chunk size": chunked(b"1_%x" % (len(BODY) - 16)),
}


@pytest.mark.parametrize("attack", REFUSED)
def test_framing_attacks_get_400_and_never_reach_the_engine(door, attack):
    port, engine = door
    before = finished(engine)
    started = time.monotonic()
    answer = exchange(port, REFUSED[attack])
    assert status(answer) == 400, answer[:200]
    assert b'"type": "invalid_request_error"' in answer  # OpenAI's error shape, not aiohttp's plain text
    assert time.monotonic() - started < 3  # answered, not left hanging until the client gives up
    assert finished(engine) == before


def test_bodies_over_the_engines_cap_get_413(door):
    # Before: a 16 MiB cap, twice the engine's, and none at all for a negative chunk size.
    port, _ = door
    cap = 8 * 1024 * 1024
    answer = exchange(port, HEAD + b"content-length: %d\r\n\r\n" % (cap + 1))  # refused before the body
    assert answer.startswith(b"HTTP/1.1 413") and b"--max-request-body" in answer
    chunk = b"100000\r\n" + b"x" * 0x100000 + b"\r\n"
    answer = exchange(port, HEAD + b"transfer-encoding: chunked\r\n\r\n" + chunk * 9 + b"0\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 413")


def _closed_within(sock: socket.socket, seconds: float, trickle: bytes) -> float | None:
    """Sends a byte of trickle every 0.1 s; when the router closes the connection, the seconds
    it took (None if it never did)."""
    started = time.monotonic()
    for byte in trickle:
        if select.select([sock], [], [], 0.1)[0]:
            data = sock.recv(4096)
            if not data or data.startswith(b"HTTP/1.1 408"):
                return time.monotonic() - started
        if time.monotonic() - started > seconds:
            return None
        try:
            sock.send(bytes([byte]))
        except OSError:
            return time.monotonic() - started
    return None


def test_slow_loris_heads_and_bodies_are_cut(door):
    # Before: no deadline at all; a byte every few seconds kept a connection (and its buffers) forever.
    port, _ = door
    with socket.create_connection(("127.0.0.1", port)) as sock:
        took = _closed_within(sock, 5, b"POST /v1/completions HTTP/1.1\r\n" + b"x-a: 1\r\n" * 100)
        assert took is not None and took < 3
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(HEAD + b"content-length: %d\r\n\r\n" % len(BODY))
        took = _closed_within(sock, 5, BODY)
        assert took is not None and took < 3


def test_connections_over_the_cap_get_503_at_once(engine, tmp_path):
    # Before: no cap; every connection was served by one more coroutine and buffer.
    with router([engine.url], tmp_path, "--max-connections", "3") as (url, _):
        port = int(url.rsplit(":", 1)[1])
        held = [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]
        time.sleep(0.3)
        started = time.monotonic()
        answer = exchange(port, b"GET /health HTTP/1.1\r\nhost: r\r\n\r\n")
        assert answer.startswith(b"HTTP/1.1 503") and b"--max-connections" in answer
        assert time.monotonic() - started < 2
        held.pop().close()
        time.sleep(0.3)
        assert exchange(port, b"GET /health HTTP/1.1\r\nhost: r\r\nconnection: close\r\n\r\n").startswith(b"HTTP/1.1 200")
        for sock in held:
            sock.close()


class _Smuggler(socketserver.BaseRequestHandler):
    """An upstream whose first answer carries a second, hidden one (as a smuggled request's answer
    would sit on the connection); every later answer is `fresh`. Counts connections."""

    connections = 0
    hidden_answers_left = 0
    delay_s = 0.0

    def handle(self):
        buf, counted = b"", False
        while True:
            while b"\r\n\r\n" not in buf:
                data = self.request.recv(65536)
                if not data:
                    return
                buf += data
            head, _, buf = buf.partition(b"\r\n\r\n")
            length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)
            while len(buf) < length:
                buf += self.request.recv(65536)
            buf = buf[length:]
            if head.startswith((b"GET /metrics", b"GET /v1/models")):  # the router's scrapes
                gauge = b"vllm:num_requests_running 0\n" if head.startswith(b"GET /metrics") else b'{"data": []}'
                self.request.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(gauge), gauge))
                continue
            if not counted:
                type(self).connections += 1
                counted = True
            if type(self).hidden_answers_left:
                type(self).hidden_answers_left -= 1
                self.request.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                time.sleep(type(self).delay_s)  # 0: in the same write; else once the connection is idle
                self.request.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 6\r\n\r\nSECRET")
            else:
                self.request.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nfresh")


@contextmanager
def smuggler():
    server = socketserver.ThreadingTCPServer(("127.0.0.1", free_port()), _Smuggler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("delay_s", [0.0, 0.3])
def test_an_upstream_connection_with_unread_bytes_is_never_reused(tmp_path, delay_s):
    # Before: the pooled connection went back with the hidden answer buffered, and the next
    # user's request read `SECRET`, another request's answer. aiohttp's pool alone closes such a
    # connection only when the bytes came before the answer was done (delay 0), not when they
    # arrive while it sits idle (delay 0.3 s).
    _Smuggler.connections, _Smuggler.hidden_answers_left, _Smuggler.delay_s = 0, 1, delay_s
    with smuggler() as upstream, router([upstream], tmp_path) as (url, _):
        with httpx.Client(timeout=10) as client:
            assert client.post(f"{url}/v1/completions", json={}).text == "ok"
            time.sleep(delay_s + 0.2)
            assert [client.post(f"{url}/v1/completions", json={}).text for _ in range(3)] == ["fresh"] * 3
        assert _Smuggler.connections >= 2


def test_client_kv_transfer_params_never_reach_an_engine(door):
    # Before: forwarded as sent, and every engine (role both included) dialed the client's
    # host:port for "its" KV: an SSRF and port scanner inside the cluster, and poisoned KV.
    port, engine = door
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.settimeout(1.0)
        target = listener.getsockname()[1]
        params = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": target, "host": "127.0.0.1",
                  "port": target, "transfer_id": "t", "engine_id": "e", "block_ids": [0], "num_tokens": 16,
                  "block_size": 16, "compat_hash": "x", "lease_expires_at": time.time() + 30, "lease_secret": "s"}
        plain = json.dumps({**json.loads(BODY), "kv_transfer_params": params})
        escaped = plain.replace('"kv_transfer_params"', '"kv\\u005ftransfer_params"')  # the same key to JSON
        headers = {"content-type": "application/json"}
        # The engine itself refuses them (unsigned), so a 200 through the router shows they were removed.
        assert httpx.post(f"{engine.url}/v1/completions", content=plain, headers=headers, timeout=30).status_code == 400
        for body in (plain, escaped):
            answer = httpx.post(f"http://127.0.0.1:{port}/v1/completions", content=body, headers=headers, timeout=30)
            assert answer.status_code == 200, answer.text
        with pytest.raises(TimeoutError):
            listener.accept()


def test_tenants_never_share_prefix_cache_kv(engine, tmp_path):
    # Before: one cache for everyone, and a client's own cache_salt chose whose KV it shared;
    # hit counters and timing told one user whether another had sent a prefix.
    key = tmp_path / "salt.key"
    key.write_bytes(os.urandom(32))
    with router([engine.url], tmp_path, "--tenant-salt-header", "X-Tenant", "--tenant-salt-key-file", str(key)) as (url, _):
        body = {"model": "fake", "prompt": [(7 * i) % 250 + 3 for i in range(64)], "max_tokens": 1, "cache_salt": "shared"}

        def hits_after(tenant: str) -> float:
            answer = httpx.post(f"{url}/v1/completions", json=body, headers={"X-Tenant": tenant}, timeout=30)
            assert answer.status_code == 200, answer.text
            return engine.metrics().get(names.PREFIX_CACHE_HITS_TOTAL, 0.0)

        before = engine.metrics().get(names.PREFIX_CACHE_HITS_TOTAL, 0.0)
        first_a, second_a, first_b = hits_after("a"), hits_after("a"), hits_after("b")
        assert first_a == before  # nothing cached yet
        assert second_a >= first_a + 48  # a tenant shares its own prefix (3 full blocks of 16)
        assert first_b == second_a  # another tenant, the same prompt and client salt: no hit
        missing = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
        assert missing.status_code == 400 and "X-Tenant" in missing.json()["error"]["message"]


def _stream(url: str, max_tokens: int, started: threading.Event, out: list) -> None:
    body = {"model": "fake", "prompt": [101] * 8, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    text = ""
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as answer:
            for chunk in answer.iter_text():
                text += chunk
                started.set()
    except httpx.HTTPError as error:
        text += f"<{type(error).__name__}>"
    out.append(text)


def test_sigterm_finishes_requests_in_grace_then_cuts_with_an_error_event(engine, tmp_path):
    # Before: SIGTERM closed the router at once and cut every stream; the OpenAI SDK read the
    # EOF without [DONE] as a finished (truncated) answer.
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [*iterserve_command(), "router", "--port", str(port), "--endpoints", engine.url, "--drain-grace", "3"]
    with process(command, tmp_path / "router.log") as proc:
        wait_for(lambda: _status(f"{url}/health") == 200, 30, 0.1, what="router up")
        short, long, blocked = [], [], []
        events = [threading.Event(), threading.Event()]
        threads = [threading.Thread(target=_stream, args=(url, 2000, events[0], long)),
                   threading.Thread(target=_stream, args=(url, 100, events[1], short)),
                   threading.Thread(target=lambda: blocked.append(httpx.post(
                       f"{url}/v1/completions", json={**json.loads(BODY), "max_tokens": 2000}, timeout=60)))]
        for thread in threads:
            thread.start()
        assert all(e.wait(30) for e in events)
        time.sleep(0.2)  # the non-streamed one is in flight too
        proc.send_signal(signal.SIGTERM)
        started = time.monotonic()
        time.sleep(0.5)
        with pytest.raises(OSError):  # no longer accepting
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
        assert proc.wait(15) == 0
        took = time.monotonic() - started
        for thread in threads:
            thread.join(30)
    assert short[0].endswith("data: [DONE]\n\n")  # finished within the grace period
    assert "[DONE]" not in long[0]
    last = long[0].rstrip("\n").rsplit("\n\n", 1)[-1]
    assert json.loads(last.removeprefix("data: "))["error"]["code"] == "router_draining"
    assert blocked[0].status_code == 503 and blocked[0].json()["error"]["code"] == "router_draining"
    assert 2.5 < took < 10
