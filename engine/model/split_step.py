"""Split execution of big CPU steps: the step's chunks in two groups, each run through the model
at the same time on its own thread with one torch thread, then sampled as one batch.

In: a step's chunks (ScheduledChunk) and their costs. Out: two groups of chunk indices, balanced
by cost (`plan_split`), and a persistent pair of worker threads that run a function per group
under inference mode with one torch thread (`StepSplit.run`). The model runner builds each
group's batch, runs model + LM head on its sampled rows in a worker, and puts the logits back in
the step's chunk order before the sampler sees them.

Why: one model call with two OpenMP threads synchronises the team at every op (hundreds per
step), and under OMP_WAIT_POLICY=PASSIVE each sync is a futex wake-up of a sleeping worker. Two
half batches on one thread each need no sync at all (torch ops and the ctypes attention kernel
release the GIL). On the 2-vCPU AMD EPYC, w8a8, OMP_WAIT_POLICY=PASSIVE as served, load ~0
(bench/kernels/step_profile.py --split-sweep, docs/perf/step_split.json): split against one call on 2
threads, decodes at 128 tokens of context: 64 sequences 171 vs 223 ms (1.31x), 48 1.43x, 32 1.18x,
but 24 0.94x, 16 0.96x, 4 0.58x; prefills of 16 prompts x 32 tokens 591 vs 701 ms (1.19x), 8
prompts + 32 decodes 1.26x. So steps of at least `min_tokens` tokens split, and a step whose
heaviest chunk is most of its work (one long prefill) keeps intra-op threads.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from iterserve.engine.model import cpu_w8a8

# Steps with fewer tokens run as one call (24 decodes: 0.94x, 32: 1.18x; see the module docstring).
SPLIT_MIN_TOKENS = 32
# A split whose heavier group has more than this share of the step's cost gains too little.
MAX_GROUP_SHARE = 0.7
# One token's query against one cached token (30 layers x 9 heads x 64 dims, q.k and p.v) costs
# about this fraction of a token's linears (~107M MACs); a sampled row adds the LM head (~28M).
ATTENTION_PER_PAIR = 1 / 3000
LM_HEAD_PER_SAMPLE = 0.26

T = TypeVar("T")


def chunk_cost(start: int, num_tokens: int, sample: bool) -> float:
    """Relative compute of a chunk of num_tokens tokens at positions start.. (in token-linears)."""
    pairs = num_tokens * start + num_tokens * (num_tokens + 1) // 2  # causal: token p attends p + 1 tokens
    return num_tokens + pairs * ATTENTION_PER_PAIR + (LM_HEAD_PER_SAMPLE if sample else 0.0)


def plan_split(costs: Sequence[float], max_share: float = MAX_GROUP_SHARE) -> tuple[list[int], list[int]] | None:
    """Two groups of indices into costs (each in ascending order), the heavier first, balanced by
    greedy longest-first assignment; None when there are fewer than two chunks or the heavier
    group would carry more than max_share of the total."""
    if len(costs) < 2:
        return None
    groups: tuple[list[int], list[int]] = ([], [])
    loads = [0.0, 0.0]
    for index in sorted(range(len(costs)), key=lambda i: -costs[i]):
        lighter = 0 if loads[0] <= loads[1] else 1
        groups[lighter].append(index)
        loads[lighter] += costs[index]
    heavier = 0 if loads[0] >= loads[1] else 1
    if loads[heavier] > max_share * sum(loads):
        return None
    return sorted(groups[heavier]), sorted(groups[1 - heavier])


def original_order(groups: Sequence[Sequence[int]], sampled: Sequence[bool]) -> list[int]:
    """For the rows of cat(group 0's sampled chunks, group 1's ...), each group in its own order:
    the index of each sampled chunk's row, in the step's chunk order (an index_select that puts
    the concatenated logits back where the unsplit step has them)."""
    position: dict[int, int] = {}
    row = 0
    for group in groups:
        for index in group:
            if sampled[index]:
                position[index] = row
                row += 1
    return [position[i] for i in range(len(sampled)) if sampled[i]]


@dataclass
class StepSplit:
    """Split execution for one model runner: the threshold and the two worker threads (started
    on the first split step and kept)."""

    min_tokens: int = SPLIT_MIN_TOKENS
    runs: int = 0  # split steps run so far
    _pool: ThreadPoolExecutor | None = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def plan(self, chunk_costs: Sequence[float], num_tokens: int) -> tuple[list[int], list[int]] | None:
        if num_tokens < self.min_tokens:
            return None
        return plan_split(chunk_costs)

    def run(self, work: Sequence[Callable[[], T]]) -> list[T]:
        """Each function on its own worker thread, at the same time; results in the same order."""
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(2, thread_name_prefix="iterserve-split")
        self.runs += 1
        futures = [self._pool.submit(_one_thread, fn) for fn in work]
        return [future.result() for future in futures]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None


def _one_thread(fn: Callable[[], T]) -> T:
    # torch's thread count is per OS thread (OpenMP's ICV): set it here, not only in the caller.
    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)
    cpu_w8a8.one_thread_on_this_thread()
    with torch.inference_mode():
        return fn()
