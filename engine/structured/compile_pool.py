"""Where the server compiles structured outputs: a small thread pool of their own, bounded, with a deadline.

In: a request's `StructuredOutput`, from the event loop. Out: the same spec with its compiled grammar
pinned on it (`StructuredOutput.compiled`), which the request carries into the engine, so the engine
thread never compiles, even if the shared cache has evicted the spec since. Refusals: CompileBusy
(the pool's queue is full: 503, retry) and InvalidRequestError naming the field when a compile passes
the deadline (400: the same spec would pass it again).

Why a pool of its own: compiles on asyncio's default executor would share it with tokenizing, so a
burst of expensive schemas would stall every prompt. A Python thread cannot be stopped, so a compile
past its deadline keeps its worker until it ends, and still counts against the queue until then:
however many slow specs arrive, at most `workers` threads compile and `max_pending` wait. The limits
in limits.py keep each compile short; the deadline is the backstop.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future, ThreadPoolExecutor

from iterserve.engine.sampling_params import InvalidRequestError

WORKERS = 2
MAX_PENDING = 32  # compiles running or queued, over the whole server
TIMEOUT_S = 10.0


class CompileBusy(Exception):
    """The compile queue is full; the request is refused before any work (503, Retry-After)."""


class CompilePool:
    def __init__(self, grammars, workers: int = WORKERS, max_pending: int = MAX_PENDING,
                 timeout_s: float = TIMEOUT_S):
        self.grammars = grammars
        self.max_pending = max_pending
        self.timeout_s = timeout_s
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="grammar-compile")
        self._lock = threading.Lock()
        self._pending = 0
        self._vocabulary: Future | None = None

    @property
    def pending(self) -> int:
        return self._pending

    async def compile(self, structured):
        """`structured` with its compiled grammar pinned; a cached spec is answered without a thread hop."""
        compiled = self.grammars.cached(structured)
        if compiled is None:
            await self._vocabulary_index()
            compiled = await self._run(structured)
        return structured.pinned(compiled)

    async def _vocabulary_index(self) -> None:
        # Built once per server (seconds for a large vocabulary), outside any request's deadline.
        with self._lock:
            if self._vocabulary is None:
                self._vocabulary = self._executor.submit(lambda: self.grammars.compiler)
        await asyncio.wrap_future(self._vocabulary)

    async def _run(self, structured):
        with self._lock:
            if self._pending >= self.max_pending:
                raise CompileBusy(f"{structured.field}: {self._pending} structured outputs are already being "
                                  "compiled (the server's limit); retry after the Retry-After interval")
            self._pending += 1
        future = self._executor.submit(self.grammars.compile, structured)
        future.add_done_callback(self._release)  # when the work ends, not when the request gives up
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), self.timeout_s)
        except TimeoutError:
            raise InvalidRequestError(
                f"{structured.field}: compiling it into a grammar took over {self.timeout_s:g} s (the server's "
                "limit); simplify the schema: fewer nested levels, smaller counts and patterns",
                structured.field) from None

    def _release(self, _future: Future) -> None:
        with self._lock:
            self._pending -= 1

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
