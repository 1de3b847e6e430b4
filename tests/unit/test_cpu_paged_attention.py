"""cpu_paged's decode kernel (through the torch backend, as the model calls it) against a naive
per-sequence attention, on random paged layouts: scattered block tables, lengths on both sides of
block boundaries, GQA and plain multi-head shapes, head dims on the vectorised and the scalar path,
decodes between prefill chunks. Every cache slot no sequence owns holds large keys and values, so
a block-table or length index that is off by one changes the output far beyond the tolerance."""

from __future__ import annotations

import shutil

import pytest
import torch

from iterserve.engine.attention import cpu_paged
from iterserve.engine.attention.backend import AttentionMetadata
from iterserve.engine.attention.torch_backend import TorchBackend

BLOCK = 16


@pytest.fixture(scope="module", autouse=True)
def kernel_built():
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler: the torch backend uses gather + SDPA (tested in test_torch_attention.py)")
    assert cpu_paged.load() is not None, "a C compiler is here but the kernel did not build (see the log)"


def naive(query, k_cache, v_cache, query_lens, seq_lens, tables, scale):
    heads, kv_heads = query.shape[1], k_cache.shape[2]
    out, row = [], 0
    for q_len, seq_len, blocks in zip(query_lens, seq_lens, tables, strict=True):
        k = k_cache[blocks].flatten(0, 1)[:seq_len].double().repeat_interleave(heads // kv_heads, dim=1)
        v = v_cache[blocks].flatten(0, 1)[:seq_len].double().repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("qhd,khd->hqk", query[row:row + q_len].double(), k) * scale
        positions = torch.arange(seq_len - q_len, seq_len)
        scores = scores.masked_fill(torch.arange(seq_len)[None, None, :] > positions[None, :, None], float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).float())
        row += q_len
    return torch.cat(out)


def paged_layout(seq_lens, heads, kv_heads, dim, seed):
    """Caches whose unowned slots (free blocks, each last block's tail) hold keys/values of 50."""
    gen = torch.Generator().manual_seed(seed)
    counts = [-(-n // BLOCK) for n in seq_lens]
    num_blocks = sum(counts) + 5
    k_cache = torch.full((num_blocks, BLOCK, kv_heads, dim), 50.0)
    v_cache = torch.full((num_blocks, BLOCK, kv_heads, dim), 50.0)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables, used = [], 0
    for n, count in zip(seq_lens, counts, strict=True):
        blocks = order[used:used + count]
        used += count
        flat_k = k_cache.view(-1, kv_heads, dim)
        flat_v = v_cache.view(-1, kv_heads, dim)
        for pos in range(n):
            slot = blocks[pos // BLOCK] * BLOCK + pos % BLOCK
            flat_k[slot] = torch.randn(kv_heads, dim, generator=gen)
            flat_v[slot] = torch.randn(kv_heads, dim, generator=gen)
        tables.append(blocks)
    return k_cache, v_cache, tables, gen


@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [
    (9, 3, 64),  # SmolLM2-135M: GQA groups of 3, the AVX2 path
    (4, 4, 32),  # plain multi-head
    (6, 2, 20),  # a head_dim the vector loops do not divide: scalar dot products and tails
])
@pytest.mark.parametrize("seq_lens", [
    [1, 15, 16, 17, 31, 32, 33, 48],  # both sides of block boundaries
    [200],  # one decode alone (the SDPA path sends it the prefill way)
    [5, 77, 3, 130, 64, 9, 1, 250, 33],  # mixed lengths, as under continuous batching
])
def test_decodes_match_naive_attention(heads, kv_heads, dim, seq_lens):
    k_cache, v_cache, tables, gen = paged_layout(seq_lens, heads, kv_heads, dim, seed=len(seq_lens) * dim)
    query = torch.randn(len(seq_lens), heads, dim, generator=gen)
    query_lens = [1] * len(seq_lens)
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, BLOCK)
    scale = dim**-0.5
    got = TorchBackend().attend(query, k_cache, v_cache, meta, scale)
    assert "_torch_plan_paged" in meta.__dict__  # the kernel served these decodes
    want = naive(query, k_cache, v_cache, query_lens, seq_lens, tables, scale)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    sdpa = TorchBackend(paged_decode=False).attend(query, k_cache, v_cache, meta, scale)
    torch.testing.assert_close(got, sdpa, atol=2e-5, rtol=1e-5)


def test_decodes_between_prefill_chunks():
    """Decode rows sit between a first prompt chunk and a later chunk: each lands in its own row."""
    query_lens, seq_lens = [1, 12, 1, 1, 7, 1], [40, 12, 16, 17, 39, 3]
    k_cache, v_cache, tables, gen = paged_layout(seq_lens, 9, 3, 64, seed=7)
    query = torch.randn(sum(query_lens), 9, 64, generator=gen)
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, BLOCK)
    got = TorchBackend().attend(query, k_cache, v_cache, meta, 0.125)
    torch.testing.assert_close(got, naive(query, k_cache, v_cache, query_lens, seq_lens, tables, 0.125),
                               atol=2e-5, rtol=1e-5)


def test_off_by_one_table_is_caught():
    """The layout makes index errors visible: shifting one sequence's table by a block moves the output."""
    seq_lens = [33, 20]
    k_cache, v_cache, tables, gen = paged_layout(seq_lens, 9, 3, 64, seed=3)
    query = torch.randn(2, 9, 64, generator=gen)
    good = TorchBackend().attend(query, k_cache, v_cache, AttentionMetadata.build([1, 1], seq_lens, tables, BLOCK), 0.125)
    shifted = [tables[0][1:] + tables[1][:1], tables[1]]
    bad = TorchBackend().attend(query, k_cache, v_cache, AttentionMetadata.build([1, 1], seq_lens, shifted, BLOCK), 0.125)
    assert (good[0] - bad[0]).abs().max() > 1.0
    longer = TorchBackend().attend(query, k_cache, v_cache, AttentionMetadata.build([1, 1], [34, 20], tables, BLOCK), 0.125)
    assert (good[0] - longer[0]).abs().max() > 1.0  # one unowned slot (keys of 50) read too many


def test_bf16_falls_back_to_sdpa():
    seq_lens = [20, 40]
    k_cache, v_cache, tables, gen = paged_layout(seq_lens, 9, 3, 64, seed=5)
    query = torch.randn(2, 9, 64, generator=gen)
    meta = AttentionMetadata.build([1, 1], seq_lens, tables, BLOCK)
    got = TorchBackend().attend(query.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16(), meta, 0.125)
    assert "_torch_plan_paged" not in meta.__dict__
    torch.testing.assert_close(got.float(), naive(query, k_cache, v_cache, [1, 1], seq_lens, tables, 0.125),
                               atol=0.05, rtol=0.05)


def test_threads_split_the_decodes():
    """threads=2 over more than 1024 cached tokens splits the decodes between two pthreads: every
    share's rows still land in their own places."""
    seq_lens = [300, 7, 129, 250, 16, 411, 64, 1]
    k_cache, v_cache, tables, gen = paged_layout(seq_lens, 9, 3, 64, seed=11)
    query = torch.randn(len(seq_lens), 9, 64, generator=gen)
    meta = AttentionMetadata.build([1] * len(seq_lens), seq_lens, tables, BLOCK)
    got = torch.full_like(query, float("nan"))
    index = torch.arange(len(seq_lens))
    cpu_paged.paged_decode(query, k_cache, v_cache, meta.block_tables, meta.seq_lens, index, index, 0.125, got,
                           threads=2)
    torch.testing.assert_close(got, naive(query, k_cache, v_cache, [1] * len(seq_lens), seq_lens, tables, 0.125),
                               atol=2e-5, rtol=1e-5)
