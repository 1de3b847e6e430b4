"""A request's choices in the engine: submit them, watch them, abort them.

In: the tokenized prompts, one SamplingParams each, and n (choices per prompt). Out: every choice's
outputs as they come, as (index, output) with prompt i's choice j at index i*n + j, or, for an
answer sent whole, each choice's final output in index order.

A prompt's first choice goes to the engine at once; its other n-1 go once it has produced an
output (it is prefilled), so with prefix caching they reuse its full KV blocks and prefill only the
last partial block. A seed s gives choice j seed s+j. A client that goes away has its choices
aborted at the engine's next step, which frees their KV blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
from collections.abc import AsyncIterator, Callable

from fastapi import Request

from iterserve.engine.lora.adapter import UnknownAdapterError
from iterserve.engine.outputs import RequestOutput
from iterserve.engine.sampling_params import MAX_SEED, InvalidRequestError, SamplingParams
from iterserve.engine.server.async_engine import (
    AsyncEngine,
    EngineFailed,
    NotAccepting,
    QueueFull,
    RequestCut,
    RequestError,
    RequestStream,
)
from iterserve.engine.server.errors import (
    APIError,
    invalid,
    overloaded,
    request_cut,
    request_error,
    unavailable,
)

Prompt = tuple[str | None, list[int]]  # the prompt's text (None when sent as token ids) and its tokens


class ClientDisconnected(Exception):
    pass


@dataclasses.dataclass(frozen=True, slots=True)
class Choices:
    """What to run: each prompt with its sampling, n choices of each."""

    prompts: list[Prompt]
    params: list[SamplingParams]
    n: int
    prompt_field: str  # the request field an invalid prompt is reported against
    kv_transfer_params: dict | None = None  # P/D: only with one prompt and n 1
    lora_name: str | None = None  # the LoRA adapter every choice runs (engine/lora), None: the base model

    @property
    def count(self) -> int:
        return len(self.prompts) * self.n


def choice_seed(base: SamplingParams, j: int) -> int | None:
    """Choice j's seed: distinct per choice, and still within [0, MAX_SEED]."""
    if base.seed is None:
        return None
    return base.seed + j if base.seed + j <= MAX_SEED else base.seed - j


async def stream_choices(request: Request, engine: AsyncEngine,
                         choices: Choices) -> AsyncIterator[tuple[int, RequestOutput] | None]:
    """Every choice's outputs as they come, as (index, output). The first value yielded is None, once
    every prompt's first choice is submitted: their refusals (429, 503) raise before any byte is sent.
    A choice's error is raised here, in the consumer; leaving early aborts the unfinished choices."""
    queue: asyncio.Queue = asyncio.Queue()
    tasks: list[asyncio.Task] = []

    async def pump(index: int, stream: RequestStream, then: Callable[[], None] | None = None) -> None:
        try:
            async for out in _watch(request, engine, stream):
                if then is not None:
                    then()
                    then = None
                queue.put_nowait((index, out))
        except Exception as error:  # noqa: BLE001 - handed to the consumer, which raises it
            queue.put_nowait((index, error))

    def submit_others(i: int, prompt: Prompt, base: SamplingParams) -> None:
        for j in range(1, choices.n):
            params = dataclasses.replace(base, seed=choice_seed(base, j))
            tasks.append(asyncio.create_task(pump(i * choices.n + j, _submit(engine, prompt, params, choices))))

    try:
        for i, (prompt, base) in enumerate(zip(choices.prompts, choices.params, strict=True)):
            first = _submit(engine, prompt, base, choices, choices.kv_transfer_params)
            then = None if choices.n == 1 else functools.partial(submit_others, i, prompt, base)
            tasks.append(asyncio.create_task(pump(i * choices.n, first, then)))
        yield None
        unfinished = choices.count
        while unfinished:
            index, item = await queue.get()
            if isinstance(item, Exception):
                raise item
            unfinished -= item.finished
            yield index, item
    finally:
        for task in tasks:
            task.cancel()  # the unfinished ones are aborted in the engine (their _watch)


async def started_stream(request: Request, engine: AsyncEngine, choices: Choices):
    """stream_choices with its requests already submitted, so a refusal (429, 503) is still an
    HTTP status and not an event in a 200 stream."""
    outputs = stream_choices(request, engine, choices)
    await outputs.asend(None)
    return outputs


async def final_outputs(request: Request, engine: AsyncEngine, choices: Choices) -> list[RequestOutput]:
    """Every choice's last output, in index order; a choice's failure is the answer's HTTP error."""
    finals: dict[int, RequestOutput] = {}
    async with contextlib.aclosing(stream_choices(request, engine, choices)) as outputs:
        await outputs.asend(None)
        try:
            async for index, out in outputs:
                finals[index] = out
        except EngineFailed as error:
            raise unavailable(str(error), "engine_failed") from None
        except RequestError as error:
            raise request_error(error) from None
        except RequestCut as error:  # cut by the drain: a 503, never a 200 with truncated text
            raise request_cut(str(error)) from None
        except ClientDisconnected:
            raise APIError(499, "client closed the request", "client_closed_request") from None
    return [finals[index] for index in range(choices.count)]


def _submit(engine: AsyncEngine, prompt: Prompt, params: SamplingParams, choices: Choices,
            kv_transfer_params: dict | None = None) -> RequestStream:
    text, token_ids = prompt
    try:
        return engine.add_request(text, params, prompt_token_ids=token_ids, kv_transfer_params=kv_transfer_params,
                                  lora_name=choices.lora_name)
    except UnknownAdapterError as error:  # unloaded between the model check and here
        raise APIError(404, str(error), "invalid_request_error", "model", "model_not_found") from None
    except InvalidRequestError as error:
        raise invalid(str(error), choices.prompt_field if error.param == "prompt" else error.param) from None
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
