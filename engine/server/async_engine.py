"""The engine loop in its own thread, and an asyncio stream per request.

The event loop only validates, enqueues and reads streams; all model work happens on the engine
thread, which sleeps on a condition while there is nothing to do, or while nothing can be scheduled
until something changes (a new request, an abort, a new max_num_seqs), so an idle engine never spins. After each step the thread
hands that step's outputs to the event loop in one `call_soon_threadsafe`, which routes them to
the requests' streams.

Admission control lives here too: a bounded waiting queue (beyond it, QueueFull -> 429) and
draining (NotAccepting -> 503).

A request that fails on its own (see engine/step_result.py) ends its stream with RequestError; the
engine carries on. A request still running when a drain runs out of time ends with RequestCut, never
as a finished output: its text is incomplete, and the server answers it as an error (503, or an SSE
error event without `[DONE]`) so that neither the router nor the client takes it for a whole answer.
If the engine loop itself dies, every stream ends with EngineFailed, `failed` is set and `alive`
turns false, which GET /health reports as 503.
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


class RequestError(Exception):
    """This request failed on its own (its output carries the error); the engine carried on. param: the
    request field at fault where the request's own input made it fail (a 400), else None (a 500)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class RequestCut(Exception):
    """The server stopped this request before it finished (the drain timeout passed): what was
    generated so far is not an answer."""


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
            if item.error is not None:
                self.finished = True
                raise RequestError(item.error, item.error_param)
            self.finished = item.finished
            yield item


class AsyncEngine:
    def __init__(
        self,
        engine: LLMEngine,
        max_waiting_requests: int,
        on_step: Callable[[list[RequestOutput]], None] | None = None,
        on_failure: Callable[[BaseException], None] | None = None,
    ):
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self.on_step = on_step
        self.on_failure = on_failure
        self.draining = False
        self.failed: BaseException | None = None
        self._streams: dict[str, RequestStream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake = threading.Condition()
        self._stopping = False
        self._changes = 0  # bumped on every notify, so the thread never misses a wake-up
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._ids = 0

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.engine.set_wake(self._notify)  # a finished KV pull or a released lease wakes the loop
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
        self, prompt: str | None, params: SamplingParams, prompt_token_ids: list[int] | None = None,
        kv_transfer_params: dict | None = None, lora_name: str | None = None,
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
            self.engine.add_request(prompt, params, prompt_token_ids=prompt_token_ids, request_id=request_id,
                                    kv_transfer_params=kv_transfer_params, lora_name=lora_name)
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

    def abort_all(self, reason: str = "the server shut down (its --drain-timeout passed) before this request "
                  "finished") -> None:
        """Cut every request in flight: each stream ends with RequestCut(reason) now, and the engine
        frees their KV at its next step (its "abort" outputs then find no stream)."""
        streams, self._streams = self._streams, {}
        for request_id, stream in streams.items():
            stream.put(RequestCut(reason))
            self.engine.abort_request(request_id)
        self._notify()

    @property
    def alive(self) -> bool:
        """False once the engine loop has died (or was stopped): what GET /health reports."""
        group_failure = getattr(self.engine.executor, "group_failure", None)  # a tensor-parallel rank died
        if group_failure is not None and self.failed is None:
            self.failed = group_failure
        return self.failed is None and (self._thread.is_alive() or not self._thread.ident)

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
            self._changes += 1
            self._wake.notify()

    # -- the engine thread -----------------------------------------------------------------------
    def _observe(self, outputs: list[RequestOutput]) -> None:
        try:
            self.on_step(outputs)
        except Exception:  # noqa: BLE001 - a metrics bug must not stop serving
            logger.exception("recording step metrics failed")

    def _run(self) -> None:
        engine = self.engine
        # After a step that did nothing (requests wait for room that only an abort, a new request or
        # a new max_num_seqs can make), the next step waits for such a change instead of spinning.
        stalled_at: int | None = None
        try:
            while True:
                with self._wake:
                    while not self._stopping and (
                        not engine.has_unfinished_requests() or stalled_at == self._changes
                    ):
                        # Leases released by decode engines or past their expiry are freed even while
                        # idle (then the wait below times out at least every second).
                        leases = engine.kv_connector is not None and engine.kv_connector.num_leases
                        if leases:
                            engine.collect_kv_leases()
                        timeout = 1.0 if stalled_at is not None or leases else None
                        if not self._wake.wait(timeout=timeout):
                            stalled_at = None  # a periodic retry, in case a change came unannounced
                    if self._stopping:
                        return
                    changes = self._changes
                outputs = engine.step()
                stalled_at = changes if engine.last_step_was_idle else None
                if self.on_step is not None:
                    self._observe(outputs)
                if outputs:
                    self._loop.call_soon_threadsafe(self._deliver, outputs)
        except BaseException as error:  # noqa: BLE001 - the thread must report, not vanish
            logger.exception("the engine loop died (%s: %s), a fault no single request caused; GET /health "
                             "now answers 503 so that the liveness probe restarts this server",
                             type(error).__name__, error)
            self.failed = self.failed or error
            if self.on_failure is not None:
                try:
                    self.on_failure(error)
                except Exception:  # noqa: BLE001
                    logger.exception("recording the engine failure failed")
            if self._loop is not None and not self._loop.is_closed():
                self._loop.call_soon_threadsafe(self._fail_all, error)
