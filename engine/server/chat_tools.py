"""A chat request's conversation and tools (engine/tools) on the way in and out: the messages the
chat template renders, the grammar that forces a call, and how the generated text becomes the
answer's message (content, or tool calls)."""

from __future__ import annotations

import asyncio

from iterserve.engine.sampling_params import InvalidRequestError
from iterserve.engine.server.errors import invalid
from iterserve.engine.server.prompt_length import check_prompt_chars
from iterserve.engine.server.protocol import ChatCompletionRequest
from iterserve.engine.structured import StructuredOutput
from iterserve.engine.tools import (
    OFF_LOOP_CHARS,
    ToolChoice,
    check_tools,
    forced_schema,
    hermes_text,
    parse_forced,
    parse_hermes,
    resolve_choice,
    template_defines_tools,
)

AUTO_NEEDS_TEMPLATE = (
    'tool_choice: "auto" (the default when tools are sent) needs a chat template that shows the model its '
    "tools, and this model's template does not use them, so no call could be recognised; send tool_choice "
    '"required" or {"type": "function", "function": {"name": ...}} (the call is forced by the '
    'structured-output grammar), or "none"')


class ChatTools:
    """A chat request's tools: the grammar that forces a call, what the template is given, and how
    the generated text becomes the answer's message."""

    def __init__(self, functions: dict[str, dict], choice: ToolChoice, forced: StructuredOutput | None,
                 template_tools: list[dict] | None, parallel: bool):
        self.functions, self.tool_choice, self.forced = functions, choice, forced
        self.template_tools, self.parallel = template_tools, parallel

    @classmethod
    def of(cls, body: ChatCompletionRequest, tokenizer) -> ChatTools:
        try:
            functions = check_tools(body.tools or [])
            choice = resolve_choice(body.tool_choice, functions)
        except InvalidRequestError as error:
            raise invalid(str(error), error.param) from None
        parallel = body.parallel_tool_calls is not False
        template = getattr(tokenizer, "chat_template", None)
        if choice.mode == "auto" and not template_defines_tools(template):
            raise invalid(AUTO_NEEDS_TEMPLATE, "tool_choice")
        schema = forced_schema(choice, functions, parallel)
        forced = None if schema is None else StructuredOutput.json_schema(schema, "tools")
        template_tools = body.tools if choice.mode != "none" and body.tools else None
        return cls(functions, choice, forced, template_tools, parallel)

    @property
    def active(self) -> bool:
        """Whether the answer may hold tool calls (a stream then holds a choice's text until it ends)."""
        return self.tool_choice.mode != "none"

    async def answer(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """`message`, in a worker thread for a long text: parsing is linear, but megabytes of model
        output would still hold every other stream on the event loop."""
        if not self.active or len(text) <= OFF_LOOP_CHARS:
            return self.message(text, finish_reason)
        return await asyncio.to_thread(self.message, text, finish_reason)

    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        mode = self.tool_choice.mode
        calls = []
        content: str | None = text
        if mode in ("named", "required") and finish_reason == "stop":
            calls = parse_forced(text, self.tool_choice)
            content = None if calls else text
        elif mode == "auto":
            content, calls = parse_hermes(text, self.functions, self.parallel)
        if not calls:
            return {"role": "assistant", "content": text}, finish_reason
        message = {"role": "assistant", "content": content, "tool_calls": [c.to_openai() for c in calls]}
        # As OpenAI: a named (forced) function ends with "stop", a call the model chose with "tool_calls".
        return message, finish_reason if mode == "named" else "tool_calls"


def chat_messages(body: ChatCompletionRequest, template_tools: list[dict] | None) -> list[dict]:
    messages = []
    for i, m in enumerate(body.messages):
        if m.content is None and not (m.role == "assistant" and m.tool_calls):
            raise invalid(f"messages[{i}].content is required (only an assistant message with tool_calls may "
                          "leave it out)", f"messages.{i}.content")
        message = {"role": m.role, "content": m.text()}
        if m.tool_calls:
            message["tool_calls"] = m.tool_calls
            if not template_tools:  # a template without tool syntax sees the calls as hermes text
                message["content"] = "\n".join(filter(None, [message["content"], hermes_text(m.tool_calls)]))
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        messages.append(message)
    return messages


def render_chat(tokenizer, messages: list[dict], tools: list[dict] | None = None,
                max_model_len: int | None = None) -> tuple[str, list[int]]:
    try:
        extra = {"tools": tools} if tools else {}
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, **extra)
    except Exception as error:  # noqa: BLE001 - a template that rejects the conversation
        raise invalid(f"messages: the model's chat template rejected them: {error}", "messages") from None
    if max_model_len is not None:  # the tools' definitions and the template's own text count too
        check_prompt_chars(len(text), tokenizer, max_model_len, "messages")
    return text, tokenizer.encode(text, add_special_tokens=False)
