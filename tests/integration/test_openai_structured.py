"""Structured outputs on the embedded SmolLM2-135M through `iterserve serve`: sampled
generations under a nested JSON schema all validate, the `openai` client's parse() helper gets a
parsed pydantic object, vLLM's guided_* fields hold, and invalid specs are a 400 naming the field."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.server_fixture import running_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 24}, "zip": {"type": "string",
                                                                                "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "pets": {
            "type": "array", "minItems": 1, "maxItems": 3,
            "items": {"type": "object",
                      "properties": {"kind": {"enum": ["cat", "dog", "fish"]}, "legs": {"type": "integer",
                                                                                      "minimum": 0,
                                                                                      "maximum": 4}},
                      "required": ["kind", "legs"], "additionalProperties": False},
        },
    },
    "required": ["name", "age", "address", "pets"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Describe a person, their address and their pets as JSON."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("structured") / "server.log"
    with running_server(["--max-model-len", "1024", "--max-num-seqs", "64", "--device", "cpu"], log_path=log,
                        env={"OMP_NUM_THREADS": "1"}, ready_timeout=300) as server:
        yield server


def chat(server, **body) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/chat/completions", json={"messages": ASK, "max_tokens": 400, **body},
                      timeout=1500)


def test_thirty_sampled_generations_match_a_nested_schema(server):
    body = {"n": 10, "temperature": 1.0, "response_format": {"type": "json_schema", "json_schema": {
        "name": "person", "schema": PERSON, "strict": True}}}
    with ThreadPoolExecutor(3) as pool:
        responses = list(pool.map(lambda seed: chat(server, seed=seed, **body), range(0, 30, 10)))  # choice j: seed+j
    texts = []
    for response in responses:
        assert response.status_code == 200, response.text
        for choice in response.json()["choices"]:
            assert choice["finish_reason"] == "stop", choice
            texts.append(choice["message"]["content"])
    assert len(texts) == 30
    for text in texts:
        jsonschema.validate(json.loads(text), PERSON)
    assert len(set(texts)) > 15  # sampled, not one answer repeated


def test_unconstrained_output_is_not_json_so_the_grammar_did_the_work(server):
    plain = chat(server, temperature=0, max_tokens=40).json()["choices"][0]["message"]["content"]
    with pytest.raises(ValueError):
        jsonschema.validate(json.loads(plain), PERSON)


class Pet(BaseModel):
    kind: Literal["cat", "dog", "fish"]
    legs: int = Field(ge=0, le=4)


class Person(BaseModel):
    name: str = Field(max_length=24)
    age: int = Field(ge=0, le=120)
    pets: list[Pet] = Field(max_length=3)


def test_the_openai_clients_parse_helper_returns_a_parsed_object(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=600)
    completion = client.chat.completions.parse(model="smollm2-135m", messages=ASK, response_format=Person,
                                               temperature=0, max_tokens=400)
    person = completion.choices[0].message.parsed
    assert isinstance(person, Person) and isinstance(person.pets, list)
    beta = client.beta.chat.completions.parse(model="smollm2-135m", messages=ASK, response_format=Person,
                                              temperature=0, max_tokens=400)
    assert beta.choices[0].message.parsed == person  # greedy: the same object


def test_json_object_is_an_object_cut_only_by_max_tokens(server):
    choice = chat(server, temperature=0, max_tokens=60, response_format={"type": "json_object"}).json()["choices"][0]
    text = choice["message"]["content"]
    assert text.startswith("{")
    if choice["finish_reason"] == "stop":  # complete: valid JSON; "length": cut inside an open string
        assert isinstance(json.loads(text), dict)


def test_guided_regex_choice_and_grammar(server):
    regex = chat(server, temperature=1.0, seed=1, max_tokens=40,
                 guided_regex=r"[a-z]{3,8}@example\.(com|org)").json()["choices"][0]
    assert regex["finish_reason"] == "stop"
    assert regex["message"]["content"].split("@")[1] in ("example.com", "example.org")
    choice = chat(server, temperature=1.0, seed=2, guided_choice=["yes", "no", "maybe"]).json()
    assert choice["choices"][0]["message"]["content"] in ("yes", "no", "maybe")
    grammar = 'root ::= "(" [0-9] [0-9]? " + " [0-9] [0-9]? ")"'
    completion = httpx.post(f"{server.url}/v1/completions", timeout=600, json={
        "prompt": "Sum:", "max_tokens": 12, "guided_grammar": grammar, "temperature": 0}).json()["choices"][0]
    assert completion["finish_reason"] == "stop" and completion["text"].startswith("(") and " + " in completion["text"]


def test_a_streamed_constrained_answer_is_valid_json(server):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", timeout=600,
                      json={"messages": ASK, "stream": True, "guided_json": schema, "temperature": 0}) as stream:
        events = [json.loads(line[6:]) for line in stream.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    streamed = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    assert isinstance(json.loads(streamed)["ok"], bool)


def test_max_tokens_and_stop_still_end_a_constrained_request(server):
    body = {"temperature": 0, "response_format": {"type": "json_schema", "json_schema": {"name": "p",
                                                                                          "schema": PERSON}}}
    cut = chat(server, **{**body, "max_tokens": 5}).json()["choices"][0]
    assert cut["finish_reason"] == "length"
    full = chat(server, **body).json()["choices"][0]["message"]["content"]
    stop = full[full.index('"age"'):][:6]
    stopped = chat(server, **body, stop=[stop]).json()["choices"][0]
    assert stopped["finish_reason"] == "stop" and stopped["message"]["content"] == full[: full.index(stop)]


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_grammar": "root ::= undefined_rule"}, "guided_grammar"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    # Over a limit (engine/structured/limits.py), refused before compiling. Before, the pattern took
    # 36 s of a shared worker thread to compile, and nothing bounded counts, enums or choices.
    ({"guided_json": {"type": "string", "pattern": "^x{1,10000}$"}}, "guided_json"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "array", "items": {"type": "integer"}, "maxItems": 1_000_000}}}}, "response_format"),
    ({"guided_choice": [f"c{i}" for i in range(1001)]}, "guided_choice"),
    ({"guided_regex": "a{0,100000}"}, "guided_regex"),
    # A grammar no token of the vocabulary can begin: every logit was -inf at the first step, and
    # sampling failed with a 500 (found by the schemathesis run).
    ({"guided_regex": "\u0014"}, "guided_regex"),
    ({"tools": [{"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"v": {"enum": list(range(5000))}}}}}], "tool_choice": "required"},
     "tools"),
])
def test_invalid_structured_outputs_are_a_400_naming_the_field(server, body, param):
    response = chat(server, **body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"].startswith(param)


# A grammar every token of the vocabulary leaves part-way: the first step had tokens to offer, the ninth
# none (the schemathesis run's request, greedy here); every logit was -inf and sampling failed with a 500.
DEAD_END = {"prompt": ["\U0008fe4a\x04\x81\x8d"], "temperature": 0,
            "guided_regex": "\u00a4\x08ps\x80\r\U00065f8a\x83U\x18\u00df\U0009578a\x10"}


def test_a_grammar_no_token_can_continue_mid_answer_is_a_400_naming_the_field(server):
    response = httpx.post(f"{server.url}/v1/completions", json=DEAD_END, timeout=300)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "guided_regex" and "no token of the model's vocabulary continues" in error["message"]
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**DEAD_END, "stream": True}, timeout=300) as streamed:
        events = [line[6:] for line in streamed.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["param"] == "guided_regex", events
    assert server_healthy(server)


def test_a_complete_grammar_held_open_gives_stop_tokens_or_a_400(server):
    """ignore_eos past a complete grammar: the matcher had accepted its stop token and asking it for the
    next mask raised (a 500, found by the schemathesis run); now only the stop token is allowed, so the
    text stays the match. min_tokens past it bans that stop token too: nothing is left, a 400."""
    url = f"{server.url}/v1/completions"
    held = httpx.post(url, json={"prompt": "Is the sky blue? Answer:", "guided_json": {"type": "boolean"},
                                 "ignore_eos": True, "max_tokens": 12}, timeout=300)
    assert held.status_code == 200, held.text
    choice = held.json()["choices"][0]
    assert choice["text"] in ("true", "false") and choice["finish_reason"] == "length", choice
    banned = httpx.post(url, json={"prompt": "Pick:", "guided_choice": ["yes", "no"], "min_tokens": 8,
                                   "max_tokens": 12}, timeout=300)
    assert banned.status_code == 400, banned.text
    assert banned.json()["error"]["param"] == "guided_choice"
    assert server_healthy(server)


def server_healthy(server) -> bool:
    """The engine carried on: a plain request after the failed one is served."""
    response = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=300)
    return response.status_code == 200


def test_text_response_format_changes_nothing(server):
    plain = chat(server, temperature=0, max_tokens=16).json()["choices"][0]["message"]["content"]
    text = chat(server, temperature=0, max_tokens=16, response_format={"type": "text"}).json()
    assert text["choices"][0]["message"]["content"] == plain


# -- tools: SmolLM2's chat template has no tool syntax, so calls are forced through the grammar ------
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 20},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 30}}, "required": ["timezone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Time in a timezone",
                                           "parameters": TIME}}]
WEATHER_ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_a_named_tool_choice_forces_a_valid_call(server):
    response = chat(server, messages=WEATHER_ASK, tools=TOOLS, temperature=0,
                    tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER)


def test_required_tool_choice_through_the_openai_client(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=600)
    for seed in range(3):
        completion = client.chat.completions.create(model="smollm2-135m", messages=WEATHER_ASK, tools=TOOLS,
                                                    tool_choice="required", parallel_tool_calls=False,
                                                    temperature=1.0, seed=seed, max_tokens=200)
        choice = completion.choices[0]
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls
        schema = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), schema)
    # The call and its result go back as the next turn (the template sees the call as hermes text).
    follow = chat(server, temperature=0, max_tokens=20, messages=[
        *WEATHER_ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}])
    assert follow.status_code == 200, follow.text
    assert follow.json()["choices"][0]["message"]["content"]


def test_a_streamed_forced_call_arrives_as_tool_call_deltas(server):
    body = {"messages": WEATHER_ASK, "tools": TOOLS, "temperature": 0, "stream": True, "max_tokens": 200,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=600) as stream:
        events = [json.loads(line[6:]) for line in stream.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    calls = [c for e in events for c in e["choices"][0]["delta"].get("tool_calls", [])]
    assert len(calls) == 1 and calls[0]["index"] == 0 and calls[0]["function"]["name"] == "get_weather"
    streamed = json.loads(calls[0]["function"]["arguments"])
    whole = chat(server, **{k: v for k, v in body.items() if k != "stream"}).json()
    assert streamed == json.loads(whole["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"])


def test_auto_tool_choice_is_refused_because_the_template_defines_no_tools(server):
    response = chat(server, messages=WEATHER_ASK, tools=TOOLS)
    assert response.status_code == 400 and response.json()["error"]["param"] == "tool_choice"
    none = chat(server, messages=WEATHER_ASK, tools=TOOLS, tool_choice="none", max_tokens=8, temperature=0)
    assert none.status_code == 200 and not none.json()["choices"][0]["message"].get("tool_calls")
