"""GGUF linears on the file's own blocks (engine/model/cpu_gguf.py): the C kernel equals its torch
reference bit for bit in every format, at every row count, tiling tail and thread count."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest
import torch

from iterserve.engine import native
from iterserve.engine.model import cpu_gguf

SMALL = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K", "Q2_K", "Q3_K")
SCALES_AT = {"Q6_K": 208, "Q2_K": 80, "Q3_K": 108}  # where the fp16 d (then dmin, where there is one) sits


def blocks_for(name: str, n: int, k: int, seed: int = 0) -> torch.Tensor:
    """[n, row bytes] blocks of format name: gguf's own quantizer for the 32-weight formats (it has
    none for K-quants), random valid blocks (every bit pattern of the quants and scales, small
    finite fp16 d and dmin) for the K-quants."""
    import gguf.quants

    rng = np.random.default_rng(seed)
    type_id = cpu_gguf.BY_NAME[name]
    weights, nbytes = cpu_gguf.block_shape(type_id)
    if name in SMALL:
        w = (rng.standard_normal((n, k)) / 8).astype(np.float32)
        w[0, :32] = 0.0  # an all-zero block
        raw = getattr(gguf.quants, name).quantize_blocks(w.reshape(-1, 32))
        if name == "Q8_0":
            raw[1, 2:34] = np.int8(-128).view(np.uint8)  # the one int8 a plain sign trick gets wrong
    else:
        raw = rng.integers(0, 256, (n * k // weights, nbytes), dtype=np.uint8)
        scale = (rng.random((raw.shape[0], 2)) * 0.02).astype(np.float16).view(np.uint8)
        at = SCALES_AT.get(name, 0)
        width = 2 if name in ("Q6_K", "Q3_K") else 4
        raw[:, at:at + width] = scale[:, 0:width]
    return torch.from_numpy(np.ascontiguousarray(raw.reshape(n, -1)))


def activations(rows: int, k: int, seed: int) -> torch.Tensor:
    torch.manual_seed(seed)
    x = torch.randn(rows, k) * torch.rand(rows, 1) * 5
    x[0, : k // 2] = 0.0  # zero blocks
    if rows > 2:
        x[1, 5] = 300.0  # one outlier: only its own block's scale coarsens
        x[2, :32] *= 1e-35  # a block below MIN_AMAX
    return x


@pytest.mark.parametrize("name", SMALL + K_QUANTS)
def test_unpack_gives_gguf_s_own_weights(name):
    type_id = cpu_gguf.BY_NAME[name]
    blocks = blocks_for(name, 7, 512)
    q, wd, wmin, offset = cpu_gguf.unpack(blocks, type_id)
    mine = wd.repeat_interleave(4, -1).reshape(7, -1) * (q.float() - offset)
    if wmin is not None:  # one per block, or one per lane of 4 (Q2_K)
        mine = mine + wmin.repeat_interleave(32 if wmin.dim() == 2 else 4, -1).reshape(7, -1)
    torch.testing.assert_close(mine, cpu_gguf.dequantize(blocks, type_id), rtol=1e-6, atol=1e-7)


needs_kernel = pytest.mark.skipif(cpu_gguf.load() is None, reason="needs AVX2 and a C compiler")


@needs_kernel
@pytest.mark.parametrize("name", SMALL + K_QUANTS)
def test_the_kernel_matches_its_torch_reference_bit_for_bit(name):
    widths = (32, 576, 1536) if name in SMALL else (256, 1536)
    for k in widths:
        blocks = blocks_for(name, 67, k, seed=k)  # 67 output rows: uneven thread shares
        type_id = cpu_gguf.BY_NAME[name]
        for rows in (1, 2, 3, 4, 5, 7, 9, 64, 66):  # the 4-row tiles and every tail
            x = activations(rows, k, seed=rows)
            reference = cpu_gguf.reference(x, blocks, type_id)
            for threads in (1, 2, 3):
                # the row tiles at every row count (the default moves to the panels from a few rows)
                got = cpu_gguf.linear(x, blocks, type_id, threads, panel_rows=1 << 30)
                assert torch.equal(got, reference), (name, k, rows, threads)
            assert torch.equal(cpu_gguf.linear(x, blocks, type_id, 2), reference), (name, k, rows)
        dense = cpu_gguf.dequantize(blocks, type_id)
        x = activations(9, k, seed=1)
        # each activation off by at most half a step of its block's 1/127 of amax, and nothing else
        error = (cpu_gguf.linear(x, blocks, type_id, 1) - x @ dense.t()).abs()
        step = x.view(9, -1, 32).abs().amax(-1).repeat_interleave(32, -1) / 254
        assert (error <= 1.01 * step @ dense.abs().t() + 1e-4).all(), name


@needs_kernel
@pytest.mark.parametrize("name", SMALL + K_QUANTS)
def test_the_panel_path_of_many_rows_matches_the_reference_bit_for_bit(name):
    """From cpu_gguf.panel_rows(type) rows on the kernel decodes 16 (AVX2: 8) weight rows at a time into a
    panel shared by all rows: at the threshold, an odd count (the 2-row tile's tail), a prefill chunk,
    67 weight rows (a panel's tail, uneven thread shares) and K = 1536 (several panels per cache tile)."""
    type_id = cpu_gguf.BY_NAME[name]
    for k in ((576, 1536) if name in SMALL else (256, 1536)):
        blocks = blocks_for(name, 67, k, seed=k + 1)
        first = cpu_gguf.panel_rows(type_id)
        for rows in ((first, 17, 64, 256, 300) if k == 1536 else (first, 300)):
            x = activations(rows, k, seed=rows)
            reference = cpu_gguf.reference(x, blocks, type_id)
            for threads in (1, 2, 3):
                got = cpu_gguf.linear(x, blocks, type_id, threads)
                assert torch.equal(got, reference), (name, k, rows, threads)
        for rows in (1, 3):  # the panels asked for at a few rows: still the same bits
            x = activations(rows, k, seed=rows)
            got = cpu_gguf.linear(x, blocks, type_id, 2, panel_rows=1)
            assert torch.equal(got, cpu_gguf.reference(x, blocks, type_id)), (name, k, rows)


@needs_kernel
def test_weight_rows_past_one_cache_tile_match_the_reference():
    """Rows of 2,448 bytes (Q8_0, K = 2304): one thread's 67 weight rows span two cache tiles of the
    kernel (66 rows, then a one-row register tail)."""
    type_id = cpu_gguf.BY_NAME["Q8_0"]
    blocks = blocks_for("Q8_0", 67, 2304, seed=5)
    for rows in (1, 6):
        x = activations(rows, 2304, seed=rows)
        reference = cpu_gguf.reference(x, blocks, type_id)
        for threads in (1, 2):
            assert torch.equal(cpu_gguf.linear(x, blocks, type_id, threads), reference), (rows, threads)


@pytest.mark.parametrize("name", SMALL + K_QUANTS)
def test_an_embedding_in_block_format_gives_the_dense_table_s_rows(name):
    type_id = cpu_gguf.BY_NAME[name]
    blocks = blocks_for(name, 50, 512)
    table = cpu_gguf.BlockRows(type_id, blocks)
    ids = torch.tensor([[3, 0, 49], [7, 7, 1]])
    dense = cpu_gguf.dequantize(blocks, type_id)
    assert table.shape == (50, 512) and table.nbytes == blocks.numel()
    assert torch.equal(cpu_gguf.embedding(ids, table), torch.nn.functional.embedding(ids, dense))
    with pytest.raises(IndexError, match="50 rows"):
        cpu_gguf.embedding(torch.tensor([50]), table)


@needs_kernel
@pytest.mark.skipif(cpu_gguf.isa_path() == "avx2", reason="the AVX2 path is the one the other tests run")
def test_the_plain_avx2_path_gives_the_same_bits_as_vnni():
    plain = cpu_gguf.build("avx2")
    for name in SMALL + K_QUANTS:
        blocks = blocks_for(name, 67, 512)
        type_id = cpu_gguf.BY_NAME[name]
        for rows in (5, 33):  # the row tiles and the panels
            x = activations(rows, 512, seed=3)
            assert torch.equal(cpu_gguf.linear(x, blocks, type_id, 2, plain), cpu_gguf.linear(x, blocks, type_id, 2))
        assert torch.equal(cpu_gguf.linear(x, blocks, type_id, 2, plain), cpu_gguf.reference(x, blocks, type_id))


@needs_kernel
@pytest.mark.parametrize("isa", sorted(set(cpu_gguf.ISA_FLAGS) - {cpu_gguf.isa_path()}))
def test_every_instruction_set_path_this_cpu_cannot_run_compiles(isa, tmp_path):
    """The paths this CPU cannot run still compile (the ones it can run are compared above). At -O1:
    the intrinsics are checked the same (always_inline functions are inlined at every level), in
    20 s where -O3 took 50 s for each path."""
    source = tmp_path / "gguf.c"
    source.write_text(cpu_gguf._SOURCE)
    flags = ["-O1" if flag == "-O3" else flag for flag in native.BASE_FLAGS]
    done = subprocess.run([native.find_compiler(), *flags, *native.isa_flags(), *cpu_gguf.compile_flags(isa), str(source), "-o",
                           str(tmp_path / "gguf.so"), "-lm"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]


@needs_kernel
def test_a_block_with_nan_or_inf_makes_its_row_nan_and_leaves_the_others():
    blocks = blocks_for("Q4_1", 40, 64)
    x = torch.randn(3, 64)
    x[0, 40] = float("nan")
    x[2, 3] = float("inf")
    got = cpu_gguf.linear(x, blocks, cpu_gguf.BY_NAME["Q4_1"], 2)
    assert got[0].isnan().all() and got[2].isnan().all()
    assert torch.equal(got[1], cpu_gguf.linear(x[1:2], blocks, cpu_gguf.BY_NAME["Q4_1"], 1)[0])


@needs_kernel
def test_a_width_that_is_not_whole_blocks_is_refused_with_the_format_named():
    blocks = blocks_for("Q4_K", 4, 256)
    with pytest.raises(ValueError, match="Q4_K"):
        cpu_gguf.linear(torch.randn(2, 288), blocks, cpu_gguf.BY_NAME["Q4_K"], 1)


@needs_kernel
def test_auto_serves_the_embedded_gguf_on_its_own_blocks_and_float32_stays_exact():
    from iterserve.engine.llm import LLM, SamplingParams
    from iterserve.engine.model.quant import GGUFLinear

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    default = LLM(quantization="auto", device="cpu", max_model_len=256, num_kv_blocks=64)
    runner = default.engine.executor
    assert runner.quantization == "gguf"
    assert isinstance(runner.model.lm_head, GGUFLinear) and runner.model.lm_head.parts[0][0] == 8  # Q8_0
    assert runner.model.layers[0].qkv_proj.parts[0][0] == 3  # the file's Q4_1
    # the tied embedding is the LM head's Q8_0 blocks, its rows dequantized on lookup
    assert isinstance(runner.model.embed_tokens, cpu_gguf.BlockRows)
    assert runner.model.embed_tokens.blocks is runner.model.lm_head.parts[0][1]
    text = default.generate(["The capital of France is"], params, use_tqdm=False)[0].outputs[0].text
    assert "Paris" in text
    exact = LLM(device="cpu", dtype="float32", max_model_len=256, num_kv_blocks=64).engine.executor
    assert exact.quantization == "none" and isinstance(exact.model.lm_head, torch.Tensor)
    ids = torch.tensor([0, 1, 9, 49151])
    assert torch.equal(runner.model.embed(ids), exact.model.embed(ids))
