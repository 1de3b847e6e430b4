"""The OpenAI-compatible API of a live `iterserve serve --fake-model`, through the real openai client."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time

import httpx
import openai
import pytest

from iterserve.engine import metrics as names
from tests.server_fixture import running_server


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    with running_server(["--fake-model", "--max-model-len", "512"], log_path=log) as server:
        yield server


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def test_completion_chat_and_streaming_chat_with_the_openai_client(client, server):
    completion = client.completions.create(model="fake", prompt="Hello", max_tokens=7, temperature=0)
    assert completion.object == "text_completion"
    assert completion.choices[0].finish_reason == "length"
    assert len(completion.choices[0].text) == 7  # the fake model emits one letter (byte) per token
    assert completion.usage.prompt_tokens == 5 and completion.usage.completion_tokens == 7

    chat = client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "Hi"}], max_tokens=5)
    assert chat.choices[0].message.role == "assistant"
    assert len(chat.choices[0].message.content) == 5
    assert chat.usage.completion_tokens == 5

    chunks = list(client.chat.completions.create(
        model="fake", messages=[{"role": "user", "content": "Hi"}], max_tokens=6, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(text) == 6 and text.startswith(chat.choices[0].message.content)  # a deterministic model
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6

    assert [m.id for m in client.models.list().data] == ["fake"]


def test_streaming_completion_is_sse_ending_with_done(server):
    body = {"model": "fake", "prompt": [104, 105], "max_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in events)
    assert events[-1] == "data: [DONE]"
    payloads = [json.loads(line[6:]) for line in events[:-1]]
    assert "".join(p["choices"][0]["text"] for p in payloads) and payloads[-1]["choices"][0]["finish_reason"] == "length"
    assert all("usage" not in p for p in payloads)  # only with stream_options.include_usage


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "x", "temperature": 2.5}, "temperature"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "best_of": 3}, "best_of"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "n": 17}, "n"),
    ({"prompt": "x", "frequency_penalty": 2.5}, "frequency_penalty"),
    ({"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
    ({"prompt": "x", "min_tokens": 20, "max_tokens": 5}, "min_tokens"),
    ({"prompt": "x" * 600}, "prompt"),
    ({"prompt": "x" * 500, "max_tokens": 100}, "max_tokens"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": [[1], []]}, "prompt"),
    ({"max_tokens": 3}, "prompt"),
])
def test_invalid_requests_get_400_naming_the_field(server, body, param):
    response = httpx.post(f"{server.url}/v1/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert set(error) == {"message", "type", "param", "code"} and "Traceback" not in response.text


def test_an_unknown_model_gets_404_naming_it(server):
    response = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "model": "gpt-4"})
    assert response.status_code == 404, response.text  # vLLM's answer to a model (or LoRA adapter) it does not serve
    error = response.json()["error"]
    assert error["param"] == "model" and error["code"] == "model_not_found" and "'gpt-4'" in error["message"]


def test_bad_json_and_bad_chat_messages_get_400(server):
    response = httpx.post(f"{server.url}/v1/chat/completions", content=b'{"messages": [',
                          headers={"content-type": "application/json"})
    assert response.status_code == 400 and "JSON" in response.json()["error"]["message"]
    response = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": [{"role": "wizard", "content": "x"}]})
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages.0.role"


def test_metrics_have_every_name_once_labelled_with_the_model(server):
    httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 2}).raise_for_status()
    text = httpx.get(f"{server.url}/metrics").text
    series = [line for line in text.splitlines() if line and not line.startswith("#")]
    for name in [*names.ENGINE_METRIC_NAMES, names.VLLM_WAITING, names.VLLM_RUNNING, names.VLLM_KV_USAGE,
                 names.VLLM_PREEMPTIONS_TOTAL, names.VLLM_CACHE_CONFIG_INFO, names.VLLM_TIME_TO_FIRST_TOKEN,
                 names.VLLM_INTER_TOKEN_LATENCY]:
        own = [s for s in series if s.split("{")[0] in (name, f"{name}_count")]
        if name == names.SPEC_DECODE_ACCEPTED_TOKENS_PER_POS_TOTAL:
            assert not own  # one series per proposal position, so none while speculation is off
            continue
        assert own, f"{name} missing"
        assert all('model_name="fake"' in s for s in own)
        if name != names.REQUESTS_TOTAL:
            assert len(own) == 1, own  # exactly one series per name, for KEDA and the endpoint picker
    assert 'vllm:cache_config_info{block_size="16",model_name="fake",num_gpu_blocks=' in text
    assert "_created" not in text


def test_thirty_two_concurrent_streaming_clients_all_complete(server):
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)

    async def one(i: int) -> tuple[str, str | None]:
        stream = await client.chat.completions.create(
            model="fake", messages=[{"role": "user", "content": f"client {i}"}], max_tokens=40, stream=True)
        text, reason = "", None
        async for chunk in stream:
            text += chunk.choices[0].delta.content or ""
            reason = chunk.choices[0].finish_reason or reason
        return text, reason

    async def all_clients():
        try:
            return await asyncio.gather(*(one(i) for i in range(32)))
        finally:
            await client.close()

    started = time.monotonic()
    results = asyncio.run(all_clients())
    elapsed = time.monotonic() - started
    assert all(len(text) == 40 and reason == "length" for text, reason in results)
    metrics = server.metrics()
    assert metrics[names.WAITING_REQUESTS] == 0 and metrics[names.RUNNING_SEQS] == 0
    assert metrics[names.KV_CACHE_USAGE] == 0.0 and metrics[names.VLLM_KV_USAGE] == 0.0
    print(f"32 streaming clients x 40 tokens: {elapsed:.2f} s")


def test_loadgen_reports_latency_and_throughput(server, tmp_path):
    from iterserve.engine.loadgen import LoadSpec, run_load

    report = asyncio.run(run_load(LoadSpec(url=server.url, rate=200, requests=30, output_dist="zipf",
                                           max_tokens=24, prompt_len=8)))
    assert report["completed"] == 30 and report["failed"] == 0
    assert 30 <= report["total_output_tokens"] <= 30 * 24
    assert report["ttft_s"]["p50"] > 0 and report["itl_s"]["p99"] >= report["itl_s"]["p50"] > 0
    assert report["output_throughput_tokens_per_s"] > 0


def test_loadgen_command_prints_a_table_and_writes_json(server, tmp_path):
    from tests.server_fixture import iterserve_command

    out = tmp_path / "report.json"
    result = subprocess.run(
        [*iterserve_command(), "loadgen", "--url", server.url, "--requests", "12", "--rate", "100",
         "--output-dist", "exponential", "--max-tokens", "16", "--concurrency", "4", "--json", str(out)],
        capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "TTFT" in result.stdout and "p99" in result.stdout and "12/12 requests completed" in result.stdout
    report = json.loads(out.read_text())
    assert report["completed"] == 12 and report["config"]["concurrency"] == 4


def test_an_idle_server_does_not_spin(server):
    def cpu_seconds() -> float:
        fields = open(f"/proc/{server.proc.pid}/stat").read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime

    before = cpu_seconds()
    time.sleep(1.0)
    assert cpu_seconds() - before < 0.2  # the engine thread sleeps on its condition
