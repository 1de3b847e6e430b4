"""What each engine step did and where its time went: the newest records kept in memory (a bounded
ring every engine holds, read by the admin API's `GET /admin/steps`, from which the operator fits
its SLO step profile online), and optionally every record written to a JSON-lines file
(`--step-log`, read by `iterserve simulate fit`).

A record is one step's figures in the order of FIELDS, numbered by `seq` (1, 2, ... with no gap
over the engine's life, so a reader that sees a gap knows records fell out of the ring before it
read them). The ring stores a tuple per step; the dict a reader sees is built when it reads, so
an engine nobody reads pays for an append and nothing else.
"""

from __future__ import annotations

import itertools
import json
import threading
from collections import deque
from typing import IO

# The fields of a step record, in the order the ring stores them (engine/llm_engine.py fills them;
# engine/server/protocol.py's StepRecord documents each one, and a test keeps the two the same).
FIELDS = ("seq", "step", "time", "duration_s", "cpu_s", "load_1m", "schedule_s", "model_s", "postprocess_s",
          "prefill_tokens", "decode_tokens", "num_seqs", "context_tokens", "max_context_tokens",
          "prefill_attention_pairs", "running", "waiting", "kv_blocks_used", "kv_blocks_cached", "preemptions")
RING_CAPACITY = 4096  # records kept: ~20 s of steps at 200 steps/s, ~1 MiB of tuples


def as_record(values: tuple) -> dict:
    return dict(zip(FIELDS, values, strict=True))


class StepRecords:
    """The newest `capacity` step records. The engine thread appends; any thread reads."""

    def __init__(self, capacity: int = RING_CAPACITY):
        if capacity < 1:
            raise ValueError(f"step record capacity {capacity}: must be at least 1")
        self.capacity = capacity
        self._ring: deque[tuple] = deque(maxlen=capacity)
        self._lock = threading.Lock()
        self.last_seq = 0  # the newest record's seq; 0 before the first step

    def append(self, values: tuple) -> tuple:
        """Adds one step's figures (FIELDS without seq); returns the stored tuple."""
        with self._lock:
            self.last_seq += 1
            stored = (self.last_seq, *values)
            self._ring.append(stored)
        return stored

    def after(self, seq: int, limit: int) -> tuple[list[tuple], int, int]:
        """(up to `limit` records with seq > `seq`, oldest first; the oldest seq held, 0 when
        empty; the newest seq). Seqs are consecutive, so the start is an index, not a search."""
        with self._lock:
            last = self.last_seq
            first = last - len(self._ring) + 1 if self._ring else 0
            if not self._ring or seq >= last:
                return [], first, last
            start = max(0, seq + 1 - first)
            return list(itertools.islice(self._ring, start, start + max(0, limit))), first, last


class StepLog:
    def __init__(self, path: str):
        self._file: IO[str] = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115

    def write(self, record: dict) -> None:
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")

    def close(self) -> None:
        self._file.close()
