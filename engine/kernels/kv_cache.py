"""KV cache write: scatter this step's new keys and values into their slots of the paged pool.

slot_mapping[t] = block * block_size + offset is where token t goes; a negative slot (padding)
is skipped. One program writes BLOCK_T tokens, all KV heads of each.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from iterserve.engine.kernels.common import next_pow2


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    num_tokens,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cache_slot, stride_cache_head,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEADS_PAD: tl.constexpr, DIM_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.arange(0, HEADS_PAD)
    d = tl.arange(0, DIM_PAD)
    slot = tl.load(slot_mapping_ptr + t, mask=t < num_tokens, other=-1)
    t_mask = (t < num_tokens) & (slot >= 0)
    mask = t_mask[:, None, None] & (h < NUM_HEADS)[None, :, None] & (d < HEAD_DIM)[None, None, :]
    t64 = t.to(tl.int64)[:, None, None]
    hd = h[None, :, None]
    dd = d[None, None, :]
    dest = slot.to(tl.int64)[:, None, None] * stride_cache_slot + hd * stride_cache_head + dd
    k = tl.load(key_ptr + t64 * stride_kt + hd * stride_kh + dd, mask=mask)
    tl.store(k_cache_ptr + dest, k, mask=mask)
    v = tl.load(value_ptr + t64 * stride_vt + hd * stride_vh + dd, mask=mask)
    tl.store(v_cache_ptr + dest, v, mask=mask)


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """key, value [T, Hkv, D] (last dim contiguous); caches contiguous [blocks, block_size, Hkv, D]."""
    num_tokens, num_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    heads_pad, dim_pad = next_pow2(num_heads), next_pow2(head_dim)
    block_t = max(1, min(16, 4096 // (heads_pad * dim_pad)))
    _write_kv_kernel[(triton.cdiv(num_tokens, block_t),)](
        key, value, k_cache, v_cache, slot_mapping,
        num_tokens,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(1), k_cache.stride(2),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, HEADS_PAD=heads_pad, DIM_PAD=dim_pad,
        BLOCK_T=block_t,
    )
