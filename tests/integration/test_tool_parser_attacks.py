"""The tool-call parser under attack, through a real `iterserve serve --fake-model` process.

The model's text is the attacker's to steer (a prompt can make a model repeat anything), so the
server is the real one with a fake model whose output the prompt chooses (tests/fault_server.py
steered-tools: its chat template shows it the tools, so tool_choice "auto" parses the text for
hermes `<tool_call>` blocks). Each pathological output gets a bounded answer (200, its text back
as content, or the calls it holds) while other requests are answered at once, and parsing costs
little CPU beside generating the same text. The request side: a client's own earlier tool calls
(an assistant message's `tool_calls`, rendered back into the prompt) and oversized tool lists.
"""

from __future__ import annotations

import json
import os
import threading
import time

import httpx
import pytest

from tests.fault_server import STEER_SIZE, STEERED_OUTPUTS
from tests.server_fixture import running_server

pytestmark = pytest.mark.slow
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
MAX_TOKENS = STEER_SIZE + 2048  # every steered output ends with EOS before this


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("steered") / "server.log"
    args = ["--fake-model", "--fake-step-time-scale", "0", "--max-model-len", str(MAX_TOKENS + 1024),
            "--kv-cache-memory", "2GiB"]
    with running_server(args, log_path=log, fault="steered-tools") as s:
        yield s


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def steered(name: str, tool_choice: str, stream: bool = False) -> dict:
    return {"model": "fake", "messages": [{"role": "user", "content": f"STEER-TOOLS:{name}"}], "tools": TOOLS,
            "tool_choice": tool_choice, "max_tokens": MAX_TOKENS, "stream": stream}


def answer_of(url: str, body: dict) -> tuple[int, dict]:
    """(status, the message and finish reason), from a plain or a streamed answer."""
    if not body["stream"]:
        response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)
        if response.status_code != 200:
            return response.status_code, response.json()
        choice = response.json()["choices"][0]
        return 200, {**choice["message"], "finish_reason": choice["finish_reason"]}
    message: dict = {"content": "", "tool_calls": [], "finish_reason": None}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=300) as response:
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line.removeprefix("data: "))["choices"][0]
            message["content"] += choice["delta"].get("content") or ""
            message["tool_calls"] += choice["delta"].get("tool_calls") or []
            message["finish_reason"] = choice["finish_reason"] or message["finish_reason"]
        return response.status_code, message


def run_all(server, bodies: list[dict]) -> tuple[list, float]:
    """The answers to bodies sent at once, and the most CPU the server spent while one GET /health
    waited. A held event loop (a parse on it, or holding the GIL) costs CPU for as long as the
    health check waits; a machine busy with other work makes the check wait as long, but the
    server is not running then, so its CPU time, unlike the wall clock, tells the two apart."""
    answers: list = [None] * len(bodies)

    def send(i: int) -> None:
        answers[i] = answer_of(server.url, bodies[i])

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    worst = 0.0
    with httpx.Client(timeout=120) as client:
        while any(t.is_alive() for t in threads):
            started = cpu_seconds(server.proc.pid)
            assert client.get(f"{server.url}/health").status_code == 200
            worst = max(worst, cpu_seconds(server.proc.pid) - started)
            time.sleep(0.05)
    for t in threads:
        t.join()
    return answers, worst


def test_pathological_model_output_gets_a_bounded_answer_and_never_stalls_the_server(server):
    # Before: the parser's regex (a lazy body before optional whitespace) ran on the event loop and
    # was quadratic: 20 KB of spaces after <tool_call> held every other request for 17 s, and
    # "<tool_call>[[[[..." raised RecursionError, answered 500.
    pid = server.proc.pid
    names = sorted(STEERED_OUTPUTS)
    # The same texts generated without parsing (tool_choice "none"): the CPU generating them costs.
    started = cpu_seconds(pid)
    plain, _ = run_all(server, [steered(name, "none") for name in names])
    generating = cpu_seconds(pid) - started
    assert all(status == 200 for status, _ in plain), plain

    started = cpu_seconds(pid)
    bodies = [steered(name, "auto") for name in names] + [steered("spaces-unclosed", "auto", stream=True)]
    answers, cpu_during_a_health_wait = run_all(server, bodies)
    parsing = cpu_seconds(pid) - started

    for body, (status, message) in zip(bodies, answers, strict=True):
        name = body["messages"][0]["content"].split(":")[1]
        assert status == 200, (name, message)
        text = STEERED_OUTPUTS[name]
        if name == "many-blocks":  # well-formed calls: each one parsed, nothing left as content
            assert message["finish_reason"] == "tool_calls" and not message["content"]
            assert len(message["tool_calls"]) == text.count("<tool_call>")
            assert {c["function"]["name"] for c in message["tool_calls"]} == {"f"}
        else:  # no valid call: the text comes back whole, as content
            assert message["finish_reason"] == "stop" and not message.get("tool_calls")
            assert message["content"] == text
    # The event loop answered throughout: the old parser held it 10-17 s of CPU per 20 KB answer;
    # the server spends well under a second of CPU while one health check waits now, whatever else
    # loads the machine. And parsing five answers cost little beside generating four of them (the
    # old one: minutes).
    assert cpu_during_a_health_wait < 4.0, cpu_during_a_health_wait
    assert parsing < 2 * generating + 5.0, (parsing, generating)


def test_a_clients_own_tool_calls_with_pathological_arguments_get_a_bounded_answer(server):
    # Before: an assistant message's earlier call, rendered back into the prompt as hermes text,
    # had its arguments decoded with json.loads catching only ValueError: "[[[[..." (10,000 deep)
    # raised RecursionError, answered 500.
    for arguments in ("[" * 10_000, '{"a":' * 2_000, '"' + " " * 20_000):
        history = [{"role": "user", "content": "hi"},
                   {"role": "assistant", "content": None, "tool_calls": [
                       {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": arguments}}]},
                   {"role": "tool", "tool_call_id": "call_1", "content": "{}"},
                   {"role": "user", "content": "and now?"}]
        response = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                              json={"model": "fake", "messages": history, "max_tokens": 4})
        assert response.status_code == 200, response.text[:500]
        assert response.json()["usage"]["prompt_tokens"] >= len(arguments)  # kept as the text sent


def test_oversized_tool_lists_and_names_are_refused_naming_the_field(server):
    many = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]
    long_name = [{"type": "function", "function": {"name": "f" * 100_000}}]
    for tools, status in ((many, 400), (long_name, 400), (many[:128], 200)):
        response = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                              json={"model": "fake", "messages": [{"role": "user", "content": "hi"}],
                                    "tools": tools, "max_tokens": 2})
        assert response.status_code == status, response.text[:500]
        if status == 400:
            assert response.json()["error"]["param"] == "tools"
    calls = [{"id": f"c{i}", "type": "function", "function": {"name": "f", "arguments": "{}"}} for i in range(129)]
    response = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        "model": "fake", "max_tokens": 2,
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": calls}]})
    assert response.status_code == 400 and "tool_calls" in json.dumps(response.json()["error"])
