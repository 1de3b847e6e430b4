"""Tool calling (engine/tools): tool definitions and tool_choice checked, the schema that forces a
call, and hermes-style calls parsed out of generated text."""

from __future__ import annotations

import json

import jsonschema
import pytest

from iterserve.engine.sampling_params import InvalidRequestError
from iterserve.engine.tools import (
    ToolChoice,
    check_tools,
    forced_schema,
    parse_forced,
    parse_hermes,
    resolve_choice,
    template_defines_tools,
)

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "ping"}}]


def test_tools_and_choices_are_checked_naming_the_field():
    functions = check_tools(TOOLS)
    assert functions["get_weather"] == WEATHER and functions["ping"]["type"] == "object"
    for bad in ([{"type": "function", "function": {"name": "has space"}}], [{"type": "retrieval"}],
                [TOOLS[0], TOOLS[0]]):
        with pytest.raises(InvalidRequestError) as error:
            check_tools(bad)
        assert error.value.param == "tools"
    assert resolve_choice(None, functions) == ToolChoice("auto")
    assert resolve_choice(None, {}) == ToolChoice("none")
    assert resolve_choice({"type": "function", "function": {"name": "ping"}}, functions) == ToolChoice("named", "ping")
    for bad in ("sometimes", {"type": "function", "function": {"name": "nope"}}):
        with pytest.raises(InvalidRequestError) as error:
            resolve_choice(bad, functions)
        assert error.value.param == "tool_choice"
    with pytest.raises(InvalidRequestError):
        resolve_choice("required", {})


def test_the_required_schema_accepts_calls_and_parallel_false_allows_one():
    functions = check_tools(TOOLS)
    schema = forced_schema(ToolChoice("required"), functions, parallel=False)
    one = [{"name": "get_weather", "parameters": {"city": "Paris"}}]
    jsonschema.validate(one, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(one * 2, schema)
    jsonschema.validate(one * 2, forced_schema(ToolChoice("required"), functions, parallel=True))
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_weather", "parameters": {}}], schema)  # city required
    calls = parse_forced(json.dumps(one), ToolChoice("required"))
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert forced_schema(ToolChoice("named", "get_weather"), functions, True) == WEATHER
    (named,) = parse_forced('{"city": "Rome"}', ToolChoice("named", "get_weather"))
    assert named.name == "get_weather" and json.loads(named.arguments) == {"city": "Rome"}
    assert parse_forced('{"city": "Ro', ToolChoice("named", "get_weather")) == []  # cut by max_tokens


def test_hermes_calls_are_parsed_and_anything_else_stays_content():
    functions = check_tools(TOOLS)
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>{"name": "ping", "arguments": {}}</tool_call>')
    content, calls = parse_hermes(text, functions)
    assert content == "Let me check." and [c.name for c in calls] == ["get_weather", "ping"]
    assert json.loads(calls[0].arguments) == {"city": "Paris"} and calls[0].id != calls[1].id
    assert len(parse_hermes(text, functions, parallel=False)[1]) == 1
    assert parse_hermes("no calls here", functions) == ("no calls here", [])
    unknown = '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'
    assert parse_hermes(unknown, functions) == (unknown, [])
    broken = '<tool_call>{"name": "ping", "argu'
    assert parse_hermes(broken, functions) == (broken, [])


def test_template_tool_support_is_read_from_the_template():
    assert template_defines_tools("{% if tools %}{{ tools | tojson }}{% endif %}")
    assert not template_defines_tools("{% for message in messages %}{{ message['content'] }}{% endfor %}")
    assert not template_defines_tools(None)


# Model output is steerable by the prompt. The parser was a regex, <tool_call>\s*(.*?)\s*(?:</tool_call>|$),
# whose lazy body retried the whitespace run at every character: 20 KB of spaces after an opening tag
# took 17 s on the event loop (200 KB: about half an hour), and "[[[[..." raised RecursionError (a 500).
PATHOLOGICAL = {
    "spaces after an unclosed call": "<tool_call>x" + " " * 200_000 + "x",
    "spaces inside a closed call": "<tool_call>{" + " " * 200_000 + "}</tool_call>",
    "many opening tags": "<tool_call>" * 18_000,
    "many closed empty calls": "<tool_call> </tool_call>" * 8_000,
    "nested brackets": "<tool_call>" + "[" * 200_000,
}


@pytest.mark.parametrize("name", PATHOLOGICAL)
def test_hermes_parsing_is_linear_on_pathological_200_kb_outputs(name):
    import time

    text = PATHOLOGICAL[name]
    assert len(text) >= 190_000
    started = time.perf_counter()
    content, calls = parse_hermes(text, check_tools(TOOLS))
    assert time.perf_counter() - started < 0.5
    assert (content, calls) == (text, [])  # none is a call: the text stays the content


def test_hermes_blocks_end_at_their_own_close_tag_and_text_between_blocks_is_skipped():
    functions = check_tools(TOOLS)
    text = ('<tool_call> {"name": "ping", "arguments": {"s": "a</tool"}} </tool_call> chatter '
            '<tool_call>{"name": "get_weather", "parameters": {"city": "Oslo"}}')  # unclosed: to the end
    content, calls = parse_hermes(text, functions)
    assert content is None and [c.name for c in calls] == ["ping", "get_weather"]
    assert json.loads(calls[0].arguments) == {"s": "a</tool"} and json.loads(calls[1].arguments) == {"city": "Oslo"}


def test_a_long_answer_is_parsed_in_a_worker_thread_and_a_short_one_on_the_loop():
    import asyncio
    import threading

    from iterserve.engine.server.chat_tools import ChatTools
    from iterserve.engine.tools import OFF_LOOP_CHARS

    class Recording(ChatTools):
        def message(self, text, finish_reason):
            threads.append(threading.current_thread())
            return super().message(text, finish_reason)

    threads: list[threading.Thread] = []
    tools = Recording(check_tools(TOOLS), ToolChoice("auto"), None, TOOLS, True)
    call = '<tool_call>{"name": "ping", "arguments": {}}</tool_call>'

    async def answer(text):
        return await tools.answer(text, "stop"), threading.current_thread()

    (message, reason), loop_thread = asyncio.run(answer(call))
    assert reason == "tool_calls" and threads[-1] is loop_thread
    (message, reason), loop_thread = asyncio.run(answer(" " * OFF_LOOP_CHARS + call))
    assert reason == "tool_calls" and message["tool_calls"][0]["function"]["name"] == "ping"
    assert threads[-1] is not loop_thread
