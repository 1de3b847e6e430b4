"""Triton attention kernels (KV write, paged decode, extend) against the torch reference backend,
run on CPU through the Triton interpreter."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton

import pytest  # noqa: E402
import torch  # noqa: E402

from iterserve.engine.attention import get_backend  # noqa: E402
from iterserve.engine.attention.backend import AttentionMetadata  # noqa: E402
from iterserve.engine.attention.torch_backend import TorchBackend  # noqa: E402
from iterserve.engine.attention.triton_backend import TritonBackend  # noqa: E402

ATOL = 2e-5  # fp32 through numpy; observed errors are around 1e-6

REFERENCE = TorchBackend()


class Batch:
    """One step's batch over a paged pool whose blocks are handed out in shuffled order, so block
    tables are non-contiguous, with spare blocks full of noise that must never be read."""

    def __init__(self, query_lens, seq_lens, block_size, num_heads, num_kv_heads, head_dim, seed=0,
                 qkv_views=False):
        gen = torch.Generator().manual_seed(seed)
        needed = [-(-s // block_size) for s in seq_lens]
        num_blocks = sum(needed) + 3
        order = torch.randperm(num_blocks, generator=gen).tolist()
        self.tables, start = [], 0
        for n in needed:
            self.tables.append(order[start:start + n])
            start += n
        self.meta = AttentionMetadata.build(query_lens, seq_lens, self.tables, block_size)
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k_cache = torch.randn(shape, generator=gen)
        self.v_cache = torch.randn(shape, generator=gen)
        tokens = sum(query_lens)
        q_width, kv_width = num_heads * head_dim, num_kv_heads * head_dim
        if qkv_views:  # strided views into one fused projection, as a model produces them
            qkv = torch.randn(tokens, q_width + 2 * kv_width, generator=gen)
            self.query = qkv[:, :q_width].view(tokens, num_heads, head_dim)
            self.key = qkv[:, q_width:q_width + kv_width].view(tokens, num_kv_heads, head_dim)
            self.value = qkv[:, q_width + kv_width:].view(tokens, num_kv_heads, head_dim)
        else:
            self.query = torch.randn(tokens, num_heads, head_dim, generator=gen)
            self.key = torch.randn(tokens, num_kv_heads, head_dim, generator=gen)
            self.value = torch.randn(tokens, num_kv_heads, head_dim, generator=gen)
        self.scale = head_dim ** -0.5

    def run(self, backend):
        k_cache, v_cache = self.k_cache.clone(), self.v_cache.clone()
        backend.write_kv(self.key, self.value, k_cache, v_cache, self.meta)
        out = backend.attend(self.query, k_cache, v_cache, self.meta, self.scale)
        return k_cache, v_cache, out


def assert_matches_reference(batch: Batch, backend: TritonBackend) -> float:
    want_k, want_v, want = batch.run(REFERENCE)
    got_k, got_v, got = batch.run(backend)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v), "KV write differs from the reference"
    error = (got - want).abs().max().item()
    assert error < ATOL, f"attention differs from the reference by {error}"
    return error


# (block_size, num_heads, num_kv_heads, head_dim, seq_lens): lengths end exactly on a block
# boundary, just after one, and inside the first block.
DECODE_CASES = [
    (8, 4, 4, 64, [8, 9, 1, 16, 17]),
    (16, 6, 2, 128, [16, 17, 33, 5]),
    (32, 8, 2, 64, [32, 33, 64, 65, 2]),
    (16, 12, 4, 64, [48, 49, 3]),
]


@pytest.mark.parametrize("block_size,num_heads,num_kv_heads,head_dim,seq_lens", DECODE_CASES)
def test_decode_matches_reference(block_size, num_heads, num_kv_heads, head_dim, seq_lens):
    batch = Batch([1] * len(seq_lens), seq_lens, block_size, num_heads, num_kv_heads, head_dim)
    assert_matches_reference(batch, TritonBackend())


@pytest.mark.parametrize("splits", [2, 8])
def test_split_k_decode_matches_reference(splits):
    # With 8 splits the 3-token sequence leaves most splits empty; the merge must ignore them.
    batch = Batch([1] * 4, [130, 3, 17, 64], 16, 8, 2, 64, seed=1)
    assert_matches_reference(batch, TritonBackend(decode_splits=splits))


def test_many_decodes_of_mixed_lengths():
    lengths = torch.randint(1, 90, (24,), generator=torch.Generator().manual_seed(7)).tolist()
    batch = Batch([1] * len(lengths), lengths, 16, 9, 3, 64, seed=7)
    assert_matches_reference(batch, TritonBackend())


# (block_size, num_heads, num_kv_heads, head_dim, query_lens, seq_lens): prefills from scratch,
# chunks over a cached prefix, chunks ending exactly on / just after a block boundary, and a chunk
# longer than one query tile.
EXTEND_CASES = [
    (8, 6, 2, 64, [8, 9, 3], [8, 25, 19]),
    (16, 4, 4, 128, [17, 16], [33, 16]),
    (32, 8, 2, 64, [33, 70], [65, 70]),
    (16, 12, 4, 64, [5, 2], [5, 40]),
]


@pytest.mark.parametrize("block_size,num_heads,num_kv_heads,head_dim,query_lens,seq_lens", EXTEND_CASES)
def test_extend_matches_reference(block_size, num_heads, num_kv_heads, head_dim, query_lens, seq_lens):
    batch = Batch(query_lens, seq_lens, block_size, num_heads, num_kv_heads, head_dim, seed=2)
    assert_matches_reference(batch, TritonBackend())


def test_mixed_step_of_prefills_chunks_and_decodes():
    # Decodes, a 1-token chunk over a prefix, a fresh prompt and a mid-prompt chunk in one launch
    # pair, with q/k/v as strided views of one fused projection.
    batch = Batch([1, 1, 12, 1, 7, 1], [40, 16, 12, 9, 31, 1], 8, 6, 2, 64, seed=3, qkv_views=True)
    assert_matches_reference(batch, TritonBackend())


def test_fp16_step_matches_the_fp32_reference():
    """Half precision, as on a GPU: fp16 loads, fp32 accumulation, rounding of p before p @ V."""
    batch = Batch([1, 6, 1], [33, 22, 8], 16, 8, 2, 64, seed=8)
    _, _, want = batch.run(REFERENCE)
    for name in ("query", "key", "value", "k_cache", "v_cache"):
        setattr(batch, name, getattr(batch, name).half())
    _, _, got = batch.run(TritonBackend())
    assert got.dtype == torch.float16
    assert (got.float() - want).abs().max().item() < 2e-3


def test_extend_kernel_handles_one_token_chunks():
    """The backend routes 1-token queries to the decode kernel; the extend kernel must still be
    right for them (min_query_len=1 sends every sequence through it)."""
    from iterserve.engine.kernels.extend_attention import extend_attention

    batch = Batch([1, 1, 4, 1], [17, 1, 20, 32], 16, 6, 2, 64, seed=4)
    k_cache, v_cache, want = batch.run(REFERENCE)
    got = torch.full_like(batch.query, float("nan"))
    meta = batch.meta
    extend_attention(batch.query, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                     got, batch.scale, max_query_len=meta.max_query_len, min_query_len=1)
    assert (got - want).abs().max().item() < ATOL


def test_kv_write_touches_only_the_new_slots():
    batch = Batch([3, 1], [10, 17], 8, 4, 2, 64, seed=5)
    k_cache, v_cache = batch.k_cache.clone(), batch.v_cache.clone()
    TritonBackend().write_kv(batch.key, batch.value, k_cache, v_cache, batch.meta)
    flat_k = k_cache.view(-1, 2, 64)
    slots = batch.meta.slot_mapping
    assert torch.equal(flat_k[slots], batch.key)
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(flat_k[untouched], batch.k_cache.view(-1, 2, 64)[untouched])


def test_get_backend_builds_the_triton_backend():
    assert isinstance(get_backend("triton"), TritonBackend)


# -- bad input: a clear ValueError before any kernel runs ---------------------------------------


@pytest.fixture
def small():
    return Batch([2, 1], [9, 5], 8, 4, 2, 64, seed=6)


def test_block_table_past_the_pool_is_rejected_before_writing(small):
    small.meta.block_tables[1, 0] = small.k_cache.shape[0]
    k_cache = small.k_cache.clone()
    with pytest.raises(ValueError, match=r"block_tables\[1, 0\].*outside the KV pool"):
        TritonBackend().attend(small.query, k_cache, small.v_cache, small.meta, small.scale)
    with pytest.raises(ValueError, match="outside the KV pool"):
        TritonBackend().write_kv(small.key, small.value, k_cache, small.v_cache.clone(), small.meta)
    assert torch.equal(k_cache, small.k_cache)


def test_slot_past_the_pool_is_rejected(small):
    small.meta.slot_mapping[0] = small.k_cache.shape[0] * small.k_cache.shape[1]
    with pytest.raises(ValueError, match=r"slot_mapping\[0\]"):
        TritonBackend().write_kv(small.key, small.value, small.k_cache, small.v_cache, small.meta)


def test_heads_not_a_multiple_of_kv_heads_is_rejected(small):
    query = torch.randn(3, 5, 64)
    with pytest.raises(ValueError, match=r"num_heads \(5\) must be a multiple of num_kv_heads \(2\)"):
        TritonBackend().attend(query, small.k_cache, small.v_cache, small.meta, small.scale)


def test_mismatched_shapes_and_dtypes_are_rejected(small):
    backend = TritonBackend()
    with pytest.raises(ValueError, match="head_dim"):
        backend.attend(torch.randn(3, 4, 32), small.k_cache, small.v_cache, small.meta, small.scale)
    with pytest.raises(ValueError, match="query_lens_list sums to 3"):
        backend.attend(torch.randn(4, 4, 64), small.k_cache, small.v_cache, small.meta, small.scale)
    with pytest.raises(ValueError, match="v_cache has shape"):
        backend.attend(small.query, small.k_cache, small.v_cache[:, :4], small.meta, small.scale)
    with pytest.raises(ValueError, match="key has shape"):
        backend.write_kv(torch.randn(3, 3, 64), torch.randn(3, 3, 64), small.k_cache, small.v_cache, small.meta)
    with pytest.raises(ValueError, match="value has dtype torch.float64"):
        backend.write_kv(small.key, small.value.double(), small.k_cache, small.v_cache, small.meta)
    with pytest.raises(ValueError, match="k_cache has dtype torch.float64"):
        backend.attend(small.query, small.k_cache.double(), small.v_cache, small.meta, small.scale)
    with pytest.raises(ValueError, match="query has dtype torch.bfloat16; the triton backend on cpu supports"):
        backend.attend(small.query.bfloat16(), small.k_cache.bfloat16(), small.v_cache.bfloat16(), small.meta,
                       small.scale)


def test_block_table_too_narrow_is_rejected():
    meta = AttentionMetadata.build([1], [9], [[0, 1]], 8)
    meta.block_tables = meta.block_tables[:, :1]  # 9 tokens need 2 blocks of 8
    cache = torch.zeros(4, 8, 2, 64)
    with pytest.raises(ValueError, match="block_tables has 1 columns"):
        TritonBackend().attend(torch.randn(1, 2, 64), cache, cache, meta, 0.125)
