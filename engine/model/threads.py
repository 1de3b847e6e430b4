"""How many CPU threads the model's torch ops get when `iterserve serve` runs on CPU.

torch's default is one OpenMP thread per core. On a small CPU node that leaves nothing for the
server's other work (the HTTP loop, tokenization, detokenization, streaming): those run in the
same process between and during steps, and every time one of them takes a core, an OpenMP
parallel region waits at its barrier for the thread that lost its core. Measured with
`bench/peers/compare.py` on a 2-vCPU machine shared with other work, the same int8 server ran the tail
load at 3.0 tok/s with one compute thread and 0.5 tok/s with torch's default two (docs/performance.md). So small steps leave one of the process's cores to that work (at least one
thread); OMP_NUM_THREADS, when set, is obeyed as is.

Idle OpenMP workers also spin for a while after each parallel region (libgomp's default), taking
the core the HTTP loop needs between steps; `OMP_WAIT_POLICY=PASSIVE` makes them sleep (the same
run: 5.0 vs 3.1 tok/s tail with one thread). libgomp reads it once, when torch loads it, so
`prefer_passive_wait()` must run before torch is imported; a value already set is kept. With split
execution (below) big steps use no OpenMP team at all, and the served loads measured PASSIVE,
PASSIVE + GOMP_SPINCOUNT=300000 and libgomp's default (spin, then sleep) within their run-to-run
noise (w8a8, alternating runs: tail 75.2 / 81.1 / 72.5 tok/s, throughput 201.0 / 202.0 / 196.4;
docs/perf/step_split_served.json), so PASSIVE stays the default.

With `--threads auto` (the default) the count is chosen per engine step: a step of at least
BIG_STEP_TOKENS tokens (prefill chunks, full decode batches) is compute-bound and takes every usable
CPU, a smaller one keeps one core free. Measured on the 2-vCPU EPYC with `--quantization w8a8`, load
~1 (docs/performance.md): 2 threads against 1 made a 128-token prefill 1.87x and a 512-token
one 1.59x faster, 32-64 decodes 1.15-1.18x, but 2-4 decodes 0.88x (a few rows' linears are too short
to split, and the HTTP loop then shares the cores). `--threads N` or OMP_NUM_THREADS=N fix N for
every step.

`--threads auto` on two or more CPUs also splits big steps of several sequences (prefill chunks of
many prompts, full decode batches) into two halves run at once, one thread each, which needs no
OpenMP synchronisation inside the step (engine/model/split_step.py; the model runner decides per
step). `--threads N` and OMP_NUM_THREADS keep one call per step.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)


def usable_cpus() -> int:
    """CPUs this process may run on: its affinity mask, capped by a cgroup v2 CPU quota (a pod's
    CPU limit), whichever is smaller."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            cpus = min(cpus, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return max(1, cpus)


def default_compute_threads(cpus: int) -> int:
    """One core left to the server's Python work, at least one thread (steps below BIG_STEP_TOKENS)."""
    return max(1, cpus - 1)


# Steps with at least this many tokens use every usable CPU under --threads auto (see the docstring).
BIG_STEP_TOKENS = 32


@dataclass(frozen=True, slots=True)
class StepThreads:
    """torch's intra-op threads for one engine step: `big` from BIG_STEP_TOKENS tokens on, else `small`."""

    small: int
    big: int
    split: bool = False  # big multi-sequence steps as two 1-thread halves (engine/model/split_step.py)

    def for_tokens(self, tokens: int) -> int:
        return self.big if tokens >= BIG_STEP_TOKENS else self.small

    def describe(self) -> str:
        if self.small == self.big:
            return f"{self.big} on every step"
        split = "; big steps of several sequences split in two 1-thread halves" if self.split else ""
        return f"{self.big} on steps of >= {BIG_STEP_TOKENS} tokens, {self.small} on smaller ones{split}"


def choose_step_threads(requested: str, cpus: int, omp_num_threads: int | None) -> tuple[StepThreads, str]:
    """(policy, why) for `--threads requested` ("auto" or a count) on `cpus` usable CPUs, where
    omp_num_threads is torch's count when OMP_NUM_THREADS is set (None otherwise)."""
    if requested != "auto":
        try:
            n = int(requested)
        except ValueError:
            n = 0
        if n < 1:
            raise ValueError(f"--threads must be auto or a positive integer; got {requested!r}")
        return StepThreads(n, n), f"--threads {n}"
    if omp_num_threads is not None:
        return StepThreads(omp_num_threads, omp_num_threads), f"OMP_NUM_THREADS={omp_num_threads}"
    return StepThreads(default_compute_threads(cpus), cpus, split=cpus >= 2), "--threads auto"


_policy: StepThreads | None = None  # set by configure_serving_threads: torch's thread pool is process-wide too
_current = 0


def prefer_passive_wait() -> bool:
    """OMP_WAIT_POLICY=PASSIVE unless set; True when it will take effect (torch not yet loaded)."""
    import sys

    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return "torch" not in sys.modules


def configure_serving_threads(requested: str = "auto") -> StepThreads:
    """Choose torch's threads for a CPU server (call before the model runs) and log the choice;
    the model runner then applies it to each step (apply_step_threads)."""
    global _policy
    import torch

    # imported here, not at module level: it imports torch (see prefer_passive_wait)
    from iterserve.engine.model import cpu_w8a8

    cpus = usable_cpus()
    omp = torch.get_num_threads() if os.environ.get("OMP_NUM_THREADS") else None
    policy, why = choose_step_threads(requested, cpus, omp)
    _policy = policy
    # The C kernels' own threads (w8a8 linears) cost no OpenMP sync: every step outside split
    # execution's halves gets all of the policy's CPUs there.
    cpu_w8a8.set_threads(policy.big)
    apply_step_threads(BIG_STEP_TOKENS)  # the larger count until the first step (model load, warm-up)
    logger.info("CPU compute threads (%s, %d usable CPUs): %s; OMP_WAIT_POLICY=%s", why, cpus, policy.describe(),
                os.environ.get("OMP_WAIT_POLICY", "unset"))
    return policy


def split_steps() -> bool:
    """Whether the serving policy runs big steps split in two (--threads auto on >= 2 CPUs)."""
    return _policy is not None and _policy.split


def apply_split_threads() -> None:
    """Before a split step: one torch thread in the calling thread too (the workers set their own)."""
    global _current
    if _current != 1:
        import torch

        torch.set_num_threads(1)
        _current = 1


def apply_step_threads(tokens: int) -> None:
    """Before a step of `tokens` tokens: torch's thread count for it (no-op unless a server chose a policy)."""
    global _current
    if _policy is None:
        return
    threads = _policy.for_tokens(tokens)
    if threads != _current:
        import torch

        torch.set_num_threads(threads)
        _current = threads
