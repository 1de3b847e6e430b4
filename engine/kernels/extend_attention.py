"""Prefill / extend attention over the paged KV cache (what chunked prefill needs).

Sequence i brings a chunk of q_len new query tokens; its first seq_len - q_len tokens are already
cached, and the chunk's own keys and values were written to the cache before this call, so every
key is read from the paged pool. Query j of the chunk sits at position seq_len - q_len + j and
attends to keys 0..that position (causal).

Sequences are packed one after another with no padding. Program (i, m, g) handles KV head g of
sequence i: the GROUP query heads sharing that KV head are folded into the tile's rows (row r is
token r // GROUP, head g * GROUP + r % GROUP), so each K/V tile is loaded once for all of them.
It takes rows m*BLOCK_M.. and exits when the sequence has fewer (or fewer than MIN_QUERY_LEN
tokens, which the decode kernel handles).

A sliding window (`window` > 0) hides keys at or before q_pos - window and starts the key loop at
the tile holding the tile's oldest visible key; a logit soft-cap turns each scaled score s into
cap * tanh(s / cap) before the softmax.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from iterserve.engine.kernels.common import MAX_COMBINE, SUM_COMBINE, dot_precision, next_pow2


@triton.jit
def _extend_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, out_ptr,
    scale_log2, scale, window, softcap,
    stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_bt,
    stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    MIN_QUERY_LEN: tl.constexpr, DOT_PRECISION: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
):
    seq = tl.program_id(0)
    m_tile = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if (q_len >= MIN_QUERY_LEN) & (m_tile * BLOCK_M < q_len * GROUP):
        seq_len = tl.load(seq_lens_ptr + seq)
        context = seq_len - q_len

        r = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
        token = r // GROUP
        head = kv_head * GROUP + r % GROUP
        d = tl.arange(0, DIM_PAD)
        r_mask = token < q_len
        d_mask = d < HEAD_DIM
        row_offsets = (q_start + token).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
        q = tl.load(q_ptr + row_offsets, mask=r_mask[:, None] & d_mask[None, :], other=0.0)
        q_pos = context + token

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
        acc = tl.full([BLOCK_M, DIM_PAD], 0.0, dtype=tl.float32)
        # Keys past this tile's last query position are masked for every row: skip them.
        kv_end = tl.minimum(seq_len, context + ((m_tile + 1) * BLOCK_M - 1) // GROUP + 1)
        table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
        kv_start = kv_end * 0
        if window > 0:  # keys older than the tile's first query's window are hidden from every row
            kv_start = tl.maximum(context + (m_tile * BLOCK_M) // GROUP - window + 1, 0) // BLOCK_N * BLOCK_N
        for tile_start in range(kv_start, kv_end, BLOCK_N):
            n = tile_start + tl.arange(0, BLOCK_N)
            n_mask = n < kv_end
            page = tl.load(table_row + n // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
            slot = n % PAGE_SIZE
            kv_mask = n_mask[:, None] & d_mask[None, :]
            k = tl.load(k_cache_ptr + (page * stride_kb + slot * stride_kt + kv_head * stride_kh)[:, None]
                        + d[None, :], mask=kv_mask, other=0.0)
            if HAS_SOFTCAP:  # cap * tanh(s / cap), tanh(x) = 1 - 2 / (exp(2x) + 1), then to the log2 domain
                scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
                scores = softcap * (1.0 - 2.0 / (tl.exp(2.0 * scores / softcap) + 1.0)) * 1.4426950408889634
            else:
                scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
            visible = n_mask[None, :] & (n[None, :] <= q_pos[:, None])
            if window > 0:
                visible = visible & (n[None, :] > q_pos[:, None] - window)
            scores = tl.where(visible, scores, float("-inf"))
            # Without a window every row sees key 0 in the first tile; with one, a row may see
            # nothing in this tile yet (m stays -inf): shift by 0 then, so no inf - inf.
            m_new = tl.maximum(m_i, tl.reduce(scores, 1, MAX_COMBINE))
            m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_shift)
            p = tl.exp2(scores - m_shift[:, None])
            l_i = l_i * alpha + tl.reduce(p, 1, SUM_COMBINE)
            v = tl.load(v_cache_ptr + (page * stride_vb + slot * stride_vt + kv_head * stride_vh)[:, None]
                        + d[None, :], mask=kv_mask, other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new

        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # padding rows past q_len may have seen no key
        out_offsets = (q_start + token).to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
        tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=r_mask[:, None] & d_mask[None, :])


def extend_attention(
    query: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # int32 [S, max_blocks]
    seq_lens: torch.Tensor,  # int32 [S]
    query_start_loc: torch.Tensor,  # int32 [S + 1]
    out: torch.Tensor,  # [T, H, D]; rows of sequences with >= min_query_len tokens are written
    scale: float,
    max_query_len: int,
    min_query_len: int = 2,
    window: int | None = None,  # a sliding window: query at p sees keys p - window + 1 .. p
    softcap: float | None = None,  # scores -> softcap * tanh(scores / softcap)
) -> None:
    num_seqs = seq_lens.shape[0]
    if num_seqs == 0 or max_query_len < min_query_len:
        return
    _, page_size, num_kv_heads, head_dim = k_cache.shape
    group = query.shape[1] // num_kv_heads
    dim_pad = next_pow2(head_dim)
    block_m = max(16, min(64, next_pow2(max_query_len * group)))
    block_n = 64 if dim_pad <= 64 else 32
    grid = (num_seqs, triton.cdiv(max_query_len * group, block_m), num_kv_heads)
    _extend_attention_kernel[grid](
        query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, out,
        scale * 1.4426950408889634, scale, window or 0, softcap or 0.0,
        query.stride(0), query.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=head_dim, DIM_PAD=dim_pad,
        PAGE_SIZE=page_size, BLOCK_M=block_m, BLOCK_N=block_n,
        MIN_QUERY_LEN=min_query_len, DOT_PRECISION=dot_precision(query.dtype), HAS_SOFTCAP=softcap is not None,
    )
