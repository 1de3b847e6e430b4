"""How many CPU threads the model's torch ops get when `iterserve serve` runs on CPU.

torch's default is one OpenMP thread per core. On a small CPU node that leaves nothing for the
server's other work (the HTTP loop, tokenization, detokenization, streaming): those run in the
same process between and during steps, and every time one of them takes a core, an OpenMP
parallel region waits at its barrier for the thread that lost its core. Measured with
`bench/peers.py` on a 2-vCPU machine shared with other work, the same int8 server ran the tail
load at 3.0 tok/s with one compute thread and 0.5 tok/s with torch's default two (README,
performance section). So the default is one core fewer than the process may use (at least one);
OMP_NUM_THREADS, when set, is obeyed as is.

Idle OpenMP workers also spin for a while after each parallel region (libgomp's default), taking
the core the HTTP loop needs between steps; `OMP_WAIT_POLICY=PASSIVE` makes them sleep (the same
run: 5.0 vs 3.1 tok/s tail with one thread). libgomp reads it once, when torch loads it, so
`prefer_passive_wait()` must run before torch is imported; a value already set is kept.
"""

from __future__ import annotations

import logging
import math
import os
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
    """One core left to the server's Python work, at least one thread."""
    return max(1, cpus - 1)


def prefer_passive_wait() -> bool:
    """OMP_WAIT_POLICY=PASSIVE unless set; True when it will take effect (torch not yet loaded)."""
    import sys

    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return "torch" not in sys.modules


def configure_serving_threads() -> int:
    """Set torch's intra-op threads for a CPU server (call before the model runs); returns them."""
    import torch

    explicit = os.environ.get("OMP_NUM_THREADS")
    cpus = usable_cpus()
    if explicit:
        threads = torch.get_num_threads()
        logger.info("CPU compute threads: %d (OMP_NUM_THREADS=%s; %d usable CPUs)", threads, explicit, cpus)
        return threads
    threads = default_compute_threads(cpus)
    torch.set_num_threads(threads)
    logger.info("CPU compute threads: %d of %d usable CPUs (one left to the HTTP loop and tokenization; "
                "set OMP_NUM_THREADS to choose); OMP_WAIT_POLICY=%s", threads, cpus,
                os.environ.get("OMP_WAIT_POLICY", "unset"))
    return threads
