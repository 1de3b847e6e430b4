"""Overload, disconnects, live retuning, admin auth and SIGTERM drain, on live fake-model servers.

The fake model takes ~2.5 ms per decode step, so a request for 1500 tokens runs for seconds:
long enough to act on it mid-flight."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import subprocess
import threading
import time

import httpx
import pytest

from iterserve.engine import metrics as names
from iterserve.engine.config import EngineConfig
from iterserve.engine.server.app import build_app
from iterserve.engine.server.state import ServerOptions, ServerState
from tests.server_fixture import ServerProcess, running_server

LONG = {"model": "fake", "prompt": "tell me everything", "max_tokens": 1500, "stream": True}
ABORTS = f'{names.REQUESTS_TOTAL}{{finished_reason="abort",model_name="fake"}}'


def _stream_in_background(url: str, body: dict, results: list, count: int = 1) -> list[threading.Thread]:
    def one():
        try:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
                lines = [line for line in response.iter_lines() if line] if response.status_code == 200 else []
                results.append((response.status_code, lines, response.headers.get("retry-after")))
        except httpx.HTTPError as error:
            results.append((type(error).__name__, [], None))

    threads = [threading.Thread(target=one, daemon=True) for _ in range(count)]
    for thread in threads:
        thread.start()
    return threads


@pytest.mark.slow
def test_disconnect_mid_stream_or_while_waiting_frees_the_kv_blocks(tmp_path):
    with running_server(["--fake-model"], log_path=tmp_path / "log") as server:
        with httpx.stream("POST", f"{server.url}/v1/completions", json=LONG, timeout=30) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")  # generating now
            assert server.metrics()[names.RUNNING_SEQS] == 1
            assert server.metrics()[names.KV_CACHE_USAGE] > 0
        # The connection is closed mid-stream: the next engine step aborts and frees.
        server.wait_metric(names.KV_CACHE_USAGE, lambda v: v == 0, timeout=2)
        assert server.metrics()[names.RUNNING_SEQS] == 0 and server.metrics()[ABORTS] == 1

        # Non-streaming: the client gives up (timeout) while the server generates.
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{server.url}/v1/completions", json={**LONG, "stream": False}, timeout=0.5)
        server.wait_metric(ABORTS, lambda v: v == 2, timeout=2)
        assert server.metrics()[names.KV_CACHE_USAGE] == 0 and server.metrics()[names.RUNNING_SEQS] == 0


@pytest.mark.slow
def test_patch_max_num_seqs_changes_admission_on_the_live_server(tmp_path):
    # --drain-timeout 0: once checked, the server's exit aborts the long requests instead of waiting.
    args = ["--fake-model", "--max-num-seqs", "2", "--drain-timeout", "0"]
    results: list = []
    with running_server(args, log_path=tmp_path / "log") as server:
        threads = _stream_in_background(server.url, LONG, results, count=8)
        server.wait_metric(names.WAITING_REQUESTS, lambda v: v == 6, timeout=5)
        assert server.metrics()[names.RUNNING_SEQS] == 2

        response = httpx.patch(f"{server.url}/admin/config", json={"max_num_seqs": 5})
        assert response.status_code == 200 and response.json()["max_num_seqs"] == 5
        server.wait_metric(names.RUNNING_SEQS, lambda v: v == 5, timeout=1)
        assert server.metrics()[names.MAX_NUM_SEQS] == 5 and server.metrics()[names.WAITING_REQUESTS] == 3
        assert httpx.get(f"{server.url}/admin/config").json()["max_num_seqs"] == 5

        bad = httpx.patch(f"{server.url}/admin/config", json={"max_num_seqs": 0})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_num_seqs"
    for thread in threads:
        thread.join(10)
    assert [status for status, _, _ in results] == [200] * 8


@pytest.mark.slow
def test_admin_token_is_enforced(tmp_path):
    env = {"ITERSERVE_ADMIN_TOKEN": "s3cret"}
    with running_server(["--fake-model"], env=env, log_path=tmp_path / "log") as server:
        assert httpx.get(f"{server.url}/admin/config").status_code == 401
        wrong = httpx.get(f"{server.url}/admin/config", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"
        right = httpx.patch(f"{server.url}/admin/config", json={"max_num_seqs": 3},
                            headers={"Authorization": "Bearer s3cret"})
        assert right.status_code == 200 and right.json()["max_num_seqs"] == 3


def test_admin_is_refused_without_a_token_when_listening_beyond_loopback():
    options = ServerOptions(EngineConfig(model="fake"), "fake", loopback_only=False)
    app = build_app(ServerState(options))

    async def get():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            return await client.get("/admin/config")

    response = asyncio.run(get())
    assert response.status_code == 403 and "ITERSERVE_ADMIN_TOKEN" in response.json()["error"]["message"]


@pytest.mark.slow
def test_overload_answers_429_with_retry_after(tmp_path):
    args = ["--fake-model", "--max-num-seqs", "1", "--max-waiting-requests", "2"]
    with running_server(args, log_path=tmp_path / "log") as server:
        results: list = []
        threads = _stream_in_background(server.url, {**LONG, "max_tokens": 200}, results, count=10)
        for thread in threads:
            thread.join(30)
        statuses = sorted(status for status, _, _ in results)
        assert statuses.count(200) >= 3 and statuses.count(429) >= 1, statuses
        assert set(statuses) <= {200, 429}
        assert all(retry == "1" for status, _, retry in results if status == 429)
        assert server.metrics()[names.KV_CACHE_USAGE] == 0


@pytest.mark.slow
def test_sigterm_drains_in_flight_requests_then_exits_0(tmp_path):
    server = ServerProcess(["--fake-model", "--drain-timeout", "20"], log_path=tmp_path / "log")
    try:
        server.wait_ready()
        results: list = []
        threads = _stream_in_background(server.url, {**LONG, "max_tokens": 800}, results, count=2)
        server.wait_metric(names.RUNNING_SEQS, lambda v: v == 2, timeout=5)
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        assert httpx.get(f"{server.url}/ready").status_code == 503
        refused = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
        assert server.proc.poll() is None  # still serving what is in flight
        assert server.proc.wait(30) == 0
        for thread in threads:
            thread.join(5)
        for status, lines, _ in results:
            assert status == 200 and lines[-1] == "data: [DONE]"
            assert '"finish_reason":"length"' in lines[-2]
        with pytest.raises(OSError), socket.create_connection(("127.0.0.1", server.port), timeout=1):
            pass
    finally:
        server.stop()


@pytest.mark.slow
def test_bad_options_exit_2_and_a_model_that_fails_to_load_exits_1(tmp_path):
    from tests.server_fixture import iterserve_command

    contradictory = subprocess.run(
        [*iterserve_command(), "serve", "--fake-model", "--no-chunked-prefill", "--max-num-batched-tokens", "100"],
        capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert contradictory.returncode == 2
    assert "--max-num-batched-tokens" in contradictory.stderr and "--max-model-len" in contradictory.stderr
    server = ServerProcess(["--model", str(tmp_path / "missing.gguf")], log_path=tmp_path / "log")
    assert server.proc.wait(60) == 1
    assert "missing.gguf" in server.log() and "Traceback" not in server.log()
    server.stop()


@pytest.mark.slow
def test_requests_cut_at_the_drain_timeout_are_errors_not_finished_answers(tmp_path):
    # Before, a request still running at the drain timeout was answered 200 with its text so far and
    # finish_reason "abort" (a stream even ended with [DONE]): the router and the OpenAI client took
    # the truncated text for a whole answer.
    server = ServerProcess(["--fake-model", "--drain-timeout", "0.5"], log_path=tmp_path / "log")
    try:
        server.wait_ready()
        results: list = []
        threads = _stream_in_background(server.url, LONG, results)
        whole: list = []
        threads.append(threading.Thread(target=lambda: whole.append(httpx.post(
            f"{server.url}/v1/completions", json={**LONG, "stream": False}, timeout=30)), daemon=True))
        threads[-1].start()
        server.wait_metric(names.RUNNING_SEQS, lambda v: v == 2, timeout=5)
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(30) == 0
        for thread in threads:
            thread.join(5)
        [(status, lines, _)] = results
        assert status == 200 and "data: [DONE]" not in lines  # the stream was already under way
        error = json.loads(lines[-1].removeprefix("data: "))["error"]
        assert error["code"] == "request_cut" and "--drain-timeout" in error["message"]
        assert all('"finish_reason":"abort"' not in line for line in lines)
        [answer] = whole
        assert answer.status_code == 503 and answer.json()["error"]["code"] == "request_cut"
    finally:
        server.stop()
