"""`iterserve serve --role prefill` and `--role decode` as real processes (fake model): the prefill
call's answer carries kv_transfer_params, the decode call pulls the KV over TCP and answers as a
plain engine would (completions and streamed chat); /metrics shows the transfer and the lease
coming and going; an unpulled lease expires on an idle server; role and shape refusals are 400s
naming the field; a draining prefill engine waits for its lease to be pulled before it exits. The router's P/D path is tested in test_disaggregation*.py.

The attacks on KV transfer run here against real processes too: a client's kv_transfer_params on
role both and unsigned ones on role decode (no dial), frame headers declaring 1 GiB at the KV port
(no memory), a wrong lease secret (no KV) and a reader that stops reading (cut at the lease's
expiry)."""

from __future__ import annotations

import json
import signal
import socket
import threading
import time
from contextlib import contextmanager

import httpx
import pytest

from iterserve.engine import metrics as names
from iterserve.engine.kv_transfer import wire
from tests.kv_auth_helpers import key_file, remote_decode
from tests.server_fixture import running_server

PROMPT = "the quick brown fox jumps over the lazy dog " * 4  # 176 fake tokens: 11 blocks of 16
KEY = ["--kv-auth-key-file", key_file()]


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=30)


@pytest.mark.slow
def test_prefill_then_decode_over_http_with_metrics_and_lease_expiry():
    with (running_server(["--fake-model", "--role", "prefill", "--kv-lease-seconds", "5", *KEY]) as prefill,
          running_server(["--fake-model", "--role", "decode", *KEY]) as decode):
        both = decode  # a decode engine serves plain requests too: the reference answers
        plain = post(both, "/v1/completions", {"prompt": PROMPT, "max_tokens": 10, "temperature": 0})
        assert "kv_transfer_params" not in plain.json()

        first = post(prefill, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "stream": False, "n": 1,
                                                 "kv_transfer_params": remote_decode()})
        assert first.status_code == 200, first.text
        params = first.json()["kv_transfer_params"]
        assert set(params) == {"transfer_id", "engine_id", "host", "port", "block_ids", "num_tokens", "block_size",
                               "compat_hash", "lease_expires_at", "lease_secret", "expires_at", "mac"}
        assert params["num_tokens"] == 176 and len(params["block_ids"]) == 11 and params["host"] == "127.0.0.1"
        assert 0 < params["lease_expires_at"] - time.time() <= 5
        assert prefill.metrics()[names.KV_PINNED_BLOCKS] == 11

        second = post(decode, "/v1/completions", {"prompt": PROMPT, "max_tokens": 10, "temperature": 0,
                                                  "kv_transfer_params": {**params, "do_remote_prefill": True}})
        assert second.status_code == 200, second.text
        assert second.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]
        assert "kv_transfer_params" not in second.json()
        m = decode.metrics()
        assert m[f"{names.KV_TRANSFER_SECONDS}_count"] == 1 and m[f"{names.KV_TRANSFER_BYTES}_sum"] > 11 * 16 * 4
        assert m[names.KV_TRANSFER_FAILURES_TOTAL] == 0 and m[names.WAITING_FOR_KV_REQUESTS] == 0
        prefill.wait_metric(names.KV_PINNED_BLOCKS, lambda v: v == 0)  # released by the decode engine
        assert prefill.metrics()[names.KV_TRANSFER_EXPIRED_TOTAL] == 0

        # A streamed chat decode call; a prefill of the same messages first.
        chat = {"messages": [{"role": "user", "content": "tell me a story"}], "max_tokens": 6, "temperature": 0}
        leased = post(prefill, "/v1/chat/completions", {**chat, "max_tokens": 1,
                                                        "kv_transfer_params": remote_decode()})
        kv = {**leased.json()["kv_transfer_params"], "do_remote_prefill": True}
        streamed = post(decode, "/v1/chat/completions", {**chat, "stream": True, "kv_transfer_params": kv})
        events = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
        text = "".join(e["choices"][0]["delta"].get("content", "") for e in events)
        assert text == post(both, "/v1/chat/completions", chat).json()["choices"][0]["message"]["content"]
        assert decode.metrics()[f"{names.KV_TRANSFER_SECONDS}_count"] == 2

        # A lease nobody pulls expires on an idle prefill server; a pull after that recomputes.
        late = post(prefill, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1,
                                                 "kv_transfer_params": remote_decode()})
        assert prefill.metrics()[names.KV_PINNED_BLOCKS] == 11
        prefill.wait_metric(names.KV_TRANSFER_EXPIRED_TOTAL, lambda v: v == 1, timeout=15)
        assert prefill.metrics()[names.KV_PINNED_BLOCKS] == 0
        after = post(decode, "/v1/completions", {"prompt": PROMPT, "max_tokens": 10, "temperature": 0,
                                                 "kv_transfer_params": {**late.json()["kv_transfer_params"],
                                                                        "do_remote_prefill": True}})
        assert after.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]
        assert decode.metrics()[names.KV_TRANSFER_FAILURES_TOTAL] == 1
        for server in (prefill, decode):
            assert server.metrics()[names.KV_CACHE_USAGE] == 0.0

        # Refusals, each naming its field.
        def refused(server, path, body, param):
            response = post(server, path, body)
            assert response.status_code == 400, response.text
            assert response.json()["error"]["param"] == param, response.text
            return response.json()["error"]["message"]

        assert "--role decode" in refused(decode, "/v1/completions", {"prompt": "x", "max_tokens": 1,
                                          "kv_transfer_params": remote_decode()},
                                          "kv_transfer_params.do_remote_decode")
        refused(prefill, "/v1/completions", {"prompt": "x", "max_tokens": 1,
                                             "kv_transfer_params": {"do_remote_decode": True}}, "kv_transfer_params.mac")
        assert "--role prefill" in refused(prefill, "/v1/completions", {"prompt": "x", "kv_transfer_params": kv},
                                           "kv_transfer_params.do_remote_prefill")
        refused(prefill, "/v1/completions", {"prompt": "x", "stream": True,
                                             "kv_transfer_params": {"do_remote_decode": True}}, "stream")
        refused(prefill, "/v1/completions", {"prompt": "x", "n": 2, "kv_transfer_params": {"do_remote_decode": True}},
                "kv_transfer_params")
        refused(decode, "/v1/completions", {"prompt": "x", "kv_transfer_params": {**kv, "port": "80"}},
                "kv_transfer_params.port")
        refused(decode, "/v1/completions", {"prompt": "x", "kv_transfer_params": [1]}, "kv_transfer_params")

        # A draining prefill engine keeps its leases until they are pulled, then exits.
        lease = post(prefill, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1,
                                                  "kv_transfer_params": remote_decode()})
        prefill.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert prefill.proc.poll() is None, "the prefill engine exited with a lease unpulled"
        failures = decode.metrics()[names.KV_TRANSFER_FAILURES_TOTAL]
        pulled = post(decode, "/v1/completions", {"prompt": PROMPT, "max_tokens": 10, "temperature": 0,
                                                  "kv_transfer_params": {**lease.json()["kv_transfer_params"],
                                                                         "do_remote_prefill": True}})
        assert pulled.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]
        assert decode.metrics()[names.KV_TRANSFER_FAILURES_TOTAL] == failures
        assert prefill.proc.wait(60) == 0


def test_serve_refuses_contradictory_kv_flags():
    import subprocess

    from tests.server_fixture import iterserve_command

    for flags, message in ((["--role", "decoder"], "invalid choice"),
                           (["--kv-lease-seconds", "0"], "--kv-lease-seconds must be above 0"),
                           (["--kv-transfer-port", "70000"], "--kv-transfer-port must be in 0..65535"),
                           (["--role", "prefill", "--scheduling", "static"], "needs --scheduling continuous"),
                           (["--role", "decode"], "--role decode needs --kv-auth-key-file"),
                           (["--role", "prefill", "--kv-max-leased-fraction", "0"], "--kv-max-leased-fraction")):
        result = subprocess.run([*iterserve_command(), "serve", "--fake-model", *flags], capture_output=True,
                                text=True, timeout=60, cwd="/")
        assert result.returncode == 2, (flags, result.stderr)
        assert message in result.stderr, (flags, result.stderr)


# -- attacks on KV transfer ---------------------------------------------------------------------------
def rss_bytes(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def listening_ports(pid: int) -> set[int]:
    import psutil

    return {c.laddr.port for c in psutil.Process(pid).net_connections("tcp") if c.status == psutil.CONN_LISTEN}


@contextmanager
def counting_listener():
    """Where an attacker points an engine: counts the connections it gets."""
    listener = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                accepted.append(listener.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield listener.getsockname()[1], accepted
    finally:
        listener.close()


def lease_params(port: int) -> dict:
    return {"transfer_id": "t", "engine_id": "e", "host": "127.0.0.1", "port": port, "block_ids": [0], "num_tokens": 4,
            "block_size": 16, "compat_hash": "h", "lease_expires_at": time.time() + 60, "lease_secret": "s",
            "do_remote_prefill": True}


@pytest.mark.slow
def test_client_kv_transfer_params_make_no_engine_dial_out():
    """Before: a completion carrying do_remote_prefill with a host:port of the client's choosing made
    the engine (role both, the default) connect there: an SSRF and port scanner inside the cluster.
    Now role both answers 400 for any kv_transfer_params and opens no KV port; role decode answers
    400 for unsigned ones; neither dials."""
    with (running_server(["--fake-model"]) as both, running_server(["--fake-model", "--role", "decode", *KEY]) as decode,
          counting_listener() as (port, accepted)):
        body = {"prompt": "abcd", "max_tokens": 2, "kv_transfer_params": lease_params(port)}
        for server, param in ((both, "kv_transfer_params"), (decode, "kv_transfer_params.mac")):
            response = post(server, "/v1/completions", body)
            assert response.status_code == 400, response.text
            assert response.json()["error"]["param"] == param
        answer = post(both, "/v1/completions", {"prompt": "x", "max_tokens": 1, "kv_transfer_params": remote_decode()})
        assert answer.status_code == 400 and "kv_transfer_params" not in answer.json()
        time.sleep(0.2)
        assert accepted == []
        assert listening_ports(both.proc.pid) == {both.port}  # HTTP only: no KV listener on role both
        assert listening_ports(decode.proc.pid) == {decode.port}


def _hello(sock: socket.socket) -> None:
    from iterserve.engine.fake_executor import FakeExecutor

    layout = FakeExecutor(1, 0, block_size=16).kv_layout()
    wire.send_json(sock, wire.HELLO, {"layout": layout.as_dict(), "engine_id": "attacker"})
    wire.recv_json(sock, [wire.HELLO_OK])


@pytest.mark.slow
def test_the_kv_port_withstands_huge_headers_wrong_secrets_and_slow_readers():
    lease_seconds = 4
    with running_server(["--fake-model", "--role", "prefill", "--kv-lease-seconds", str(lease_seconds), *KEY]) as prefill:
        params = post(prefill, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1,
                                                   "kv_transfer_params": remote_decode()}).json()["kv_transfer_params"]
        kv_port = params["port"]
        # Before: two 20-byte headers declaring 1 GiB each grew the engine's RSS by 2,048 MB (the
        # payload buffer was allocated before a byte of it arrived).
        before = rss_bytes(prefill.proc.pid)
        huge = [socket.create_connection(("127.0.0.1", kv_port), timeout=5) for _ in range(2)]
        for sock, msg_type in zip(huge, (wire.HELLO, wire.LAYER), strict=True):
            sock.sendall(wire.HEADER.pack(wire.MAGIC, wire.VERSION, msg_type, 1 << 30, 0))
        for sock in huge:
            assert sock.recv(1) == b""  # refused and closed, not waiting for 1 GiB
            sock.close()
        assert rss_bytes(prefill.proc.pid) - before < 50 * 1024**2

        # Before: PULL needed only the transfer id (visible to anyone the answer passed), so any pod
        # could read another user's prompt KV.
        with socket.create_connection(("127.0.0.1", kv_port), timeout=5) as sock:
            _hello(sock)
            wire.send_json(sock, wire.PULL, {"transfer_id": params["transfer_id"], "lease_secret": "guess",
                                             "first_block": 0, "num_blocks": len(params["block_ids"])})
            kind, body = wire.recv_json(sock, [wire.ERROR])
            assert kind == wire.ERROR and "with that secret" in body["error"]
            assert sock.recv(1) == b""

        # Before: a reader that stopped reading held the connection (and the lease's blocks) for as
        # long as it kept the 30 s idle timer alive; now the lease's expiry cuts it.
        params = post(prefill, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1,
                                                   "kv_transfer_params": remote_decode()}).json()["kv_transfer_params"]
        with socket.create_connection(("127.0.0.1", kv_port), timeout=lease_seconds + 10) as sock:
            _hello(sock)
            wire.send_json(sock, wire.PULL, {"transfer_id": params["transfer_id"], "lease_secret": params["lease_secret"],
                                             "first_block": 0, "num_blocks": len(params["block_ids"])})
            left = params["lease_expires_at"] - time.time()
            started = time.monotonic()
            time.sleep(0.5)
            while sock.recv(65536):  # what was sent is read late, and RELEASE never comes
                pass
            cut_after = time.monotonic() - started
        assert left - 0.5 < cut_after < left + 1.0, (cut_after, left)
        prefill.wait_metric(names.KV_TRANSFER_EXPIRED_TOTAL, lambda v: v == 2, timeout=10)
        assert prefill.metrics()[names.KV_PINNED_BLOCKS] == 0
        assert prefill.proc.poll() is None


@contextmanager
def router_process(prefill, decode, key_path: str):
    import subprocess

    from iterserve.devcluster.waiting import free_port, wait_for
    from tests.server_fixture import iterserve_command

    port = free_port()
    command = [*iterserve_command(), "router", "--port", str(port), "--prefill", prefill.url, "--decode", decode.url,
               "--pd-threshold-tokens", "8", "--scrape-interval", "0.05", "--kv-auth-key-file", key_path]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd="/")
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return proc.poll() is not None or httpx.get(f"{url}/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_for(up, 30, 0.1, what="router up")
        assert proc.poll() is None
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.mark.slow
def test_the_router_signs_prefill_calls_and_a_router_with_another_key_falls_back():
    """Through `iterserve router`: with the engines' key the prompt is prefilled remotely and its KV
    pulled; a router holding another InferenceService's key gets its prefill call refused (400) and
    the decode replica prefills locally, the answer unchanged."""
    from tests.kv_auth_helpers import OTHER_KEY

    prompt = list(range(100, 164))  # 64 token ids: over the 8-token threshold
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 0}
    with (running_server(["--fake-model", "--role", "prefill", *KEY]) as prefill,
          running_server(["--fake-model", "--role", "decode", *KEY]) as decode):
        expected = post(decode, "/v1/completions", body).json()["choices"][0]["text"]
        with router_process(prefill, decode, key_file()) as url:
            answer = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
            assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == expected
            assert decode.metrics()[f"{names.KV_TRANSFER_SECONDS}_count"] == 1
        with router_process(prefill, decode, key_file(OTHER_KEY)) as url:
            answer = httpx.post(f"{url}/v1/completions", json={**body, "prompt": prompt[1:]}, timeout=30)
            assert answer.status_code == 200, answer.text
            fallbacks = httpx.get(f"{url}/metrics", timeout=5).text
            assert f'{names.ROUTER_PD_FALLBACKS_TOTAL}{{reason="status"}} 1.0' in fallbacks
        assert decode.metrics()[f"{names.KV_TRANSFER_SECONDS}_count"] == 1  # no second pull
        assert prefill.metrics()[names.KV_PINNED_BLOCKS] == 0
