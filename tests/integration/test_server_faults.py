"""One bad request never takes a replica down, against real server processes: a request
whose sampling fails gets an error while the others finish with their greedy tokens; an engine
loop that dies turns GET /health to 503; oversized and malformed requests get 4xx error bodies (a
prompt too long for the model before it is tokenized);
SIGTERM during model loading exits at once; an idle server does not spin."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time

import httpx
import pytest

from iterserve.engine import metrics as names
from tests.server_fixture import ServerProcess, running_server

pytestmark = pytest.mark.slow
PROMPTS = [f"Here is fact number {i} about the {animal}:" for i, animal in
           enumerate(["cat", "dog", "owl", "fox", "bee", "yak"])]


def assert_openai_error(response: httpx.Response, status: int, param: str | None = None, code: str | None = None):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error


async def complete(client: httpx.AsyncClient, prompt: str, stream: bool = False) -> tuple[int, object]:
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "stream": stream}
    if not stream:
        response = await client.post("/v1/completions", json=body)
        return response.status_code, response.json()
    events = []
    async with client.stream("POST", "/v1/completions", json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                events.append(line.removeprefix("data: "))
    return response.status_code, events


def test_a_sampling_fault_fails_only_its_request_on_the_real_model(tmp_path):
    with running_server(["--max-model-len", "256", "--max-num-seqs", "16"], log_path=tmp_path / "server.log",
                        ready_timeout=300, fault="sampler-tag") as server:

        async def burst():
            async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
                jobs = [complete(client, p) for p in PROMPTS]
                jobs.insert(2, complete(client, "FAULT-TAG please fail"))
                jobs.insert(5, complete(client, "FAULT-TAG please fail while streaming", stream=True))
                return await asyncio.gather(*jobs)

        results = asyncio.run(burst())
        failed, failed_stream = results.pop(5), results.pop(2)
        assert failed[0] == 200  # a stream's status is sent before the failure
        error_event = json.loads(failed[1][-2])
        assert failed[1][-1] == "[DONE]" and error_event["error"]["code"] == "request_failed"
        assert failed_stream[0] == 500 and failed_stream[1]["error"]["code"] == "request_failed"
        assert "planted sampler fault" in failed_stream[1]["error"]["message"]
        # The others finished with the tokens each gets alone.
        with httpx.Client(base_url=server.url, timeout=120) as client:
            alone = [client.post("/v1/completions", json={"prompt": p, "max_tokens": 8, "temperature": 0,
                                                          "ignore_eos": True}).json() for p in PROMPTS]
        for (status, batched), single in zip(results, alone, strict=True):
            assert status == 200 and batched["choices"][0]["finish_reason"] == "length"
            assert batched["choices"][0]["text"] == single["choices"][0]["text"]
        server.wait_metric(names.KV_CACHE_USAGE, lambda v: v == 0)
        metrics = server.metrics()
        assert metrics[names.REQUEST_FAILURES_TOTAL] == 2 and metrics[names.ENGINE_FAILURES_TOTAL] == 0
        assert httpx.get(f"{server.url}/health").status_code == 200
        # The request: a temperature of 1e-39 samples greedily, and the next request is served.
        for temperature in (1e-39, 1.0):
            response = httpx.post(f"{server.url}/v1/completions", timeout=60,
                                  json={"prompt": "hi", "max_tokens": 4, "temperature": temperature})
            assert response.status_code == 200, response.text
        assert "failed and was finished with an error: sampling failed: RuntimeError: planted" in server.log()


def test_an_engine_loop_that_dies_turns_health_to_503(tmp_path):
    with running_server(["--fake-model"], log_path=tmp_path / "server.log", fault="engine-kill") as server:
        assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
        response = httpx.post(f"{server.url}/v1/completions", json={"prompt": "KILL-ENGINE", "max_tokens": 4})
        assert_openai_error(response, 503, code="engine_failed")
        health = httpx.get(f"{server.url}/health")
        assert health.status_code == 503 and "planted forward-pass fault" in health.json()["reason"]
        assert httpx.get(f"{server.url}/ready").status_code == 503
        assert server.metrics()[names.ENGINE_FAILURES_TOTAL] == 1
        response = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hello", "max_tokens": 4})
        assert_openai_error(response, 503, code="engine_failed")
        assert "the engine loop died (RuntimeError: planted forward-pass fault)" in server.log()


def test_oversized_and_malformed_requests_get_4xx_error_bodies(tmp_path):
    with running_server(["--fake-model"], log_path=tmp_path / "server.log") as server:
        url = f"{server.url}/v1/completions"
        big = b'{"prompt": "' + b"a" * 50_000_000 + b'", "max_tokens": 1}'
        assert_openai_error(httpx.post(url, content=big, headers={"content-type": "application/json"}, timeout=60),
                            413, code="request_too_large")
        assert_openai_error(httpx.post(url, json={"prompt": "hi", "stop_token_ids": list(range(200_000))}),
                            400, param="stop_token_ids")
        assert_openai_error(httpx.post(url, json={"prompt": ["hi"] * 5000}), 400, param="prompt")
        assert_openai_error(httpx.post(f"{server.url}/v1/chat/completions",
                                       json={"messages": [{"role": "user", "content": "hi"}] * 5000}),
                            400, param="messages")
        for path, raw, param in [
            ("/v1/completions", '{"prompt": "a\\ud800b"}', "prompt"),
            ("/v1/completions", '{"prompt": "hi", "stop": ["\\udfff"]}', "stop"),
            ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud83d"}]}',
             "messages.0.content"),
        ]:
            error = assert_openai_error(httpx.post(f"{server.url}{path}", content=raw.encode(),
                                                   headers={"content-type": "application/json"}), 400, param=param)
            assert "not valid Unicode" in error["message"]
        # A prompt that cannot fit is refused by its length before tokenizing: before, all of it was
        # tokenized first (8 MiB took seconds of a worker thread), then refused for its token count.
        huge = "a" * 1_000_000  # over 2048 tokens x 128 characters, the fake tokenizer's bound
        for path, body, param in [("/v1/completions", {"prompt": ["ok", huge]}, "prompt"),
                                  ("/v1/chat/completions", {"messages": [{"role": "user", "content": huge}]},
                                   "messages"),
                                  ("/tokenize", {"prompt": huge}, "prompt")]:
            error = assert_openai_error(httpx.post(f"{server.url}{path}", json=body, timeout=30), 400, param=param,
                                        code="context_length_exceeded")
            assert "1000000 characters" in error["message"] and "2048 tokens" in error["message"]
        counted = assert_openai_error(httpx.post(url, json={"prompt": "a" * 5000}), 400, param="prompt")
        assert "5000 tokens" in counted["message"]  # under the character bound: counted in tokens as before
        assert httpx.post(url, json={"prompt": "still serving", "max_tokens": 3}).status_code == 200


def cpu_seconds(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_an_idle_server_does_not_spin(tmp_path):
    with running_server(["--fake-model"], log_path=tmp_path / "server.log") as server:
        httpx.post(f"{server.url}/v1/completions", json={"prompt": "warm up", "max_tokens": 8}).raise_for_status()
        time.sleep(0.5)
        before = cpu_seconds(server.proc.pid)
        time.sleep(5)
        used = cpu_seconds(server.proc.pid) - before
        assert used < 0.5, f"{used:.2f} s of CPU in 5 s idle"  # a spinning engine thread uses ~5 s


def test_sigterm_while_the_model_loads_exits_at_once(tmp_path):
    server = ServerProcess(["--fake-model"], log_path=tmp_path / "server.log", fault="slow-load")
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{server.url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, server.log()
            time.sleep(0.1)
        assert httpx.get(f"{server.url}/ready").json() == {"status": "loading"}
        started = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        server.proc.wait(20)  # loading would take 120 s more
        assert time.monotonic() - started < 5 and server.proc.returncode == 0
        assert "still loading" in server.log()
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
        server.stop()
        assert isinstance(server.proc, subprocess.Popen)
