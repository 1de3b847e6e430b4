"""POST /v1/completions: one or more prompts (text or token ids), with echo, logprobs, FIM
(`suffix`), structured outputs and P/D parameters, answered whole or as a stream of text_completion
events. `max_tokens: 0` with `echo` scores the prompt and generates nothing."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses

from fastapi import APIRouter, Request, Response

from iterserve.engine.outputs import RequestOutput
from iterserve.engine.server.envelope import ResponseIds, StreamUsage, usage_of
from iterserve.engine.server.errors import invalid
from iterserve.engine.server.fan_out import Choices, Prompt, final_outputs, started_stream
from iterserve.engine.server.fim import fill_in_the_middle
from iterserve.engine.server.logprobs_format import completion_logprobs
from iterserve.engine.server.pd_params import answer_kv_transfer, request_kv_transfer
from iterserve.engine.server.prompt_length import check_prompt_chars
from iterserve.engine.server.protocol import ERROR_RESPONSES, CompletionRequest, CompletionResponse
from iterserve.engine.server.request_params import (
    check_logprobs,
    ignored_headers,
    sampling_params,
    structured_output,
)
from iterserve.engine.server.sse import sse_response
from iterserve.engine.server.state import ServerState

router = APIRouter()
KIND = "text_completion"


@router.post("/v1/completions", response_model=CompletionResponse, responses=ERROR_RESPONSES)
async def create_completion(body: CompletionRequest, request: Request, response: Response):
    state: ServerState = request.app.state.server
    headers = ignored_headers(body, request)
    engine = state.engine_for(body.model)
    if body.best_of is not None and body.best_of != body.n:
        raise invalid(f"best_of: only best_of equal to n ({body.n}) is supported, got {body.best_of}", "best_of")
    prompt_only = body.max_tokens == 0  # echo the prompt (and its logprobs), generate nothing
    if prompt_only and (not body.echo or body.stream):
        raise invalid("max_tokens: 0 only with echo: true and without stream", "max_tokens")
    tokenizer = engine.engine.tokenizer
    prompts = _prompts(body, tokenizer)
    longest = max((len(p) for p in prompts if isinstance(p, str)), default=0)
    check_prompt_chars(longest, tokenizer, engine.engine.config.max_model_len, "prompt")  # before tokenizing
    encoded = await _encode(tokenizer, prompts)
    check_logprobs(body.logprobs, state, "logprobs")
    structured = await structured_output(body, engine)
    params = [
        sampling_params(body, 1 if prompt_only else body.max_tokens, len(token_ids), engine, "prompt",
                        default_max_tokens=16, logprobs=body.logprobs,
                        prompt_logprobs=body.logprobs if body.echo and body.logprobs is not None else None,
                        structured=None if prompt_only else structured)
        for _, token_ids in encoded
    ]
    ids = ResponseIds("cmpl", state.model_name)
    echo_texts = await _echo_texts(tokenizer, encoded) if body.echo else [""] * len(encoded)
    choices = Choices(encoded, params, body.n, "prompt", request_kv_transfer(body, len(encoded)),
                      lora_name=state.lora_of(body.model))
    if body.stream:
        outputs = await started_stream(request, engine, choices)
        events = _completion_events(outputs, ids, StreamUsage.of(body), body.n, tokenizer, echo_texts,
                                    body.logprobs is not None)
        return sse_response(events, headers)
    finals = await final_outputs(request, engine, choices)
    response.headers.update(headers)
    if prompt_only:
        finals = [_drop_generated(final) for final in finals]
    answers = [await _choice(index, final, body, tokenizer, encoded[index // body.n][1], echo_texts[index // body.n])
               for index, final in enumerate(finals)]
    return ids.body(KIND, answers, usage=usage_of(finals, body.n), **answer_kv_transfer(finals))


def _prompts(body: CompletionRequest, tokenizer) -> list:
    """The request's prompts (one, or a batch of texts or token-id lists), with FIM applied."""
    prompt = body.prompt
    prompts = prompt if isinstance(prompt, list) and isinstance(prompt[0], (str, list)) else [prompt]
    if body.suffix:
        prompts = [fill_in_the_middle(tokenizer, p, body.suffix) for p in prompts]
    return prompts


async def _encode(tokenizer, prompts: list) -> list[Prompt]:
    """Each prompt as (text, token ids); tokenized in a worker thread so a huge prompt never stalls
    other requests' streams."""
    encoded = []
    for prompt in prompts:
        if isinstance(prompt, str):
            encoded.append((prompt, await asyncio.to_thread(tokenizer.encode, prompt)))
        else:
            encoded.append((None, list(prompt)))
    return encoded


async def _echo_texts(tokenizer, encoded: list[Prompt]) -> list[str]:
    return [text if text is not None else await asyncio.to_thread(tokenizer.decode, token_ids)
            for text, token_ids in encoded]


def _drop_generated(final: RequestOutput) -> RequestOutput:
    """max_tokens 0: the one token generated to run the prompt through the model is dropped."""
    out = dataclasses.replace(final.outputs[0], text="", token_ids=[], logprobs=None, finish_reason="length")
    return dataclasses.replace(final, outputs=[out])


async def _choice(index: int, final: RequestOutput, body: CompletionRequest, tokenizer, token_ids: list[int],
                  echo_text: str) -> dict:
    out = final.outputs[0]
    logprobs = None
    if body.logprobs is not None:
        prompt_ids = list(token_ids) if body.echo else []
        generated = list(out.logprobs or [])
        generated += [None] * (len(out.token_ids) - len(generated))  # an executor that records none (fake)
        entries = (list(final.prompt_logprobs or [None] * len(prompt_ids)) if body.echo else []) + generated
        logprobs = await asyncio.to_thread(completion_logprobs, tokenizer, prompt_ids + list(out.token_ids),
                                           entries, 0)
    return {"index": index, "text": echo_text + out.text, "logprobs": logprobs, "finish_reason": out.finish_reason}


async def _completion_events(outputs, ids: ResponseIds, usage: StreamUsage, n: int, tokenizer,
                             echo_texts: list[str], logprobs: bool):
    """Completion chunks for (index, output) pairs from stream_choices, each chunk naming its choice."""
    def chunk(index: int, out: RequestOutput, text: str, finish_reason: str | None,
              chunk_logprobs: dict | None = None) -> dict:
        choice = {"index": index, "text": text, "logprobs": chunk_logprobs, "finish_reason": finish_reason}
        return usage.chunk(ids, KIND, choice, out)

    finals: dict[int, RequestOutput] = {}
    sent: dict[int, int] = {}  # generated tokens whose logprobs went out, per choice
    offsets: dict[int, int] = {}  # text offset of the choice's next token
    async with contextlib.aclosing(outputs):  # an early stop aborts the choices
        async for index, out in outputs:
            echo_text = echo_texts[index // n]
            if index not in offsets:
                offsets[index], sent[index] = len(echo_text), 0
                if echo_text:
                    yield chunk(index, out, echo_text, None, _echo_logprobs(tokenizer, out) if logprobs else None)
            finals[index] = out
            completion = out.outputs[0]
            chunk_logprobs = None
            if logprobs and completion.logprobs and len(completion.logprobs) > sent[index]:
                new = completion.logprobs[sent[index]:]
                chunk_logprobs = completion_logprobs(tokenizer, [e.token_id for e in new], new, offsets[index])
                sent[index] = len(completion.logprobs)
            offsets[index] += len(completion.new_text)
            if completion.new_text or out.finished or chunk_logprobs:
                yield chunk(index, out, completion.new_text, completion.finish_reason if out.finished else None,
                            chunk_logprobs)
    for last in usage.last_chunk(ids, KIND, finals, n):
        yield last


def _echo_logprobs(tokenizer, out: RequestOutput) -> dict:
    entries = list(out.prompt_logprobs or [None] * len(out.prompt_token_ids))
    return completion_logprobs(tokenizer, out.prompt_token_ids, entries, 0)
