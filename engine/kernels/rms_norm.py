"""Fused residual-add + RMSNorm: returns (rmsnorm(x + residual) * weight, x + residual).

Matches the reference's rounding: the sum is taken in the input dtype, the norm in fp32, and
the normalised value is cast back to the input dtype before the weight multiplies it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from iterserve.engine.kernels.common import SUM_COMBINE, next_pow2, rows_per_program


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
    num_rows, hidden, eps,
    stride_x, stride_r, stride_o, stride_ro,
    HAS_RESIDUAL: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_H: tl.constexpr,
):
    r = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    c = tl.arange(0, BLOCK_H)
    mask = (r < num_rows)[:, None] & (c < hidden)[None, :]
    r64 = r.to(tl.int64)[:, None]
    x = tl.load(x_ptr + r64 * stride_x + c[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = x + tl.load(residual_ptr + r64 * stride_r + c[None, :], mask=mask, other=0.0)
        tl.store(residual_out_ptr + r64 * stride_ro + c[None, :], x, mask=mask)
    xf = x.to(tl.float32)
    variance = tl.reduce(xf * xf, 1, SUM_COMBINE) / hidden
    normed = (xf * tl.rsqrt(variance + eps)[:, None]).to(x.dtype)
    w = tl.load(weight_ptr + c, mask=c < hidden, other=0.0)
    tl.store(out_ptr + r64 * stride_o + c[None, :], normed * w[None, :], mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x and residual [..., hidden] with a contiguous last dim; weight [hidden], same dtype."""
    hidden = x.shape[-1]
    x2 = x.reshape(-1, hidden)
    num_rows = x2.shape[0]
    out = torch.empty_like(x2)
    if residual is None:
        res2, res_out = x2, x2  # unused by the kernel
    else:
        res2 = residual.reshape(-1, hidden)
        res_out = torch.empty_like(x2)
    if num_rows:
        block_h = next_pow2(hidden)
        block_rows = rows_per_program(block_h, budget=4096, most=16)
        _rms_norm_kernel[(triton.cdiv(num_rows, block_rows),)](
            x2, res2, weight, out, res_out,
            num_rows, hidden, eps,
            x2.stride(0), res2.stride(0), out.stride(0), res_out.stride(0),
            HAS_RESIDUAL=residual is not None, BLOCK_ROWS=block_rows, BLOCK_H=block_h,
        )
    summed = x if residual is None else res_out.view(x.shape)
    return out.view(x.shape), summed
