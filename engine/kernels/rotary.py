"""Rotary position embedding, rotate-half (NeoX / HF Llama) form.

cos_sin is [max_position, rotary_dim]: cos in the first half of the last dim, sin in the second.
For each token at position p and each head, with x = [x1, x2] split in halves:
    out = [x1 * cos - x2 * sin, x2 * cos + x1 * sin]
Query and key are rotated in the same launch; the results are new tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from iterserve.engine.kernels.common import next_pow2


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, q_out_ptr, k_out_ptr, positions_ptr, cos_sin_ptr,
    num_tokens, num_q_heads, num_k_heads,
    stride_qt, stride_qh, stride_kt, stride_kh,
    stride_qot, stride_qoh, stride_kot, stride_koh,
    stride_cs,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr,
    Q_HEADS_PAD: tl.constexpr, K_HEADS_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = t < num_tokens
    pos = tl.load(positions_ptr + t, mask=t_mask, other=0).to(tl.int64)
    i = tl.arange(0, HALF_PAD)
    cs_mask = t_mask[:, None] & (i < HALF)[None, :]
    cos = tl.load(cos_sin_ptr + pos[:, None] * stride_cs + i[None, :], mask=cs_mask, other=0.0)
    sin = tl.load(cos_sin_ptr + pos[:, None] * stride_cs + HALF + i[None, :], mask=cs_mask, other=0.0)
    cos = cos.to(tl.float32)[:, None, :]
    sin = sin.to(tl.float32)[:, None, :]
    rows = t.to(tl.int64)[:, None, None]
    i3 = i[None, None, :]
    half_mask = t_mask[:, None, None] & (i3 < HALF)

    # Query heads, then key heads (written out twice: nested jit calls are slow in the interpreter).
    h = tl.arange(0, Q_HEADS_PAD)[None, :, None]
    mask = half_mask & (h < num_q_heads)
    src = q_ptr + rows * stride_qt + h * stride_qh + i3
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    dst = q_out_ptr + rows * stride_qot + h * stride_qoh + i3
    tl.store(dst, (x1 * cos - x2 * sin).to(q_out_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, (x2 * cos + x1 * sin).to(q_out_ptr.dtype.element_ty), mask=mask)

    h = tl.arange(0, K_HEADS_PAD)[None, :, None]
    mask = half_mask & (h < num_k_heads)
    src = k_ptr + rows * stride_kt + h * stride_kh + i3
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    dst = k_out_ptr + rows * stride_kot + h * stride_koh + i3
    tl.store(dst, (x1 * cos - x2 * sin).to(k_out_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, (x2 * cos + x1 * sin).to(k_out_ptr.dtype.element_ty), mask=mask)

def rotary(query: torch.Tensor, key: torch.Tensor, positions: torch.Tensor,
           cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """query [T, H, D], key [T, Hkv, D] (last dim contiguous); positions [T]; cos_sin [P, D]."""
    num_tokens, num_q_heads, head_dim = query.shape
    num_k_heads = key.shape[1]
    q_out = torch.empty_like(query, memory_format=torch.contiguous_format)
    k_out = torch.empty_like(key, memory_format=torch.contiguous_format)
    if num_tokens == 0:
        return q_out, k_out
    half = head_dim // 2
    half_pad = next_pow2(half)
    q_heads_pad, k_heads_pad = next_pow2(num_q_heads), next_pow2(num_k_heads)
    block_t = max(1, min(16, 4096 // (q_heads_pad * half_pad)))
    _rotary_kernel[(triton.cdiv(num_tokens, block_t),)](
        query, key, q_out, k_out, positions, cos_sin,
        num_tokens, num_q_heads, num_k_heads,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
        cos_sin.stride(0),
        HALF=half, HALF_PAD=half_pad, Q_HEADS_PAD=q_heads_pad, K_HEADS_PAD=k_heads_pad,
        BLOCK_T=block_t,
    )
    return q_out, k_out
