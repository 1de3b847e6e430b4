"""Paged decode attention: one query token per sequence against its KV blocks.

One program handles one (sequence, KV head, split): the GROUP query heads that share the KV head
are stacked into the rows of a single tile, so each K/V block is read once per KV head. Keys are
visited BLOCK_N tokens at a time (a tile may span several pages, found through the block table)
with an online softmax in the log2 domain. With NUM_SPLITS > 1 the sequence is cut into
contiguous ranges processed in parallel (flash-decoding); a second kernel merges their partial
outputs through their log-sum-exps. Sequences whose query length is not 1 are skipped, so the
kernel can be launched over a mixed prefill/decode batch.

A sliding window (`window` > 0) starts the key range at seq_len - window (the splits share that
range); a logit soft-cap turns each scaled score s into cap * tanh(s / cap) before the softmax.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from iterserve.engine.kernels.common import MAX_COMBINE, SUM_COMBINE, dot_precision, next_pow2

# A split should have at least this many keys, so the merge costs little next to the reads.
MIN_TOKENS_PER_SPLIT = 256
MAX_SPLITS = 16


@triton.jit
def _paged_decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    out_ptr, part_out_ptr, part_lse_ptr,
    scale_log2, scale, window, softcap,
    stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_bt,
    stride_ot, stride_oh,
    stride_ps, stride_ph, stride_pk,
    stride_ls, stride_lh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    q_row = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_row
    if q_len == 1:
        seq_len = tl.load(seq_lens_ptr + seq)
        first = seq_len * 0
        if window > 0:
            first = tl.maximum(seq_len - window, 0)
        per_split = ((seq_len - first + NUM_SPLITS - 1) // NUM_SPLITS + BLOCK_N - 1) // BLOCK_N * BLOCK_N
        start = first + split * per_split
        end = tl.minimum(start + per_split, seq_len)

        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, DIM_PAD)
        heads = kv_head * GROUP + g
        g_mask = g < GROUP
        d_mask = d < HEAD_DIM
        q = tl.load(q_ptr + q_row.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + d[None, :],
                    mask=g_mask[:, None] & d_mask[None, :], other=0.0)

        m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
        l_i = tl.full([GROUP_PAD], 0.0, dtype=tl.float32)
        acc = tl.full([GROUP_PAD, DIM_PAD], 0.0, dtype=tl.float32)
        table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
        for tile_start in range(start, end, BLOCK_N):
            n = tile_start + tl.arange(0, BLOCK_N)
            n_mask = n < end
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
            scores = tl.where(n_mask[None, :], scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.reduce(scores, 1, MAX_COMBINE))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(scores - m_new[:, None])
            l_i = l_i * alpha + tl.reduce(p, 1, SUM_COMBINE)
            v = tl.load(v_cache_ptr + (page * stride_vb + slot * stride_vt + kv_head * stride_vh)[:, None]
                        + d[None, :], mask=kv_mask, other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new

        out_mask = g_mask[:, None] & d_mask[None, :]
        if NUM_SPLITS == 1:
            out = acc / l_i[:, None]
            tl.store(out_ptr + q_row.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + d[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=out_mask)
        else:
            # An empty split (a short sequence) leaves l_i == 0: it stores lse = -inf and zeros,
            # which the merge weighs by exp2(-inf) = 0.
            safe_l = tl.where(l_i > 0, l_i, 1.0)
            part = seq.to(tl.int64) * stride_ps + heads * stride_ph + split * stride_pk
            tl.store(part_out_ptr + part[:, None] + d[None, :], acc / safe_l[:, None], mask=out_mask)
            tl.store(part_lse_ptr + seq.to(tl.int64) * stride_ls + heads * stride_lh + split,
                     m_i + tl.log2(safe_l), mask=g_mask)


@triton.jit
def _merge_splits_kernel(
    part_out_ptr, part_lse_ptr, query_start_loc_ptr, out_ptr,
    stride_ps, stride_ph, stride_pk,
    stride_ls, stride_lh,
    stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    q_row = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_row
    if q_len == 1:
        s = tl.arange(0, NUM_SPLITS)
        d = tl.arange(0, DIM_PAD)
        base = seq.to(tl.int64) * stride_ps + head * stride_ph
        lse = tl.load(part_lse_ptr + seq.to(tl.int64) * stride_ls + head * stride_lh + s)
        weights = tl.exp2(lse - tl.reduce(lse, 0, MAX_COMBINE))
        parts = tl.load(part_out_ptr + base + s[:, None] * stride_pk + d[None, :])
        out = tl.reduce(parts * weights[:, None], 0, SUM_COMBINE) / tl.reduce(weights, 0, SUM_COMBINE)
        tl.store(out_ptr + q_row.to(tl.int64) * stride_ot + head * stride_oh + d,
                 out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device) -> int:
    """Split long contexts only when the (sequence, KV head) grid alone would leave SMs idle."""
    if device.type != "cuda":
        return 1
    sms = _num_sms(device)
    programs = max(num_seqs * num_kv_heads, 1)
    if programs >= sms:
        return 1
    by_length = max_seq_len // MIN_TOKENS_PER_SPLIT
    by_occupancy = -(-2 * sms // programs)
    return max(1, min(MAX_SPLITS, by_length, next_pow2(by_occupancy) if by_occupancy > 1 else 1))


def paged_decode_attention(
    query: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # int32 [S, max_blocks]
    seq_lens: torch.Tensor,  # int32 [S]
    query_start_loc: torch.Tensor,  # int32 [S + 1]
    out: torch.Tensor,  # [T, H, D]; rows of sequences with one query token are written
    scale: float,
    max_seq_len: int,
    num_splits: int | None = None,
    window: int | None = None,  # a sliding window: the last `window` keys only
    softcap: float | None = None,  # scores -> softcap * tanh(scores / softcap)
) -> None:
    num_seqs = seq_lens.shape[0]
    if num_seqs == 0:
        return
    _, page_size, num_kv_heads, head_dim = k_cache.shape
    num_heads = query.shape[1]
    group = num_heads // num_kv_heads
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, num_kv_heads, min(max_seq_len, window or max_seq_len), query.device)
    num_splits = next_pow2(num_splits)
    dim_pad = next_pow2(head_dim)
    group_pad = max(16, next_pow2(group))  # tl.dot wants at least 16 rows
    block_n = 64 if dim_pad <= 128 else 32  # a tile may span several pages
    if num_splits > 1:
        part_out = torch.empty((num_seqs, num_heads, num_splits, dim_pad), dtype=torch.float32,
                               device=query.device)
        part_lse = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=query.device)
    else:  # unused by the kernel; any tensors with the right number of dims
        part_out = out.new_empty((1, 1, 1, 1), dtype=torch.float32)
        part_lse = out.new_empty((1, 1, 1), dtype=torch.float32)
    _paged_decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        query, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
        out, part_out, part_lse,
        scale * 1.4426950408889634, scale, window or 0, softcap or 0.0,
        query.stride(0), query.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim, DIM_PAD=dim_pad,
        PAGE_SIZE=page_size, BLOCK_N=block_n, NUM_SPLITS=num_splits,
        DOT_PRECISION=dot_precision(query.dtype), HAS_SOFTCAP=softcap is not None,
    )
    if num_splits > 1:
        _merge_splits_kernel[(num_seqs, num_heads)](
            part_out, part_lse, query_start_loc, out,
            part_out.stride(0), part_out.stride(1), part_out.stride(2),
            part_lse.stride(0), part_lse.stride(1),
            out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, DIM_PAD=dim_pad, NUM_SPLITS=num_splits,
        )
