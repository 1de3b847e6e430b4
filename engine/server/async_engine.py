"""The engine loop in its own thread, and an asyncio stream per request.

The event loop only validates, enqueues and reads streams; all model work happens on the engine
thread, which sleeps on a condition while there is nothing to do. After each step the thread
hands that step's outputs to the event loop in one `call_soon_threadsafe`, which routes them to
the requests' streams.

Admission control lives here too: a bounded waiting queue (beyond it, QueueFull -> 429) and
draining (NotAccepting -> 503).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable

from iterserve.engine.llm_engine import EngineStats, LLMEngine
from iterserve.engine.outputs import RequestOutput
from iterserve.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class QueueFull(Exception):
    pass


class NotAccepting(Exception):
    """The engine is loading, draining or has failed."""


class EngineFailed(Exception):
    pass


class RequestStream:
    """One request's outputs, in order; iteration ends after the finished output."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        self._queue: asyncio.Queue[RequestOutput | Exception] = asyncio.Queue()
        self.finished = False

    def put(self, item: RequestOutput | Exception) -> None:
        self._queue.put_nowait(item)

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while not self.finished:
            item = await self._queue.get()
            if isinstance(item, Exception):
                self.finished = True
                raise item
            self.finished = item.finished
            yield item


class AsyncEngine:
    def __init__(
        self,
        engine: LLMEngine,
        max_waiting_requests: int,
        on_step: Callable[[list[RequestOutput]], None] | None = None,
    ):
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self.on_step = on_step
        self.draining = False
        self.failed: BaseException | None = None
        self._streams: dict[str, RequestStream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._ids = 0

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)
        self.engine.close()

    # -- the event loop side ---------------------------------------------------------------------
    def add_request(
        self, prompt: str | None, params: SamplingParams, prompt_token_ids: list[int] | None = None
    ) -> RequestStream:
        """Queue a request; raises InvalidRequestError, QueueFull or NotAccepting."""
        if self.failed is not None:
            raise NotAccepting("the engine failed; see the server log")
        if self.draining:
            raise NotAccepting("the server is draining and accepts no new requests")
        if self.engine.stats().num_waiting >= self.max_waiting_requests:
            raise QueueFull(f"{self.max_waiting_requests} requests are already waiting")
        self._ids += 1
        request_id = f"{self._ids:x}-{time.monotonic_ns():x}"
        stream = RequestStream(request_id)
        self._streams[request_id] = stream
        try:
            self.engine.add_request(prompt, params, prompt_token_ids=prompt_token_ids, request_id=request_id)
        except BaseException:
            del self._streams[request_id]
            raise
        self._notify()
        return stream

    def abort(self, request_id: str) -> None:
        """Stop a request at the next step and free its KV blocks (a client went away)."""
        if self._streams.pop(request_id, None) is not None:
            self.engine.abort_request(request_id)
            self._notify()

    def abort_all(self) -> None:
        for request_id in list(self._streams):
            self.engine.abort_request(request_id)
        self._notify()

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def set_max_num_seqs(self, value: int) -> int:
        previous = self.engine.set_max_num_seqs(value)
        self._notify()
        return previous

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # aborted by its client
            stream.put(out)
            if out.finished:
                del self._streams[out.request_id]

    def _fail_all(self, error: BaseException) -> None:
        self.failed = error
        for stream in self._streams.values():
            stream.put(EngineFailed("the engine failed; see the server log"))
        self._streams.clear()

    def _notify(self) -> None:
        with self._wake:
            self._wake.notify()

    # -- the engine thread -----------------------------------------------------------------------
    def _observe(self, outputs: list[RequestOutput]) -> None:
        try:
            self.on_step(outputs)
        except Exception:  # noqa: BLE001 - a metrics bug must not stop serving
            logger.exception("recording step metrics failed")

    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                with self._wake:
                    while not self._stopping and not engine.has_unfinished_requests():
                        self._wake.wait()
                    if self._stopping:
                        return
                outputs = engine.step()
                if self.on_step is not None:
                    self._observe(outputs)
                if outputs:
                    self._loop.call_soon_threadsafe(self._deliver, outputs)
        except BaseException as error:  # noqa: BLE001 - the thread must report, not vanish
            logger.exception("engine step failed; the server stops accepting requests")
            if self._loop is not None and not self._loop.is_closed():
                self._loop.call_soon_threadsafe(self._fail_all, error)
