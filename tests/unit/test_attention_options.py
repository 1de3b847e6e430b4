"""Sliding window and logit soft-cap (AttentionOptions) in every attention path, against a naive
per-query reference written from the definition (query at position p sees keys p - window + 1 .. p;
scores cap * tanh(s / cap)): the torch backend's SDPA masks, its explicit soft-cap path, the CPU
paged decode kernel, and the Triton decode and extend kernels under the interpreter. Each batch
mixes prefill chunks that start mid-sequence with decodes past the window, over shuffled blocks."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton

import math  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from iterserve.engine.attention import cpu_paged  # noqa: E402
from iterserve.engine.attention.backend import AttentionMetadata, AttentionOptions  # noqa: E402
from iterserve.engine.attention.torch_backend import TorchBackend  # noqa: E402

BLOCK = 8
HEADS, KV_HEADS, DIM = 6, 2, 32
# (query_lens, seq_lens): a first chunk longer than the window, a later chunk, decodes past the
# window and inside it, a chunk that ends on a block boundary.
BATCH = ([20, 7, 1, 1, 1, 16], [20, 40, 33, 5, 17, 48])


def naive(query, k_cache, v_cache, tables, query_lens, seq_lens, scale, window, softcap):
    out = torch.empty_like(query)
    group = HEADS // KV_HEADS
    row = 0
    for table, q_len, s_len in zip(tables, query_lens, seq_lens, strict=True):
        slots = [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(s_len)]
        keys = k_cache.view(-1, KV_HEADS, DIM)[slots].repeat_interleave(group, dim=1)  # [L, H, D]
        values = v_cache.view(-1, KV_HEADS, DIM)[slots].repeat_interleave(group, dim=1)
        for j in range(q_len):
            pos = s_len - q_len + j
            lo = 0 if window is None else max(0, pos - window + 1)
            scores = torch.einsum("hd,lhd->hl", query[row].double(), keys[lo:pos + 1].double()) * scale
            if softcap is not None:
                scores = softcap * torch.tanh(scores / softcap)
            out[row] = torch.einsum("hl,lhd->hd", scores.softmax(-1), values[lo:pos + 1].double()).float()
            row += 1
    return out


def batch(seed=0):
    gen = torch.Generator().manual_seed(seed)
    query_lens, seq_lens = BATCH
    counts = [-(-n // BLOCK) for n in seq_lens]
    num_blocks = sum(counts) + 4
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables, used = [], 0
    for count in counts:
        tables.append(order[used:used + count])
        used += count
    k_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, DIM, generator=gen)
    v_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, DIM, generator=gen)
    query = 3 * torch.randn(sum(query_lens), HEADS, DIM, generator=gen)  # large scores: the cap matters
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, BLOCK)
    return query, k_cache, v_cache, tables, meta


OPTIONS = [AttentionOptions(sliding_window=12), AttentionOptions(sliding_window=1),
           AttentionOptions(logit_softcap=5.0), AttentionOptions(sliding_window=9, logit_softcap=2.0),
           AttentionOptions(sliding_window=100)]


def _backends():
    yield "torch-sdpa", TorchBackend(paged_decode=False)
    if cpu_paged.load() is not None:
        yield "torch-paged-decode", TorchBackend()
    from iterserve.engine.attention.triton_backend import TritonBackend

    yield "triton", TritonBackend()
    yield "triton-split-decode", TritonBackend(decode_splits=4)


@pytest.mark.parametrize("options", OPTIONS, ids=str)
def test_every_attention_path_applies_the_window_and_softcap(options):
    query, k_cache, v_cache, tables, meta = batch()
    scale = DIM ** -0.5
    want = naive(query, k_cache, v_cache, tables, *BATCH, scale, options.sliding_window, options.logit_softcap)
    for name, backend in _backends():
        got = backend.attend(query, k_cache, v_cache, meta, scale, options)
        error = (got - want).abs().max().item()
        assert error < 2e-5, f"{name}: differs from the definition by {error}"


def test_the_window_changes_the_answer_where_it_should():
    # A guard against a test that passes because the window is ignored: without it the rows past
    # the window differ from the windowed reference, and rows inside it do not.
    query, k_cache, v_cache, tables, meta = batch()
    scale = DIM ** -0.5
    full = naive(query, k_cache, v_cache, tables, *BATCH, scale, None, None)
    windowed = TorchBackend().attend(query, k_cache, v_cache, meta, scale, AttentionOptions(sliding_window=12))
    positions = [s - q + j for q, s in zip(*BATCH, strict=True) for j in range(q)]
    for row, pos in enumerate(positions):
        same = torch.allclose(full[row], windowed[row], atol=1e-5)
        assert same == (pos < 12), f"row {row} at position {pos}"


def test_prefill_chunk_reads_only_the_blocks_its_window_reaches():
    query, k_cache, v_cache, tables, meta = batch()
    from iterserve.engine.attention.torch_backend import _plan

    plan = _plan(meta, BLOCK, query.device, query.dtype, False, 12)
    # sequence 1: 7 new tokens at positions 33..39; the oldest key seen is 33 - 11 = 22, in block 2
    q_start, q_end, blocks, keys, mask, causal = plan.prefills[1]
    assert (q_end - q_start, keys) == (7, 40 - 16) and blocks.tolist() == tables[1][2:5]
    assert mask.shape == (7, 24) and not causal


def test_options_are_checked():
    with pytest.raises(ValueError, match="sliding_window"):
        AttentionOptions(sliding_window=0)
    with pytest.raises(ValueError, match="logit_softcap"):
        AttentionOptions(logit_softcap=-1.0)
    assert math.isclose(AttentionOptions(logit_softcap=3).logit_softcap, 3)
