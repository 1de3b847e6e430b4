"""POST /v1/chat/completions: a conversation (with tools, structured outputs and logprobs) rendered
by the model's chat template, answered whole or as a stream of chat.completion.chunk events.

With tools (other than "none"), a streamed choice's text is held back until it ends, then sent as
its tool calls (or as content, if it holds none)."""

from __future__ import annotations

import asyncio
import contextlib

from fastapi import APIRouter, Request, Response

from iterserve.engine.outputs import RequestOutput
from iterserve.engine.server.chat_tools import ChatTools, chat_messages, render_chat
from iterserve.engine.server.envelope import ResponseIds, StreamUsage, usage_of
from iterserve.engine.server.errors import invalid
from iterserve.engine.server.fan_out import Choices, final_outputs, started_stream
from iterserve.engine.server.logprobs_format import chat_logprobs
from iterserve.engine.server.pd_params import answer_kv_transfer, request_kv_transfer
from iterserve.engine.server.prompt_length import check_prompt_chars
from iterserve.engine.server.protocol import (
    ERROR_RESPONSES,
    IGNORED_FIELDS_HEADER,
    ChatCompletionRequest,
    ChatCompletionResponse,
)
from iterserve.engine.server.request_params import (
    check_logprobs,
    ignored_headers,
    sampling_params,
    structured_output,
)
from iterserve.engine.server.sse import sse_response
from iterserve.engine.server.state import ServerState

router = APIRouter()
CHUNK = "chat.completion.chunk"


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=ERROR_RESPONSES)
async def create_chat_completion(body: ChatCompletionRequest, request: Request, response: Response):
    state: ServerState = request.app.state.server
    headers = ignored_headers(body, request)
    engine = state.engine_for(body.model)
    tokenizer = engine.engine.tokenizer
    tools = ChatTools.of(body, tokenizer)
    if tools.active:
        headers = _tools_honour_parallel_calls(headers)
    messages = chat_messages(body, tools.template_tools)
    max_model_len = engine.engine.config.max_model_len
    chars = sum(len(m["content"] or "") for m in messages)  # the template only adds to them
    check_prompt_chars(chars, tokenizer, max_model_len, "messages")  # before rendering and tokenizing
    text, token_ids = await asyncio.to_thread(render_chat, tokenizer, messages, tools.template_tools, max_model_len)
    if body.top_logprobs is not None and not body.logprobs:
        raise invalid("top_logprobs needs logprobs: true", "top_logprobs")
    check_logprobs(body.top_logprobs, state, "top_logprobs")
    structured = await structured_output(body, engine, tools.forced)
    params = sampling_params(body, body.max_completion_tokens or body.max_tokens, len(token_ids), engine,
                             "messages",
                             default_max_tokens=max(1, engine.engine.config.max_model_len - len(token_ids)),
                             logprobs=(body.top_logprobs or 0) if body.logprobs else None, structured=structured)
    ids = ResponseIds("chatcmpl", state.model_name)
    choices = Choices([(text, token_ids)], [params], body.n, "messages", request_kv_transfer(body, 1),
                      lora_name=state.lora_of(body.model))
    if body.stream:
        outputs = await started_stream(request, engine, choices)
        return sse_response(_chat_events(outputs, ids, StreamUsage.of(body), body.n, tokenizer, body.logprobs, tools),
                            headers)
    finals = await final_outputs(request, engine, choices)
    response.headers.update(headers)
    answers = [await _choice(index, final, tokenizer, body.logprobs, tools) for index, final in enumerate(finals)]
    return ids.body("chat.completion", answers, usage=usage_of(finals, body.n), **answer_kv_transfer(finals))


def _tools_honour_parallel_calls(headers: dict[str, str]) -> dict[str, str]:
    """With tools in play parallel_tool_calls is honoured, so it is not named as ignored."""
    if "parallel_tool_calls" not in headers.get(IGNORED_FIELDS_HEADER, ""):
        return headers
    kept = [f for f in headers[IGNORED_FIELDS_HEADER].split(",") if f != "parallel_tool_calls"]
    return {IGNORED_FIELDS_HEADER: ",".join(kept)} if kept else {}


async def _choice(index: int, final: RequestOutput, tokenizer, logprobs: bool | None, tools: ChatTools) -> dict:
    out = final.outputs[0]
    entries = None
    if logprobs:
        entries = {"content": await asyncio.to_thread(chat_logprobs, tokenizer, out.logprobs or [])}
    message, finish_reason = await tools.answer(out.text, out.finish_reason)
    return {"index": index, "message": message, "logprobs": entries, "finish_reason": finish_reason}


async def _tool_deltas(tools: ChatTools, out: RequestOutput) -> tuple[dict, str | None]:
    """A held-back choice's whole answer as one delta (content and/or tool calls) and its finish reason."""
    completion = out.outputs[0]
    message, finish_reason = await tools.answer(completion.text, completion.finish_reason)
    delta = {"content": message["content"]} if message["content"] else {}
    if message.get("tool_calls"):
        delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(message["tool_calls"])]
    return delta, finish_reason


async def _chat_events(outputs, ids: ResponseIds, usage: StreamUsage, n: int, tokenizer, logprobs: bool | None,
                       tools: ChatTools):
    """Chat chunks for (index, output) pairs from stream_choices, each chunk naming its choice."""
    def chunk(index: int, out: RequestOutput, delta: dict, finish_reason: str | None,
              chunk_logprobs: dict | None = None) -> dict:
        choice = {"index": index, "delta": delta, "logprobs": chunk_logprobs, "finish_reason": finish_reason}
        return usage.chunk(ids, CHUNK, choice, out)

    finals: dict[int, RequestOutput] = {}
    sent: dict[int, int] = {}  # generated tokens whose logprobs went out, per choice
    async with contextlib.aclosing(outputs):  # an early stop aborts the choices
        async for index, out in outputs:
            if index not in sent:
                sent[index] = 0
                yield chunk(index, out, {"role": "assistant", "content": ""}, None)
            finals[index] = out
            completion = out.outputs[0]
            chunk_logprobs = None
            if logprobs and completion.logprobs and len(completion.logprobs) > sent[index]:
                chunk_logprobs = {"content": chat_logprobs(tokenizer, completion.logprobs[sent[index]:])}
                sent[index] = len(completion.logprobs)
            if tools.active:
                if chunk_logprobs:
                    yield chunk(index, out, {}, None, chunk_logprobs)
                if out.finished:
                    delta, finish_reason = await _tool_deltas(tools, out)
                    if delta:
                        yield chunk(index, out, delta, None)
                    yield chunk(index, out, {}, finish_reason)
                continue
            if completion.new_text or chunk_logprobs:
                yield chunk(index, out, {"content": completion.new_text}, None, chunk_logprobs)
            if out.finished:
                yield chunk(index, out, {}, completion.finish_reason)
    for last in usage.last_chunk(ids, CHUNK, finals, n):
        yield last
