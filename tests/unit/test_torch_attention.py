"""The torch attention backend's per-step plan against a naive per-sequence attention: every path
the plan takes (a bucket of every decode row, several buckets, decodes mixed with prefills, a lone
decode without a mask, a prompt's first chunk through SDPA's causal kernel, a later chunk with an
explicit mask), over scattered paged blocks; decodes both through cpu_paged's kernel and through
gather + SDPA."""

from __future__ import annotations

import pytest
import torch

from iterserve.engine.attention.backend import AttentionMetadata
from iterserve.engine.attention.torch_backend import TorchBackend

HEADS, KV_HEADS, DIM, BLOCK = 6, 2, 16, 4


def naive(query, k_cache, v_cache, query_lens, seq_lens, tables, scale):
    out, row = [], 0
    for q_len, seq_len, blocks in zip(query_lens, seq_lens, tables, strict=True):
        k = k_cache[blocks].reshape(-1, KV_HEADS, DIM)[:seq_len].repeat_interleave(HEADS // KV_HEADS, dim=1)
        v = v_cache[blocks].reshape(-1, KV_HEADS, DIM)[:seq_len].repeat_interleave(HEADS // KV_HEADS, dim=1)
        q = query[row:row + q_len]
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        positions = torch.arange(seq_len - q_len, seq_len)
        scores = scores.masked_fill(torch.arange(seq_len)[None, None, :] > positions[None, :, None], float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
        row += q_len
    return torch.cat(out)


@pytest.mark.parametrize(("query_lens", "seq_lens"), [
    ([1, 1, 1], [9, 10, 12]),  # one bucket holding every row
    ([1, 1, 1, 1], [3, 40, 5, 38]),  # two length buckets, rows out of order
    ([1], [23]),  # a lone decode: no mask
    ([7], [7]),  # a prompt's first chunk: is_causal
    ([5, 1, 1], [30, 17, 2]),  # a later chunk (explicit mask) next to decodes
    ([1, 9, 1, 4], [11, 9, 26, 4]),  # decodes around two first chunks
])
@pytest.mark.parametrize("paged", [True, False], ids=["paged-decode", "sdpa-decode"])
def test_plan_matches_naive_attention(query_lens, seq_lens, paged):
    gen = torch.Generator().manual_seed(sum(seq_lens))
    num_blocks = 64
    k_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, DIM, generator=gen)
    v_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, DIM, generator=gen)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables, used = [], 0
    for n in seq_lens:
        count = -(-n // BLOCK)
        tables.append(order[used:used + count])
        used += count
    query = torch.randn(sum(query_lens), HEADS, DIM, generator=gen)
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, BLOCK)
    got = TorchBackend(paged_decode=paged).attend(query, k_cache, v_cache, meta, DIM**-0.5)
    want = naive(query, k_cache, v_cache, query_lens, seq_lens, tables, DIM**-0.5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # The plan is built once per step: a second layer reuses it and gets the same answer.
    torch.testing.assert_close(TorchBackend(paged_decode=paged).attend(query, k_cache, v_cache, meta, DIM**-0.5), got)
