"""Small helpers shared by the kernel launchers."""

from __future__ import annotations

import torch
import triton

# tl.max and tl.sum are @jit wrappers around tl.reduce; under the interpreter every nested jit
# call re-patches triton.language (milliseconds each), while tl.reduce with these very combine
# functions takes numpy's fast path. On the GPU both spellings compile to the same reduction.
# The kernels only reduce fp32 values, for which the wrappers add nothing.
from triton.language.standard import _elementwise_max as MAX_COMBINE
from triton.language.standard import _sum_combine as SUM_COMBINE

__all__ = ["MAX_COMBINE", "SUM_COMBINE", "dot_precision", "next_pow2", "rows_per_program"]


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 tl.dot defaults to tf32 on GPU; keep fp32 inputs exact so they match the reference.
    return "ieee" if dtype == torch.float32 else "tf32"


def rows_per_program(width_pad: int, budget: int = 8192, most: int = 64) -> int:
    """How many rows of a row-wise kernel one program handles: enough to amortise the launch of
    small rows, never more than `budget` elements in flight."""
    return max(1, min(most, budget // width_pad))


