"""The KV pool's size when --kv-cache-memory and --num-kv-blocks are not given: sized from the memory
left once the weights are loaded, as vLLM does.

- CUDA: `--gpu-memory-utilization` (default 0.9) of the device's memory, minus what is in use when
  the pool is sized (the weights, the CUDA context, other processes) and a reserve for the step's
  activations (the token budget's hidden states and MLP intermediates, the sampled rows' logits).
- CPU: CPU_SHARE of the memory available to this process (the smaller of the host's MemAvailable and
  what the cgroup's memory.max leaves, so a pod's limit counts), at most CPU_CAP, and never more
  than max_num_seqs sequences of max_model_len tokens can use. The CPU pool is allocated as untouched
  zero pages (calloc), so resident memory grows only as blocks are written.

Either way the result is logged with its token capacity and shows in `vllm:cache_config_info`
(num_gpu_blocks); --kv-cache-memory overrides it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

CPU_SHARE = 0.25  # of the available memory
CPU_CAP = 4 * 2**30  # bytes
FALLBACK = 512 * 2**20  # where no memory figure can be read


def available_cpu_memory() -> int | None:
    """Bytes this process may still allocate: MemAvailable, capped by the cgroup v2 limit's headroom."""
    available = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            headroom = max(0, int(limit) - used)
            available = headroom if available is None else min(available, headroom)
    except (OSError, ValueError):
        pass
    return available


def activation_reserve(tokens: int, rows: int, hidden: int, intermediate: int, vocab: int, itemsize: int) -> int:
    """Bytes a step's activations may take: per token the residual, attention and 2 x intermediate MLP
    values (a few copies live at once), plus fp32 logits of every sampled row."""
    return tokens * (8 * hidden + 4 * intermediate) * itemsize + rows * vocab * 4


def auto_kv_bytes(device_type: str, kv_bytes_per_token: int, max_num_seqs: int, max_model_len: int,
                  reserve: int, gpu_memory_utilization: float) -> tuple[int, str]:
    """(bytes for the KV pool, how they were chosen) for a device ('cuda' or 'cpu')."""
    if device_type == "cuda":
        free, total = torch.cuda.mem_get_info()
        budget = int(gpu_memory_utilization * total) - (total - free) - reserve
        why = (f"--gpu-memory-utilization {gpu_memory_utilization:g} of {total / 2**30:.1f} GiB, minus "
               f"{(total - free) / 2**30:.2f} GiB in use and {reserve / 2**20:.0f} MiB for activations")
        return max(0, budget), why
    available = available_cpu_memory()
    needed = max_num_seqs * max_model_len * kv_bytes_per_token
    if available is None:
        return min(FALLBACK, needed), f"{FALLBACK / 2**20:.0f} MiB (available memory unknown)"
    budget = min(int(CPU_SHARE * available), CPU_CAP, needed)
    why = (f"{CPU_SHARE:g} of {available / 2**30:.1f} GiB available, at most {CPU_CAP / 2**30:.0f} GiB and "
           f"{max_num_seqs} x {max_model_len} tokens")
    return budget, why


def kv_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed KV pool tensor. On a CPU from calloc'd pages (numpy's zeros), which the kernel maps
    only when written: a pool sized for many long sequences costs resident memory as it fills, not
    at start-up (torch.zeros writes every page). 64-byte aligned, as torch's own allocations."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    raw = np.zeros(nbytes + 64, dtype=np.uint8)
    start = -raw.ctypes.data % 64
    return torch.from_numpy(raw[start:start + nbytes]).view(dtype).view(shape)
