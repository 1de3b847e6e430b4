"""Tool calling for chat completions: what a request offers, how a call is forced, how calls are
found in the generated text.

In: the request's `tools` (OpenAI's function definitions), `tool_choice` and `parallel_tool_calls`.
Out: for tool_choice "required" or a named function, a JSON schema the output is forced to match
through the structured-output grammar (engine/structured), so a call comes back whatever the chat
template says (as vLLM does); for "auto", hermes-style `<tool_call>{"name": ..., "arguments": ...}
</tool_call>` blocks parsed out of the text, which only a chat template that shows the model its
tools (one that uses the `tools` variable) can produce, so "auto" on any other template is refused.

The generated text is the model's, and a prompt can steer it, so parsing it is linear: tags found with
str.find, each block decoded once (a regex with a lazy body before optional whitespace, as this used
to be, took 17 s on 20 KB of spaces). Text longer than OFF_LOOP_CHARS is parsed off the event loop.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from iterserve.engine.sampling_params import InvalidRequestError

MAX_TOOLS = 128
OFF_LOOP_CHARS = 16 * 1024  # above this, the server parses a choice's text in a worker thread
_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str

    def to_openai(self, index: int | None = None) -> dict:
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


@dataclass(frozen=True, slots=True)
class ToolChoice:
    """The resolved choice: mode "none", "auto", "required" or "named" (then `name` is set)."""

    mode: str
    name: str | None = None


def check_tools(tools: list[dict]) -> dict[str, dict]:
    """name -> parameters schema of each function tool; InvalidRequestError(param="tools") if malformed."""
    if len(tools) > MAX_TOOLS:
        raise InvalidRequestError(f"tools: at most {MAX_TOOLS} tools, got {len(tools)}", "tools")
    functions: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
            raise InvalidRequestError(f'tools[{i}]: must be {{"type": "function", "function": {{"name": ..., '
                                      '"parameters": {...}}}}', "tools")
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise InvalidRequestError(f"tools[{i}].function.name: must be 1-64 letters, digits, _ . or -", "tools")
        if name in functions:
            raise InvalidRequestError(f"tools[{i}].function.name: {name!r} is defined twice", "tools")
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict):
            raise InvalidRequestError(f"tools[{i}].function.parameters: must be a JSON schema object", "tools")
        functions[name] = parameters
    return functions


def resolve_choice(tool_choice, functions: dict[str, dict]) -> ToolChoice:
    """OpenAI's tool_choice (a mode string or {"type": "function", "function": {"name": ...}})."""
    if tool_choice is None:
        return ToolChoice("auto" if functions else "none")
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise InvalidRequestError(f'tool_choice: "none", "auto", "required" or {{"type": "function", '
                                      f'"function": {{"name": ...}}}}, got {tool_choice!r}', "tool_choice")
        if tool_choice != "none" and not functions:
            raise InvalidRequestError(f"tool_choice: {tool_choice!r} needs tools", "tool_choice")
        return ToolChoice(tool_choice)
    function = tool_choice.get("function") if tool_choice.get("type") == "function" else None
    name = function.get("name") if isinstance(function, dict) else None
    if name not in functions:
        known = ", ".join(functions) or "none"
        raise InvalidRequestError(f"tool_choice: names a function that is not among the tools ({name!r}; tools: "
                                  f"{known})", "tool_choice")
    return ToolChoice("named", name)


def forced_schema(choice: ToolChoice, functions: dict[str, dict], parallel: bool) -> dict | None:
    """The JSON schema a forced call's output matches: a named function's arguments object, or for
    "required" a list of {"name", "parameters"} objects (one item unless parallel calls are allowed)."""
    if choice.mode == "named":
        return functions[choice.name]
    if choice.mode != "required":
        return None
    calls = [{"type": "object", "properties": {"name": {"const": name}, "parameters": parameters},
              "required": ["name", "parameters"], "additionalProperties": False}
             for name, parameters in functions.items()]
    items = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return {"type": "array", "items": items, "minItems": 1, **({} if parallel else {"maxItems": 1})}


def parse_forced(text: str, choice: ToolChoice) -> list[ToolCall]:
    """The calls in a forced output (grammar-complete JSON); [] if it is not (cut by max_tokens or stop)."""
    try:
        value = json.loads(text)
    except ValueError:
        return []
    if choice.mode == "named":
        return [ToolCall(choice.name, json.dumps(value, ensure_ascii=False), _call_id())]
    return [ToolCall(call["name"], json.dumps(call["parameters"], ensure_ascii=False), _call_id()) for call in value]


def parse_hermes(text: str, functions: dict[str, dict], parallel: bool = True) -> tuple[str | None, list[ToolCall]]:
    """Hermes-style calls (Qwen2.5, Hermes, many others): the text before the first <tool_call> is the
    content; each block holds {"name": ..., "arguments": {...}}. Blocks that are not valid JSON naming
    an offered function stay in the content."""
    start = text.find(_OPEN)
    if start < 0:
        return text, []
    calls: list[ToolCall] = []
    for block in _hermes_blocks(text, start):
        try:
            value = json.loads(block)
        except (ValueError, RecursionError):  # RecursionError: "[[[[..." nested past Python's stack
            return text, []
        if not isinstance(value, dict) or value.get("name") not in functions:
            return text, []
        arguments = value.get("arguments", value.get("parameters", {}))
        arguments = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        calls.append(ToolCall(value["name"], arguments, _call_id()))
    if not parallel:
        calls = calls[:1]
    content = text[:start].strip()
    return (content or None), calls


def _hermes_blocks(text: str, start: int):
    """Each block's text, stripped: from a <tool_call> to the next </tool_call>, or to the end of the
    text if it is not closed; anything between blocks is skipped. Every character is looked at a
    bounded number of times."""
    while start >= 0:
        body = start + len(_OPEN)
        end = text.find(_CLOSE, body)
        if end < 0:
            yield text[body:].strip()
            return
        yield text[body:end].strip()
        start = text.find(_OPEN, end + len(_CLOSE))


def template_defines_tools(template: str | None) -> bool:
    """Whether a chat template shows the model its tools (it reads the `tools` variable)."""
    return bool(template) and re.search(r"\btools\b", template) is not None


def hermes_text(tool_calls: list[dict]) -> str:
    """An assistant message's earlier tool calls as hermes text, for templates that have no tool syntax."""
    blocks = []
    for call in tool_calls:
        function = call.get("function", {})
        arguments = function.get("arguments", "{}")
        try:
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        except (ValueError, RecursionError):  # a client's "[[[[...": kept as the text it sent
            pass
        blocks.append("<tool_call>\n" + json.dumps({"name": function.get("name"), "arguments": arguments},
                                                   ensure_ascii=False) + "\n</tool_call>")
    return "\n".join(blocks)


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"
