"""SiLU-and-mul: silu(gate) * up for gate_up = cat([gate, up], -1), the Llama MLP activation."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from iterserve.engine.kernels.common import next_pow2, rows_per_program


@triton.jit
def _silu_and_mul_kernel(
    gate_up_ptr, out_ptr, num_rows, width, stride_in, stride_out,
    BLOCK_ROWS: tl.constexpr, BLOCK_W: tl.constexpr,
):
    r = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    c = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    mask = (r < num_rows)[:, None] & (c < width)[None, :]
    src = gate_up_ptr + r.to(tl.int64)[:, None] * stride_in + c[None, :]
    gate = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(src + width, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + r.to(tl.int64)[:, None] * stride_out + c[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2 * width] with a contiguous last dim -> [..., width]."""
    width = gate_up.shape[-1] // 2
    rows = gate_up.reshape(-1, 2 * width)
    out = torch.empty((rows.shape[0], width), dtype=gate_up.dtype, device=gate_up.device)
    if rows.shape[0] and width:
        block_w = min(1024, next_pow2(width))
        block_rows = rows_per_program(block_w, budget=8192, most=16)
        grid = (triton.cdiv(rows.shape[0], block_rows), triton.cdiv(width, block_w))
        _silu_and_mul_kernel[grid](
            rows, out, rows.shape[0], width, rows.stride(0), out.stride(0),
            BLOCK_ROWS=block_rows, BLOCK_W=block_w,
        )
    return out.view(*gate_up.shape[:-1], width)
