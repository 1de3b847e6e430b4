"""A load phase that goes on until the loop's answer to it can be seen.

A phase's load runs its set seconds. On a loaded machine the answer the phase is there to provoke
(new pods Ready, a retuned pod's preemption rate over a whole window) can come after those seconds,
and a check on the shorter phase would then judge the machine's speed, not the operator's. `go_on`
keeps the same load going, in chunks, until `answered()` holds or `most_seconds` more have passed;
the checks still judge what the run shows, so a loop that never answers still fails.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from iterserve.engine.loadgen import LoadSpec, run_load

CHUNK_SECONDS = 5.0


async def go_on(answered: Callable[[], bool], chunk_spec: Callable[[float, int], LoadSpec], most_seconds: float,
                tasks: list[asyncio.Task]) -> float:
    """Sends `chunk_spec(seconds, chunk number)` chunks until `answered()` or `most_seconds`; the
    chunks' tasks join `tasks` (the caller awaits them). Returns the seconds it went on."""
    began, chunk = time.monotonic(), 0
    while not answered() and (left := began + most_seconds - time.monotonic()) > 0.05:
        piece = min(CHUNK_SECONDS, left)
        chunk += 1
        tasks.append(asyncio.create_task(run_load(chunk_spec(piece, chunk))))
        await asyncio.sleep(piece)
    return time.monotonic() - began


def ready_at_least(sampler, key: str, count: int, since: float) -> Callable[[], bool]:
    """A timeline row from `since` (seconds on the timeline) on with `key` (replicas_ready,
    prefill_ready) at `count` or more."""
    def answered() -> bool:
        return any((row.get(key) or 0) >= count for row in list(sampler.timeline.rows)
                   if "error" not in row and row["t"] >= since)
    return answered
