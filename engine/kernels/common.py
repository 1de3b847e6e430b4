"""Small helpers shared by the kernel launchers."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 tl.dot defaults to tf32 on GPU; keep fp32 inputs exact so they match the reference.
    return "ieee" if dtype == torch.float32 else "tf32"


def rows_per_program(width_pad: int, budget: int = 8192, most: int = 64) -> int:
    """How many rows of a row-wise kernel one program handles: enough to amortise the launch of
    small rows, never more than `budget` elements in flight."""
    return max(1, min(most, budget // width_pad))


TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}
