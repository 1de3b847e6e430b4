"""Reference attention backend in plain torch: gathers each sequence's KV from its blocks.

Decodes (one new token per sequence) on fp32 CPU tensors go instead through cpu_paged's kernel,
which reads the blocks in place (2-4x faster than gather + SDPA, bench/kernels/cpu_attention.py); the
gather + SDPA path below serves prefills, other dtypes and devices, machines without a C
compiler, and `TorchBackend(paged_decode=False)`.

What a step's attention needs besides q/k/v (which rows are decodes, their block tables grouped
into length buckets, the prefills' causal masks) is worked out once per step (`_plan`) and reused
by every layer, instead of being rebuilt in Python 30 times. The plan also spares each layer
work SDPA would otherwise redo: decode masks are additive floats (a boolean mask is converted on
every call), a bucket holding every row in order skips the row gather and scatter, a lone decode
needs no mask, and a prompt's first chunk uses SDPA's own causal kernel (is_causal, which skips
the masked half) instead of an explicit mask.

A sliding window (AttentionOptions) is part of the plan: a prefill chunk gathers only the blocks
from the one holding its first query's oldest visible key, and every mask also hides keys that
fell out of the window. A logit soft-cap, which SDPA cannot apply, takes an explicit
matmul + tanh + softmax (`_attention`), as transformers' eager attention does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from iterserve.engine.attention import cpu_paged
from iterserve.engine.attention.backend import (
    FULL_ATTENTION,
    AttentionBackend,
    AttentionMetadata,
    AttentionOptions,
)

# A decode bucket's shortest sequence has at least this share of its longest one's blocks.
BUCKET_FILL = 0.67


class TorchBackend(AttentionBackend):
    name = "torch"

    def __init__(self, paged_decode: bool = True):
        self.paged_decode = paged_decode  # decodes through cpu_paged's kernel where it supports the layer

    def write_kv(self, key, value, k_cache, v_cache, meta: AttentionMetadata) -> None:
        num_blocks, block_size, heads, dim = k_cache.shape
        k_cache.view(num_blocks * block_size, heads, dim).index_copy_(0, meta.slot_mapping, key)
        v_cache.view(num_blocks * block_size, heads, dim).index_copy_(0, meta.slot_mapping, value)

    def attend(self, query, k_cache, v_cache, meta: AttentionMetadata, scale: float,
               options: AttentionOptions = FULL_ATTENTION) -> torch.Tensor:
        paged = self.paged_decode and cpu_paged.supports(query, k_cache)
        if paged:
            query = query.contiguous()
        window, softcap = options.sliding_window, options.logit_softcap
        # once per step and window, for every layer
        plan = _plan(meta, k_cache.shape[1], query.device, query.dtype, paged, window)
        output = torch.empty_like(query)
        if plan.paged_decodes is not None:
            seqs, rows = plan.paged_decodes
            cpu_paged.paged_decode(query, k_cache, v_cache, meta.block_tables, meta.seq_lens, seqs, rows, scale,
                                   output, window=window, softcap=softcap)
        gqa = query.shape[1] != k_cache.shape[2]
        _, block_size, heads, dim = k_cache.shape
        for rows, tables, mask in plan.decode_buckets:
            # Decodes of similar length together: gather their blocks (padded to the bucket's longest,
            # at most ~1/3 waste), one masked SDPA per bucket.
            count, width = tables.shape
            flat = tables.view(-1)
            k = k_cache.index_select(0, flat).view(count, width * block_size, heads, dim).transpose(1, 2)
            v = v_cache.index_select(0, flat).view(count, width * block_size, heads, dim).transpose(1, 2)
            q = (query if rows is None else query.index_select(0, rows)).unsqueeze(2)
            out = _attention(q, k, v, mask, False, scale, gqa, softcap).squeeze(2)
            if rows is None:  # one bucket with every row, in order: the output itself
                return out
            output[rows] = out
        for q_start, q_end, blocks, seq_len, mask, causal in plan.prefills:
            k = k_cache.index_select(0, blocks).view(-1, heads, dim)[:seq_len].transpose(0, 1)  # [Hkv, L, D]
            v = v_cache.index_select(0, blocks).view(-1, heads, dim)[:seq_len].transpose(0, 1)
            q = query[q_start:q_end].transpose(0, 1)  # [H, q_len, D]
            out = _attention(q, k, v, mask, causal, scale, gqa, softcap)
            output[q_start:q_end] = out.transpose(0, 1)
        return output

    def rms_norm(self, x, weight, eps, residual=None):
        if residual is not None:
            x = x + residual
        hidden = x.float()
        variance = hidden.pow(2).mean(-1, keepdim=True)
        hidden = hidden * torch.rsqrt(variance + eps)
        return weight * hidden.to(x.dtype), x

    def rotary(self, query, key, positions, cos_sin):
        half = cos_sin.shape[-1] // 2
        cos = cos_sin[positions, :half].unsqueeze(1)
        sin = cos_sin[positions, half:].unsqueeze(1)
        return _rotate(query, cos, sin), _rotate(key, cos, sin)

    def silu_and_mul(self, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


def _attention(q, k, v, mask, causal: bool, scale: float, gqa: bool, softcap: float | None) -> torch.Tensor:
    """SDPA, or without it for a soft-cap: (q.k * scale) -> cap * tanh(. / cap), masked, an fp32
    softmax, times v (transformers' eager order). q [..., H, Lq, D], k/v [..., Hkv, Lk, D]; mask
    boolean (True = visible) or additive, broadcast to [..., H, Lq, Lk]."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=gqa)
    if gqa:
        group = q.shape[-3] // k.shape[-3]
        k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if causal:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


@dataclass(slots=True)
class _Plan:
    # (query rows [S] | None for all rows in order, block tables [S, width], additive mask [S, 1, 1, width * bs])
    decode_buckets: list
    # (q_start, q_end, blocks [n], keys read (from the first block on), mask [q_len, keys] | None, is_causal):
    # and lone decodes
    prefills: list
    # (sequence indices [n], query rows [n]) of every decode, for cpu_paged's kernel; None on the SDPA path
    paged_decodes: tuple[torch.Tensor, torch.Tensor] | None = None


def _plan(meta: AttentionMetadata, block_size: int, device, dtype: torch.dtype, paged: bool = False,
          window: int | None = None) -> _Plan:
    key = ("_torch_plan_paged" if paged else "_torch_plan") + ("" if window is None else f"_window{window}")
    cached = meta.__dict__.get(key)
    if cached is not None:
        return cached
    starts = meta.query_start_loc.tolist() if meta.num_seqs else [0]
    tables = meta.block_tables.long()
    decodes, prefills, paged_seqs = [], [], []
    batched_decodes = sum(n == 1 for n in meta.query_lens_list) > 1  # a lone decode goes the prefill way
    for i, (q_len, seq_len) in enumerate(zip(meta.query_lens_list, meta.seq_lens_list, strict=True)):
        if q_len == 1 and paged:
            paged_seqs.append(i)
            continue
        if q_len == 1 and batched_decodes:
            decodes.append((seq_len, i))
            continue
        num_blocks = -(-seq_len // block_size)
        # The oldest key the chunk's first query still sees, rounded down to its block: keys before it are not read.
        first_block = 0 if window is None else max(0, seq_len - q_len - window + 1) // block_size
        first_key = first_block * block_size
        mask, causal = None, False
        if q_len == seq_len and q_len > 1 and window is None:
            causal = True  # a prompt's first chunk: SDPA's causal (top-left) alignment is the right one
        elif q_len > 1 or (window is not None and seq_len - first_key > window):
            # Query j sits at position seq_len - q_len + j and sees keys up to and including it
            # (and, with a window, none older than window - 1 before it).
            key_pos = torch.arange(first_key, seq_len, device=device)
            query_pos = torch.arange(seq_len - q_len, seq_len, device=device)
            mask = key_pos[None, :] <= query_pos[:, None]
            if window is not None:
                mask &= key_pos[None, :] > query_pos[:, None] - window
        # (q_len 1 without a window: a lone decode sees every cached key, no mask.)
        prefills.append((starts[i], starts[i + 1], tables[i, first_block:num_blocks].contiguous(),
                         seq_len - first_key, mask, causal))
    buckets = []
    decodes.sort(reverse=True)
    while decodes:
        longest = decodes[0][0]
        width = -(-longest // block_size)
        take = 1
        while take < len(decodes) and -(-decodes[take][0] // block_size) >= BUCKET_FILL * width:
            take += 1
        group, decodes = decodes[:take], decodes[take:]
        group.sort(key=lambda d: d[1])  # in row order, so a bucket of every row needs no gather
        index = torch.tensor([i for _, i in group], device=device)
        lens = torch.tensor([n for n, _ in group], device=device)
        key_pos = torch.arange(width * block_size, device=device)[None, :]
        beyond = key_pos >= lens[:, None]
        if window is not None:  # the decode at position len - 1 sees keys len - window .. len - 1
            beyond |= key_pos < lens[:, None] - window
        mask = torch.zeros(beyond.shape, dtype=dtype, device=device).masked_fill_(beyond, float("-inf"))[:, None, None, :]
        row_list = [starts[i] for _, i in group]
        every_row = not buckets and not decodes and not prefills and row_list == list(range(starts[-1]))
        rows = None if every_row else torch.tensor(row_list, device=device)
        buckets.append((rows, tables[index, :width].contiguous(), mask))
    plan = _Plan(buckets, prefills)
    if paged_seqs:
        plan.paged_decodes = (torch.tensor(paged_seqs, dtype=torch.int64),
                              torch.tensor([starts[i] for i in paged_seqs], dtype=torch.int64))
    meta.__dict__[key] = plan
    return plan
