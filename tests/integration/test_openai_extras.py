"""OpenAI extras on the fake model: fields stock clients send are accepted and named as ignored,
/tokenize and /detokenize as vLLM serves them."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from iterserve.engine.server.protocol import IGNORED_FIELDS_HEADER
from tests.server_fixture import running_server


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    with running_server(["--fake-model", "--max-model-len", "512"], log_path=log, ready_timeout=300) as server:
        yield server


def test_harmless_fields_are_accepted_and_named_in_a_header(server):
    body = {"prompt": "hello", "max_tokens": 3, "user": "u1", "metadata": {"k": "v"}, "store": False,
            "service_tier": "auto"}
    response = httpx.post(f"{server.url}/v1/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.headers[IGNORED_FIELDS_HEADER] == "user,metadata,store,service_tier"
    plain = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hello", "max_tokens": 3})
    assert IGNORED_FIELDS_HEADER.lower() not in plain.headers
    assert plain.json()["choices"][0]["text"] == response.json()["choices"][0]["text"]
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True,
            "parallel_tool_calls": True, "store": True}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=chat) as streamed:
        assert streamed.status_code == 200
        assert streamed.headers[IGNORED_FIELDS_HEADER] == "store,parallel_tool_calls"
        assert streamed.read().decode().rstrip().endswith("data: [DONE]")


def test_the_openai_client_with_its_extra_fields_works(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    chat = client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                          user="someone", metadata={"run": "1"}, store=False)
    assert chat.choices[0].message.content


@pytest.mark.parametrize("field", ["reasoning_effort", "prediction", "modalities", "made_up"])
def test_fields_that_would_change_the_output_are_still_refused(server, field):
    response = httpx.post(f"{server.url}/v1/chat/completions",
                          json={"messages": [{"role": "user", "content": "hi"}], field: "x"})
    assert response.status_code == 400 and response.json()["error"]["param"] == field


def test_tokenize_and_detokenize_round_trip(server):
    tokens = httpx.post(f"{server.url}/tokenize", json={"prompt": "hello world"}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0 and tokens["max_model_len"] == 512
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": tokens["tokens"]}).json()
    assert text == {"prompt": "hello world"}
    chat = httpx.post(f"{server.url}/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] > 0
    both = httpx.post(f"{server.url}/tokenize", json={"prompt": "x", "messages": [{"role": "user", "content": "y"}]})
    assert both.status_code == 400
    bad = httpx.post(f"{server.url}/detokenize", json={"tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_logprobs_shapes_echo_and_the_bound(server):
    body = {"prompt": "hello", "max_tokens": 3, "logprobs": 2, "echo": True}
    choice = httpx.post(f"{server.url}/v1/completions", json=body).json()["choices"][0]
    assert choice["text"].startswith("hello")
    logprobs = choice["logprobs"]
    prompt_len = len(httpx.post(f"{server.url}/tokenize", json={"prompt": "hello"}).json()["tokens"])
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == prompt_len + 3
    assert logprobs["token_logprobs"][0] is None and logprobs["text_offset"][0] == 0
    too_many = httpx.post(f"{server.url}/v1/completions", json={**body, "logprobs": 21})
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "logprobs"
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "top_logprobs": 3}
    refused = httpx.post(f"{server.url}/v1/chat/completions", json=chat)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "top_logprobs"
    ok = httpx.post(f"{server.url}/v1/chat/completions", json={**chat, "logprobs": True})
    assert ok.status_code == 200 and "content" in ok.json()["choices"][0]["logprobs"]


def test_n_choices_and_batched_prompts(server):
    body = {"prompt": [[1, 2], [5, 6, 7]], "n": 2, "max_tokens": 3}
    response = httpx.post(f"{server.url}/v1/completions", json=body).json()
    assert [c["index"] for c in response["choices"]] == [0, 1, 2, 3]
    assert response["usage"] == {"prompt_tokens": 5, "completion_tokens": 12, "total_tokens": 17}
    alone = httpx.post(f"{server.url}/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 3}).json()
    assert response["choices"][2]["text"] == alone["choices"][0]["text"]  # the fake model is deterministic
    strings = httpx.post(f"{server.url}/v1/completions", json={"prompt": ["one", "two"], "max_tokens": 2}).json()
    assert len(strings["choices"]) == 2
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "n": 3}
    assert len(httpx.post(f"{server.url}/v1/chat/completions", json=chat).json()["choices"]) == 3
    best_of = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "n": 2, "best_of": 2})
    assert best_of.status_code == 200 and len(best_of.json()["choices"]) == 2


def test_suffix_and_auto_tool_choice_without_template_tools_are_refused(server):
    response = httpx.post(f"{server.url}/v1/completions", json={"prompt": "def f(", "suffix": "return x"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "suffix"
    assert "fill-in-the-middle" in response.json()["error"]["message"]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    chat = {"messages": [{"role": "user", "content": "weather?"}], "tools": tools}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=chat)  # tool_choice auto: no template tools
    assert response.status_code == 400 and response.json()["error"]["param"] == "tool_choice"
    assert '"required"' in response.json()["error"]["message"]
    bad = httpx.post(f"{server.url}/v1/chat/completions", json={**chat, "tool_choice": {
        "type": "function", "function": {"name": "nope"}}})
    assert bad.status_code == 400 and "get_weather" in bad.json()["error"]["message"]
    malformed = httpx.post(f"{server.url}/v1/chat/completions", json={**chat, "tools": [{"type": "function"}]})
    assert malformed.status_code == 400 and malformed.json()["error"]["param"] == "tools"
    none = httpx.post(f"{server.url}/v1/chat/completions", json={**chat, "tools": [], "tool_choice": "none",
                                                                 "max_tokens": 2})
    assert none.status_code == 200


def test_max_tokens_zero_echoes_the_prompt_only(server):
    body = {"prompt": [5, 6, 7], "max_tokens": 0, "echo": True, "logprobs": 1}
    response = httpx.post(f"{server.url}/v1/completions", json=body).json()
    choice = response["choices"][0]
    assert len(choice["logprobs"]["tokens"]) == 3 and response["usage"]["completion_tokens"] == 0
    assert choice["text"] == httpx.post(f"{server.url}/detokenize", json={"tokens": [5, 6, 7]}).json()["prompt"]
    refused = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 0})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"


def test_structured_outputs_on_the_fake_model_are_a_400_naming_the_field(server):
    for body, param in (({"response_format": {"type": "json_object"}}, "response_format"),
                        ({"guided_choice": ["a", "b"]}, "guided_choice")):
        response = httpx.post(f"{server.url}/v1/chat/completions",
                              json={"messages": [{"role": "user", "content": "hi"}], **body})
        assert response.status_code == 400 and response.json()["error"]["param"] == param
        assert "fake model" in response.json()["error"]["message"]


def sse_events(server, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", f"{server.url}{path}", json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_streaming_n_choices_and_batched_prompts_carry_their_index_and_usage(server):
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "n": 3, "temperature": 1.0,
            "seed": 7, "stream_options": {"include_usage": True}}
    events = sse_events(server, "/v1/chat/completions", chat)
    whole = httpx.post(f"{server.url}/v1/chat/completions", json={**chat, "stream_options": None}).json()
    texts, finished = {}, {}
    for event in events[:-1]:
        (choice,) = event["choices"]
        texts[choice["index"]] = texts.get(choice["index"], "") + (choice["delta"].get("content") or "")
        if choice["finish_reason"]:
            finished[choice["index"]] = choice["finish_reason"]
    assert sorted(texts) == [0, 1, 2] and sorted(finished) == [0, 1, 2]
    assert [texts[i] for i in range(3)] == [c["message"]["content"] for c in whole["choices"]]
    assert events[-1]["choices"] == [] and events[-1]["usage"] == whole["usage"]
    body = {"prompt": [[1, 2], [5, 6, 7]], "n": 2, "max_tokens": 3, "stream_options": {"include_usage": True}}
    events = sse_events(server, "/v1/completions", body)
    whole = httpx.post(f"{server.url}/v1/completions", json={**body, "stream_options": None}).json()
    texts = {}
    for event in events[:-1]:
        (choice,) = event["choices"]
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    assert [texts[i] for i in range(4)] == [c["text"] for c in whole["choices"]]
    assert events[-1]["usage"] == whole["usage"] == {"prompt_tokens": 5, "completion_tokens": 12,
                                                     "total_tokens": 17}
