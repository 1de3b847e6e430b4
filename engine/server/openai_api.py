"""POST /v1/completions, POST /v1/chat/completions and GET /v1/models.

Streaming answers are server-sent events shaped exactly like OpenAI's, ending with
`data: [DONE]`. Tokenizing and rendering the chat template run in a worker thread, so a huge
prompt never stalls other requests' streams. A request that fails on its own (its sampling, say)
gets a 500 error body, or an error event on its stream; the other requests go on. Whether
streaming or not, a client that disconnects has its request aborted at
the engine's next step, which frees the request's KV blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse

from iterserve.engine.outputs import RequestOutput
from iterserve.engine.sampling_params import MAX_SEED, InvalidRequestError, SamplingParams
from iterserve.engine.server.async_engine import (
    AsyncEngine,
    EngineFailed,
    NotAccepting,
    QueueFull,
    RequestError,
    RequestStream,
)
from iterserve.engine.server.errors import (
    APIError,
    error_body,
    invalid,
    overloaded,
    request_failed,
    unavailable,
)
from iterserve.engine.server.protocol import (
    IGNORED_FIELDS_HEADER,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    _SamplingFields,
)
from iterserve.engine.server.state import ServerState
from iterserve.engine.structured import StructuredOutput
from iterserve.engine.tools import (
    ToolChoice,
    check_tools,
    forced_schema,
    hermes_text,
    parse_forced,
    parse_hermes,
    resolve_choice,
    template_defines_tools,
)

ERROR_RESPONSES = {status: {"model": ErrorResponse} for status in (400, 413, 429, 500, 503)}
router = APIRouter()
logger = logging.getLogger(__name__)


class ClientDisconnected(Exception):
    pass


@router.get("/v1/models", response_model=ModelList)
async def list_models(request: Request) -> ModelList:
    state: ServerState = request.app.state.server
    card = ModelCard(id=state.model_name, created=state.created, max_model_len=state.engine_config.max_model_len)
    return ModelList(data=[card])


@router.post("/v1/completions", response_model=CompletionResponse, responses=ERROR_RESPONSES)
async def create_completion(body: CompletionRequest, request: Request, response: Response):
    state: ServerState = request.app.state.server
    headers = _ignored_headers(body, request)
    engine = state.require_engine()
    state.check_model(body.model)
    prompts = body.prompt if isinstance(body.prompt, list) and isinstance(body.prompt[0], (str, list)) else [
        body.prompt]
    if body.best_of is not None and body.best_of != body.n:
        raise invalid(f"best_of: only best_of equal to n ({body.n}) is supported, got {body.best_of}", "best_of")
    prompt_only = body.max_tokens == 0  # echo the prompt (and its logprobs), generate nothing
    if prompt_only and (not body.echo or body.stream):
        raise invalid("max_tokens: 0 only with echo: true and without stream", "max_tokens")
    tokenizer = engine.engine.tokenizer
    if body.suffix:
        prompts = [_fill_in_the_middle(tokenizer, prompt, body.suffix) for prompt in prompts]
    encoded = []
    for prompt in prompts:
        if isinstance(prompt, str):
            encoded.append((prompt, await asyncio.to_thread(tokenizer.encode, prompt)))
        else:
            encoded.append((None, list(prompt)))
    _check_logprobs(body.logprobs, state, "logprobs")
    structured = await _structured_output(body, engine)
    params = [
        _sampling_params(body, 1 if prompt_only else body.max_tokens, len(token_ids), engine, "prompt",
                         default_max_tokens=16,
                         logprobs=body.logprobs,
                         prompt_logprobs=body.logprobs if body.echo and body.logprobs is not None else None,
                         structured=None if prompt_only else structured)
        for _, token_ids in encoded
    ]
    ids = _Ids("cmpl", state.model_name)
    echo_texts = [""] * len(encoded)
    if body.echo:
        echo_texts = [text if text is not None else await asyncio.to_thread(tokenizer.decode, token_ids)
                      for text, token_ids in encoded]
    kv_transfer = _kv_transfer(body, len(encoded))
    if body.stream:
        outputs = _stream_choices(request, engine, encoded, params, body.n, "prompt", kv_transfer)
        await outputs.asend(None)  # submits the requests: a refusal (429, 503) is still an HTTP status
        events = _completion_events(outputs, ids, _StreamUsage.of(body), body.n, tokenizer, echo_texts,
                                    body.logprobs is not None)
        return _sse(events, headers)
    finals = await _generate(request, engine, encoded, params, body.n, "prompt", kv_transfer)
    response.headers.update(headers)
    choices = []
    for index, final in enumerate(finals):
        prompt_index = index // body.n
        token_ids = encoded[prompt_index][1]
        out = final.outputs[0]
        if prompt_only:  # the one token generated to run the prompt through the model is dropped
            out = dataclasses.replace(out, text="", token_ids=[], logprobs=None, finish_reason="length")
            final = dataclasses.replace(final, outputs=[out])
            finals[index] = final
        logprobs = None
        if body.logprobs is not None:
            generated = list(out.logprobs or [])
            generated += [None] * (len(out.token_ids) - len(generated))  # an executor that records none (fake)
            entries = (list(final.prompt_logprobs or [None] * len(token_ids)) if body.echo else []) + generated
            token_ids_all = (list(token_ids) if body.echo else []) + list(out.token_ids)
            logprobs = await asyncio.to_thread(_completion_logprobs, tokenizer, token_ids_all, entries, 0)
        choices.append({"index": index, "text": echo_texts[prompt_index] + out.text, "logprobs": logprobs,
                        "finish_reason": out.finish_reason})
    return {
        "id": ids.id, "object": "text_completion", "created": ids.created, "model": ids.model,
        "choices": choices, "usage": _usage_of(finals, body.n), **_kv_answer(finals),
    }


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=ERROR_RESPONSES)
async def create_chat_completion(body: ChatCompletionRequest, request: Request, response: Response):
    state: ServerState = request.app.state.server
    headers = _ignored_headers(body, request)
    engine = state.require_engine()
    state.check_model(body.model)
    tokenizer = engine.engine.tokenizer
    tools = _ChatTools.of(body, tokenizer)
    if tools.tool_choice.mode != "none" and "parallel_tool_calls" in headers.get(IGNORED_FIELDS_HEADER, ""):
        kept = [f for f in headers[IGNORED_FIELDS_HEADER].split(",") if f != "parallel_tool_calls"]
        headers = {IGNORED_FIELDS_HEADER: ",".join(kept)} if kept else {}
    messages = _chat_messages(body, tools.template_tools)
    text, token_ids = await asyncio.to_thread(_render_chat, tokenizer, messages, tools.template_tools)
    max_tokens = body.max_completion_tokens or body.max_tokens
    max_model_len = engine.engine.config.max_model_len
    if body.top_logprobs is not None and not body.logprobs:
        raise invalid("top_logprobs needs logprobs: true", "top_logprobs")
    _check_logprobs(body.top_logprobs, state, "top_logprobs")
    structured = await _structured_output(body, engine, tools.forced)
    params = _sampling_params(body, max_tokens, len(token_ids), engine, "messages",
                              default_max_tokens=max(1, max_model_len - len(token_ids)),
                              logprobs=(body.top_logprobs or 0) if body.logprobs else None,
                              structured=structured)
    ids = _Ids("chatcmpl", state.model_name)
    kv_transfer = _kv_transfer(body, 1)
    if body.stream:
        outputs = _stream_choices(request, engine, [(text, token_ids)], [params], body.n, "messages", kv_transfer)
        await outputs.asend(None)  # submits the requests: a refusal (429, 503) is still an HTTP status
        return _sse(_chat_events(outputs, ids, _StreamUsage.of(body), body.n, tokenizer, body.logprobs, tools),
                    headers)
    finals = await _generate(request, engine, [(text, token_ids)], [params], body.n, "messages", kv_transfer)
    response.headers.update(headers)
    choices = []
    for index, final in enumerate(finals):
        out = final.outputs[0]
        logprobs = None
        if body.logprobs:
            logprobs = {"content": await asyncio.to_thread(_chat_logprobs, tokenizer, out.logprobs or [])}
        message, finish_reason = tools.message(out.text, out.finish_reason)
        choices.append({"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason})
    return {
        "id": ids.id, "object": "chat.completion", "created": ids.created, "model": ids.model,
        "choices": choices, "usage": _usage_of(finals, body.n), **_kv_answer(finals),
    }


async def _generate(request: Request, engine: AsyncEngine, prompts: list[tuple[str | None, list[int]]],
                    params: list[SamplingParams], n: int, prompt_field: str,
                    kv_transfer_params: dict | None = None) -> list[RequestOutput]:
    """Every prompt's n choices, in order (prompt i's choice j at i*n + j). The first choice of a prompt
    goes first; the other n-1 are submitted once it has been prefilled, so with prefix caching they
    reuse its full KV blocks and prefill only the last partial block. A seed s gives choice j seed s+j."""
    tasks: list[asyncio.Task] = []
    try:
        for (text, token_ids), base in zip(prompts, params, strict=True):
            prefilled = asyncio.Event()
            first = _submit(engine, text, token_ids, base, prompt_field, kv_transfer_params)
            tasks.append(asyncio.create_task(_final_output(request, engine, first, on_output=prefilled.set)))
            if n == 1:
                continue
            waiter = asyncio.create_task(prefilled.wait())
            await asyncio.wait([tasks[-1], waiter], return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            for j in range(1, n):
                seed = None if base.seed is None else (base.seed + j if base.seed + j <= MAX_SEED else base.seed - j)
                stream = _submit(engine, text, token_ids, dataclasses.replace(base, seed=seed), prompt_field)
                tasks.append(asyncio.create_task(_final_output(request, engine, stream)))
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()  # on an error: the others are aborted (their _watch aborts them in the engine)


async def _stream_choices(request: Request, engine: AsyncEngine, prompts: list[tuple[str | None, list[int]]],
                          params: list[SamplingParams], n: int, prompt_field: str,
                          kv_transfer_params: dict | None = None):
    """Every prompt's n choices as their outputs come, as (index, output) with prompt i's choice j at
    index i*n + j. As in _generate, a prompt's other n-1 choices are submitted once its first has
    produced an output (it is prefilled), so they share its cached KV blocks. The first value yielded
    is None, once every first choice is submitted (their refusals raise before any byte is sent)."""
    queue: asyncio.Queue = asyncio.Queue()
    tasks: list[asyncio.Task] = []

    async def pump(index: int, stream: RequestStream, then=None) -> None:
        try:
            async for out in _watch(request, engine, stream):
                if then is not None:
                    then()
                    then = None
                queue.put_nowait((index, out))
        except Exception as error:  # noqa: BLE001 - handed to the consumer, which raises it
            queue.put_nowait((index, error))

    def submit_others(i: int, text: str | None, token_ids: list[int], base: SamplingParams) -> None:
        for j in range(1, n):
            seed = None if base.seed is None else (base.seed + j if base.seed + j <= MAX_SEED else base.seed - j)
            stream = _submit(engine, text, token_ids, dataclasses.replace(base, seed=seed), prompt_field)
            tasks.append(asyncio.create_task(pump(i * n + j, stream)))

    try:
        for i, ((text, token_ids), base) in enumerate(zip(prompts, params, strict=True)):
            first = _submit(engine, text, token_ids, base, prompt_field, kv_transfer_params)
            then = None if n == 1 else functools.partial(submit_others, i, text, token_ids, base)
            tasks.append(asyncio.create_task(pump(i * n, first, then)))
        yield None
        unfinished = len(prompts) * n
        while unfinished:
            index, item = await queue.get()
            if isinstance(item, Exception):
                raise item
            unfinished -= item.finished
            yield index, item
    finally:
        for task in tasks:
            task.cancel()  # the unfinished ones are aborted in the engine (their _watch)


def _kv_transfer(body: _SamplingFields, num_prompts: int) -> dict | None:
    """The request's kv_transfer_params (P/D disaggregation), checked against the request's shape;
    the engine checks the object itself (engine/kv_transfer/params.py)."""
    kv = body.kv_transfer_params
    if kv is None:
        return None
    if body.n > 1 or num_prompts > 1:
        raise invalid("kv_transfer_params: only with one prompt and n 1", "kv_transfer_params")
    if kv.get("do_remote_decode") is True and body.stream:
        raise invalid("kv_transfer_params.do_remote_decode: a prefill call is answered whole (its answer carries "
                      "the kv_transfer_params); send stream: false", "stream")
    return kv


def _kv_answer(finals: list[RequestOutput]) -> dict:
    """A prefill call's lease on its prompt's KV, for the decode call (empty for other requests)."""
    params = finals[0].kv_transfer_params if len(finals) == 1 else None
    return {"kv_transfer_params": params} if params is not None else {}


def _usage_of(finals: list[RequestOutput], n: int) -> dict:
    prompt = sum(len(f.prompt_token_ids) for f in finals[::n])
    completion = sum(len(f.outputs[0].token_ids) for f in finals)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


# -- request -> engine -----------------------------------------------------------------------
def _ignored_headers(body: _SamplingFields, request: Request) -> dict[str, str]:
    """Name the accepted-but-ignored fields the request set: a response header and a log line."""
    ignored = body.ignored_fields()
    if not ignored:
        return {}
    logger.info("%s: ignored fields %s (accepted, they do not change the output)", request.url.path,
                ", ".join(ignored))
    return {IGNORED_FIELDS_HEADER: ",".join(ignored)}


class _ChatTools:
    """A chat request's tools (engine/tools): the grammar that forces a call, what the template is
    given, and how the generated text becomes the answer's message."""

    def __init__(self, functions: dict[str, dict], choice: ToolChoice, forced: StructuredOutput | None,
                 template_tools: list[dict] | None, parallel: bool):
        self.functions, self.tool_choice, self.forced = functions, choice, forced
        self.template_tools, self.parallel = template_tools, parallel

    @classmethod
    def of(cls, body: ChatCompletionRequest, tokenizer) -> _ChatTools:
        try:
            functions = check_tools(body.tools or [])
            choice = resolve_choice(body.tool_choice, functions)
        except InvalidRequestError as error:
            raise invalid(str(error), error.param) from None
        parallel = body.parallel_tool_calls is not False
        template = getattr(tokenizer, "chat_template", None)
        if choice.mode == "auto" and not template_defines_tools(template):
            raise invalid('tool_choice: "auto" (the default when tools are sent) needs a chat template that shows '
                          "the model its tools, and this model's template does not use them, so no call could be "
                          'recognised; send tool_choice "required" or {"type": "function", "function": {"name": '
                          '...}} (the call is forced by the structured-output grammar), or "none"', "tool_choice")
        schema = forced_schema(choice, functions, parallel)
        forced = None if schema is None else StructuredOutput.json_schema(schema, "tools")
        template_tools = body.tools if choice.mode != "none" and body.tools else None
        return cls(functions, choice, forced, template_tools, parallel)

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


def _chat_messages(body: ChatCompletionRequest, template_tools: list[dict] | None) -> list[dict]:
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


def _render_chat(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> tuple[str, list[int]]:
    try:
        extra = {"tools": tools} if tools else {}
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, **extra)
    except Exception as error:  # noqa: BLE001 - a template that rejects the conversation
        raise invalid(f"messages: the model's chat template rejected them: {error}", "messages") from None
    return text, tokenizer.encode(text, add_special_tokens=False)


FIM_TOKENS = ("<fim_prefix>", "<fim_suffix>", "<fim_middle>")


def _fill_in_the_middle(tokenizer, prompt, suffix: str) -> str:
    """StarCoder's prefix-suffix-middle prompt, for a model whose vocabulary has the FIM tokens."""
    backend = getattr(tokenizer, "backend", None)
    if backend is None or any(backend.token_to_id(token) is None for token in FIM_TOKENS):
        raise invalid("suffix: this model has no fill-in-the-middle tokens (<fim_prefix>, <fim_suffix>, "
                      "<fim_middle>); leave suffix out", "suffix")
    if not isinstance(prompt, str):
        raise invalid("suffix: only with a text prompt", "suffix")
    return f"<fim_prefix>{prompt}<fim_suffix>{suffix}<fim_middle>"


def _check_logprobs(value: int | None, state: ServerState, field: str) -> None:
    limit = state.options.max_logprobs
    if value is not None and value > limit:
        raise invalid(f"{field}: at most {limit} (the server's --max-logprobs), got {value}", field)


def _token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def _completion_logprobs(tokenizer, token_ids: list[int], entries: list, text_offset: int) -> dict:
    """OpenAI's legacy completions logprobs: tokens, token_logprobs, top_logprobs, text_offset.
    An entry of None (the prompt's first token) gives a null logprob and null top_logprobs."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for token_id, entry in zip(token_ids, entries, strict=True):
        piece = _token_text(tokenizer, token_id)
        tokens.append(piece)
        offsets.append(text_offset)
        text_offset += len(piece)
        if entry is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(entry.logprob)
        top = {_token_text(tokenizer, t): lp for t, lp in entry.top}
        top.setdefault(piece, entry.logprob)  # as vLLM: the chosen token is always among them
        top_logprobs.append(top)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}


def _chat_logprobs(tokenizer, entries: list) -> list[dict]:
    def one(token_id: int, logprob: float) -> dict:
        text = _token_text(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return [{**one(e.token_id, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]} for e in entries]


async def _structured_output(body: _SamplingFields, engine: AsyncEngine,
                             forced_call: StructuredOutput | None = None) -> StructuredOutput | None:
    """The request's structured output (a forced tool call, response_format or one guided_* field),
    compiled here in a worker thread so an invalid schema is a 400 and the engine thread finds it in
    the cache."""
    asked = [forced_call] if forced_call is not None else []
    if body.response_format is not None and body.response_format.type != "text":
        form = body.response_format
        if form.type == "json_object":
            asked.append(StructuredOutput("json_object", "", "response_format"))
        elif form.json_schema is None:
            raise invalid('response_format: type "json_schema" needs a json_schema object '
                          '({"name": ..., "schema": {...}})', "response_format")
        elif form.json_schema.schema_ is None:
            asked.append(StructuredOutput("json_object", "", "response_format"))
        else:
            asked.append(StructuredOutput.json_schema(form.json_schema.schema_, "response_format"))
    if body.guided_json is not None:
        asked.append(StructuredOutput.json_schema(body.guided_json, "guided_json"))
    if body.guided_regex is not None:
        asked.append(StructuredOutput("regex", body.guided_regex, "guided_regex"))
    if body.guided_choice is not None:
        asked.append(StructuredOutput.choice(body.guided_choice))
    if body.guided_grammar is not None:
        asked.append(StructuredOutput("grammar", body.guided_grammar, "guided_grammar"))
    if not asked:
        return None
    if len(asked) > 1:
        raise invalid(f"{asked[1].field}: only one structured output per request, and {asked[0].field} is "
                      "already set; send one of response_format, guided_json, guided_regex, guided_choice, "
                      "guided_grammar", asked[1].field)
    structured = asked[0]
    grammars = getattr(engine.engine.executor, "grammars", None)
    if grammars is None:
        raise invalid(f"{structured.field}: structured outputs need a real model's vocabulary; this server "
                      "runs the fake model (--fake-model)", structured.field)
    try:
        await asyncio.to_thread(grammars.compile, structured)
    except InvalidRequestError as error:
        raise invalid(str(error), error.param) from None
    return structured


def _sampling_params(body: _SamplingFields, max_tokens: int | None, prompt_len: int, engine: AsyncEngine,
                     prompt_field: str, default_max_tokens: int, logprobs: int | None = None,
                     prompt_logprobs: int | None = None,
                     structured: StructuredOutput | None = None) -> SamplingParams:
    max_model_len = engine.engine.config.max_model_len
    if prompt_len >= max_model_len:
        raise invalid(f"{prompt_field}: the prompt has {prompt_len} tokens, but this model's maximum context "
                      f"length is {max_model_len} tokens; shorten it", prompt_field, "context_length_exceeded")
    if max_tokens is not None and prompt_len + max_tokens > max_model_len:
        raise invalid(f"max_tokens: this model's maximum context length is {max_model_len} tokens, but "
                      f"{prompt_len} prompt tokens + max_tokens {max_tokens} exceed it; lower max_tokens to "
                      f"at most {max_model_len - prompt_len}", "max_tokens", "context_length_exceeded")
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    logit_bias = {int(token): bias for token, bias in body.logit_bias.items()} if body.logit_bias else None
    vocab = getattr(engine.engine.tokenizer, "vocab_size", None)
    if logit_bias and vocab is not None and max(logit_bias) >= vocab:
        raise invalid(f"logit_bias: token id {max(logit_bias)} is outside the vocabulary [0, {vocab})", "logit_bias")
    try:
        return SamplingParams(
            temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, seed=body.seed,
            max_tokens=max_tokens or default_max_tokens, stop=stop, stop_token_ids=body.stop_token_ids or [],
            ignore_eos=body.ignore_eos, cache_salt=body.cache_salt, skip_prefix_cache=body.skip_prefix_cache,
            presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
            repetition_penalty=body.repetition_penalty, min_p=body.min_p, min_tokens=body.min_tokens,
            logit_bias=logit_bias, logprobs=logprobs, prompt_logprobs=prompt_logprobs, structured=structured,
        )
    except InvalidRequestError as error:
        raise invalid(str(error), error.param) from None


def _submit(engine: AsyncEngine, text: str | None, token_ids: list[int], params: SamplingParams,
            prompt_field: str, kv_transfer_params: dict | None = None) -> RequestStream:
    try:
        return engine.add_request(text, params, prompt_token_ids=token_ids, kv_transfer_params=kv_transfer_params)
    except InvalidRequestError as error:
        raise invalid(str(error), prompt_field if error.param == "prompt" else error.param) from None
    except QueueFull as error:
        raise overloaded(f"the server is overloaded ({error}); retry after the Retry-After interval", 1) from None
    except NotAccepting as error:
        raise unavailable(str(error), "draining") from None


async def _watch(request: Request, engine: AsyncEngine, stream: RequestStream) -> AsyncIterator[RequestOutput]:
    """The request's outputs; aborts it in the engine if the client goes away first."""
    watcher = asyncio.create_task(_abort_on_disconnect(request, engine, stream))
    try:
        async for out in stream:
            yield out
    finally:
        watcher.cancel()
        if not stream.finished:
            engine.abort(stream.request_id)


async def _abort_on_disconnect(request: Request, engine: AsyncEngine, stream: RequestStream) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            engine.abort(stream.request_id)
            stream.put(ClientDisconnected())
            return
        await asyncio.sleep(0.05)


async def _final_output(request: Request, engine: AsyncEngine, stream: RequestStream,
                        on_output=None) -> RequestOutput:
    final = None
    try:
        async for out in _watch(request, engine, stream):
            final = out
            if on_output is not None:
                on_output()
    except EngineFailed as error:
        raise unavailable(str(error), "engine_failed") from None
    except RequestError as error:
        raise request_failed(str(error)) from None
    except ClientDisconnected:
        raise APIError(499, "client closed the request", "client_closed_request") from None
    return final


# -- server-sent events ----------------------------------------------------------------------
class _Ids:
    def __init__(self, prefix: str, model: str):
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model


def _sse(events: AsyncIterator[dict], headers: dict[str, str] | None = None) -> StreamingResponse:
    async def body() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield f"data: {json.dumps(event, separators=(',', ':'))}\n\n"
        except ClientDisconnected:
            return
        except EngineFailed as error:
            yield f"data: {json.dumps(error_body(str(error), 'server_error', None, 'engine_failed'))}\n\n"
        except RequestError as error:
            failed = request_failed(str(error))
            yield f"data: {json.dumps(error_body(failed.message, failed.type, None, failed.code))}\n\n"
        except APIError as error:  # a later choice refused (429 or 503) after the stream began
            yield f"data: {json.dumps(error_body(error.message, error.type, error.param, error.code))}\n\n"
        finally:
            await events.aclose()  # at once, not at garbage collection: it aborts an unfinished request
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})})


@dataclasses.dataclass(frozen=True, slots=True)
class _StreamUsage:
    """stream_options: a last chunk with the usage of all choices, and (vLLM's continuous_usage_stats)
    each chunk with its own choice's usage so far."""

    final: bool = False
    continuous: bool = False

    @classmethod
    def of(cls, body: _SamplingFields) -> _StreamUsage:
        options = body.stream_options
        return cls(bool(options and options.include_usage), bool(options and options.continuous_usage_stats))

    def of_chunk(self, out: RequestOutput) -> dict | None:
        if not self.continuous:
            return None
        return _usage_of([out], 1)


async def _completion_events(outputs, ids: _Ids, usage: _StreamUsage, n: int, tokenizer=None,
                             echo_texts: list[str] | None = None, logprobs: bool = False):
    """Completion chunks for (index, output) pairs from _stream_choices, each chunk naming its choice."""
    def chunk(index: int, text: str, finish_reason: str | None, chunk_logprobs: dict | None = None) -> dict:
        event = {"id": ids.id, "object": "text_completion", "created": ids.created, "model": ids.model,
                 "choices": [{"index": index, "text": text, "logprobs": chunk_logprobs,
                              "finish_reason": finish_reason}]}
        if usage.final or usage.continuous:
            event["usage"] = usage.of_chunk(out)
        return event

    finals: dict[int, RequestOutput] = {}
    sent: dict[int, int] = {}  # generated tokens whose logprobs went out, per choice
    offsets: dict[int, int] = {}
    async with contextlib.aclosing(outputs):  # an early stop aborts the choices
        async for index, out in outputs:
            echo_text = (echo_texts or [""] * (index // n + 1))[index // n]
            if index not in offsets:
                offsets[index], sent[index] = len(echo_text), 0
                if echo_text:
                    entries = list(out.prompt_logprobs or [None] * len(out.prompt_token_ids))
                    yield chunk(index, echo_text, None, _completion_logprobs(tokenizer, out.prompt_token_ids, entries, 0)
                                if logprobs else None)
            finals[index] = out
            completion = out.outputs[0]
            chunk_logprobs = None
            if logprobs and completion.logprobs and len(completion.logprobs) > sent[index]:
                new = completion.logprobs[sent[index]:]
                chunk_logprobs = _completion_logprobs(tokenizer, [e.token_id for e in new], new, offsets[index])
                sent[index] = len(completion.logprobs)
            offsets[index] += len(completion.new_text)
            if completion.new_text or out.finished or chunk_logprobs:
                yield chunk(index, completion.new_text, completion.finish_reason if out.finished else None,
                            chunk_logprobs)
    if usage.final and finals:
        yield _usage_chunk(ids, "text_completion", [finals[i] for i in sorted(finals)], n)


async def _chat_events(outputs, ids: _Ids, usage: _StreamUsage, n: int, tokenizer=None, logprobs: bool = False,
                       tools: _ChatTools | None = None):
    """Chat chunks for (index, output) pairs from _stream_choices, each chunk naming its choice. With
    tools (other than "none") a choice's text is held back until it ends, then sent as its tool calls
    (or as content, if it holds none)."""
    def chunk(index: int, delta: dict, finish_reason: str | None, chunk_logprobs: dict | None = None) -> dict:
        event = {"id": ids.id, "object": "chat.completion.chunk", "created": ids.created, "model": ids.model,
                 "choices": [{"index": index, "delta": delta, "logprobs": chunk_logprobs,
                              "finish_reason": finish_reason}]}
        if usage.final or usage.continuous:
            event["usage"] = usage.of_chunk(out)
        return event

    holding = tools is not None and tools.tool_choice.mode != "none"
    finals: dict[int, RequestOutput] = {}
    sent: dict[int, int] = {}
    async with contextlib.aclosing(outputs):  # an early stop aborts the choices
        async for index, out in outputs:
            if index not in sent:
                sent[index] = 0
                yield chunk(index, {"role": "assistant", "content": ""}, None)
            finals[index] = out
            completion = out.outputs[0]
            chunk_logprobs = None
            if logprobs and completion.logprobs and len(completion.logprobs) > sent[index]:
                chunk_logprobs = {"content": _chat_logprobs(tokenizer, completion.logprobs[sent[index]:])}
                sent[index] = len(completion.logprobs)
            if holding:
                if chunk_logprobs:
                    yield chunk(index, {}, None, chunk_logprobs)
                if out.finished:
                    message, finish_reason = tools.message(completion.text, completion.finish_reason)
                    delta = {"content": message["content"]} if message["content"] else {}
                    if message.get("tool_calls"):
                        delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(message["tool_calls"])]
                    if delta:
                        yield chunk(index, delta, None)
                    yield chunk(index, {}, finish_reason)
                continue
            if completion.new_text or chunk_logprobs:
                yield chunk(index, {"content": completion.new_text}, None, chunk_logprobs)
            if out.finished:
                yield chunk(index, {}, completion.finish_reason)
    if usage.final and finals:
        yield _usage_chunk(ids, "chat.completion.chunk", [finals[i] for i in sorted(finals)], n)


def _usage_chunk(ids: _Ids, kind: str, finals: list[RequestOutput], n: int) -> dict:
    return {"id": ids.id, "object": kind, "created": ids.created, "model": ids.model, "choices": [],
            "usage": _usage_of(finals, n)}

