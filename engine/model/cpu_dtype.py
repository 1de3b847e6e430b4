"""`--dtype auto` on a CPU: bf16 only where the CPU multiplies bf16 natively and a timed matmul of
the model's own shape says bf16 is faster; fp32 otherwise.

In: the CPU's flags (/proc/cpuinfo), the model's hidden and intermediate sizes. Out: the dtype,
with a log line that says why.

fp32 is the exact-parity mode (greedy tokens equal transformers'); bf16 rounds every weight and
activation to 8 bits of mantissa. It pays only where the CPU has bf16 dot-product instructions
(AMX on Sapphire Rapids and later, AVX512-BF16 on Cooper Lake / Zen 4): elsewhere torch emulates
bf16 matmuls through fp32 and they are slower than fp32 itself. Even with the flags, a matmul of
the model's MLP shape is timed both ways at start-up (a few milliseconds) and bf16 is chosen only
when it is at least MIN_SPEEDUP faster, because some VMs advertise AMX without giving the guest
fast tiles. `--dtype float32` / `bfloat16` skip the measurement.
"""

from __future__ import annotations

import logging
import time

import torch

from iterserve.engine.cpu_info import cpu_flags

logger = logging.getLogger(__name__)

NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")
MIN_SPEEDUP = 1.2
TIMED_ROWS = 64  # a decode batch's rows


def native_bf16_flags(cpuinfo: str | None = None) -> list[str]:
    """The CPU flags among NATIVE_BF16_FLAGS (empty where /proc/cpuinfo cannot be read)."""
    flags = cpu_flags(cpuinfo)
    return [flag for flag in NATIVE_BF16_FLAGS if flag in flags]


def time_matmul(dtype: torch.dtype, hidden: int, intermediate: int, repeats: int = 5) -> float:
    """Best seconds of a [TIMED_ROWS, hidden] x [hidden, intermediate] matmul in dtype."""
    x = torch.randn(TIMED_ROWS, hidden).to(dtype)
    w = torch.randn(intermediate, hidden).to(dtype)
    torch.nn.functional.linear(x, w)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.nn.functional.linear(x, w)
        best = min(best, time.perf_counter() - start)
    return best


def choose(flags: list[str], fp32_s: float | None, bf16_s: float | None) -> tuple[torch.dtype, str]:
    """(dtype, why) from the native bf16 flags and the two timings (None when not measured)."""
    if not flags:
        return torch.float32, "no native bf16 matmul on this CPU (no amx_bf16 / avx512_bf16): float32"
    if fp32_s is None or bf16_s is None:
        return torch.float32, f"{', '.join(flags)} present but not measured: float32"
    speedup = fp32_s / bf16_s
    if speedup >= MIN_SPEEDUP:
        return torch.bfloat16, (f"{', '.join(flags)}: a bf16 matmul of the model's MLP shape ran {speedup:.2f}x "
                                f"faster than fp32 (>= {MIN_SPEEDUP}x): bfloat16 (--dtype float32 for exact parity)")
    return torch.float32, (f"{', '.join(flags)} present, but bf16 ran only {speedup:.2f}x fp32's speed "
                           f"(< {MIN_SPEEDUP}x): float32")


def auto_cpu_dtype(hidden: int, intermediate: int) -> torch.dtype:
    flags = native_bf16_flags()
    fp32_s = bf16_s = None
    if flags:
        fp32_s = time_matmul(torch.float32, hidden, intermediate)
        bf16_s = time_matmul(torch.bfloat16, hidden, intermediate)
    dtype, why = choose(flags, fp32_s, bf16_s)
    logger.info("--dtype auto on CPU: %s", why)
    return dtype
