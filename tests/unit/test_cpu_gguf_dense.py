"""GGUF linears of many rows on the dequantized weight (cpu_gguf.dense_linear): the C dequantizer gives gguf's
own fp32 weights bit for bit in every format, the tiled product gives `--quantization none`'s linear bit for
bit, and the switch from the blocks happens at the threshold (ITERSERVE_GGUF_DENSE_ROWS, else per ISA)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from iterserve.engine.model import cpu_gguf
from iterserve.engine.model.layers import linear as none_linear
from iterserve.engine.model.quant import GGUFLinear
from tests.unit.test_cpu_gguf import K_QUANTS, SMALL, activations, blocks_for

pytestmark = pytest.mark.skipif(cpu_gguf.load() is None, reason="needs AVX2 and a C compiler")
ENV = cpu_gguf.DENSE_ROWS_ENV


def random_bytes(name: str, n: int, k: int, seed: int) -> torch.Tensor:
    """Blocks of every bit pattern, scales included (fp16 subnormals, infinities and NaNs)."""
    weights, nbytes = cpu_gguf.block_shape(cpu_gguf.BY_NAME[name])
    raw = np.random.default_rng(seed).integers(0, 256, (n, k // weights * nbytes), dtype=np.uint8)
    return torch.from_numpy(raw)


def assert_same_bits(got: torch.Tensor, want: torch.Tensor, what) -> None:
    """Equal values, NaN where want has NaN (NaN payloads aside)."""
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan), what
    assert torch.equal(got[~nan].view(torch.int32), want[~nan].view(torch.int32)), what


@pytest.mark.parametrize("name", SMALL + K_QUANTS)
def test_the_kernel_dequantizes_every_format_as_gguf_does_bit_for_bit(name):
    type_id = cpu_gguf.BY_NAME[name]
    shapes = ((2, 32), (7, 576), (67, 1536)) if name in SMALL else ((1, 256), (7, 512), (67, 1536))
    for n, k in shapes:
        for blocks in (blocks_for(name, n, k, seed=k), random_bytes(name, n, k, seed=n)):
            with np.errstate(invalid="ignore", over="ignore"):  # gguf's numpy on infinite and NaN scales
                want = cpu_gguf.dequantize(blocks, type_id)
            for threads in (1, 2, 3):  # 67 rows: uneven shares of the pool
                got = cpu_gguf.dequantize_into(torch.full((n, k), 7.0), blocks, type_id, threads)
                assert_same_bits(got, want, (name, n, k, threads))
        # into a wider buffer (row stride past K), whose other columns stay untouched
        wide = torch.full((n, k + 32), 7.0)
        cpu_gguf.dequantize_into(wide[:, :k], blocks, type_id)
        assert_same_bits(wide[:, :k], want, (name, n, k, "strided"))
        assert (wide[:, k:] == 7.0).all()


def test_a_width_that_is_not_whole_blocks_is_refused_with_the_format_named():
    blocks = blocks_for("Q6_K", 4, 256)
    with pytest.raises(ValueError, match="gguf_dequantize: K=288 does not fit Q6_K"):
        cpu_gguf.dequantize_into(torch.empty(4, 288), blocks, cpu_gguf.BY_NAME["Q6_K"])


# the embedded model's linears (q/o, gate_up, down) and the tied LM head, in the formats GGUF files give them
SHAPES = ((576, 576, "Q4_1"), (3072, 576, "Q8_0"), (576, 1536, "Q4_K"), (576, 1536, "Q6_K"), (49152, 576, "Q8_0"))


@pytest.fixture
def torch_threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def test_the_dense_path_equals_the_none_mode_s_linear_bit_for_bit(torch_threads):
    """Tile by tile (several tiles and a short last one on every shape here) the product is the none mode's
    linear on gguf's dequantized weight: the same GEMM on the same fp32 values, at any thread count."""
    for n, k, name in SHAPES:
        type_id = cpu_gguf.BY_NAME[name]
        blocks = blocks_for(name, n, k, seed=n + k)
        dense = cpu_gguf.dequantize(blocks, type_id)
        assert n > cpu_gguf.tile_rows(k, n)
        for threads in (1, 2):
            torch_threads(threads)
            for rows in ((64,) if n == 49152 else (1, 2, 17, 32, 33, 64, 256)):
                x = activations(rows, k, seed=rows)
                got = cpu_gguf.linear(x, blocks, type_id, threads, dense_rows=1)
                assert torch.equal(got, none_linear(x, dense)), (name, n, k, rows, threads)


@pytest.mark.parametrize("name", SMALL + K_QUANTS)
def test_every_format_s_dense_path_equals_the_none_mode_s_linear(name):
    type_id = cpu_gguf.BY_NAME[name]
    k = 512
    blocks = blocks_for(name, 1029, k, seed=3)  # tiles of 352 rows, the last overlapping
    x = activations(48, k, seed=4)
    got = cpu_gguf.linear(x, blocks, type_id, 1, dense_rows=48)
    assert torch.equal(got, none_linear(x, cpu_gguf.dequantize(blocks, type_id))), name


def test_the_switch_is_at_the_threshold_below_on_the_blocks(monkeypatch):
    """ITERSERVE_GGUF_DENSE_ROWS=M: M - 1 rows compute on the blocks (the kernel's bits), M rows on the
    dequantized weight (the none mode's bits), through GGUFLinear as the model calls it; 0: never dense."""
    type_id = cpu_gguf.BY_NAME["Q4_1"]
    blocks = blocks_for("Q4_1", 200, 576, seed=9)
    layer = GGUFLinear([(type_id, blocks)])
    dense = cpu_gguf.dequantize(blocks, type_id)
    x = activations(40, 576, seed=2)
    monkeypatch.setenv(ENV, "40")
    assert cpu_gguf.dense_threshold() == 40
    below, at = layer(x[:39]), layer(x)
    assert torch.equal(below, cpu_gguf.reference(x[:39], blocks, type_id))
    assert torch.equal(at, none_linear(x, dense)) and not torch.equal(at[:39], below)
    monkeypatch.setenv(ENV, "0")
    assert torch.equal(layer(x), cpu_gguf.reference(x, blocks, type_id))


def test_the_default_threshold_is_this_instruction_set_s(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    threshold = cpu_gguf.dense_threshold()
    assert threshold == cpu_gguf.DENSE_ROWS[cpu_gguf.isa_path()]
    # no path switches by default: a row's arithmetic must not depend on how many rows share its step
    assert set(cpu_gguf.DENSE_ROWS.values()) == {0}
    type_id = cpu_gguf.BY_NAME["Q8_0"]
    blocks = blocks_for("Q8_0", 40, 576, seed=1)
    x = activations(64, 576, seed=5)
    assert torch.equal(cpu_gguf.linear(x, blocks, type_id, 1)[:1], cpu_gguf.linear(x[:1], blocks, type_id, 1))
    if threshold:
        type_id = cpu_gguf.BY_NAME["Q8_0"]
        blocks = blocks_for("Q8_0", 40, 576, seed=1)
        x = activations(threshold, 576, seed=5)
        assert torch.equal(cpu_gguf.linear(x, blocks, type_id, 1),
                           none_linear(x, cpu_gguf.dequantize(blocks, type_id)))
        assert torch.equal(cpu_gguf.linear(x[:-1], blocks, type_id, 1),
                           cpu_gguf.reference(x[:-1], blocks, type_id))


@pytest.mark.parametrize("value", ["many", "-1", "4.5"])
def test_a_threshold_that_is_not_a_row_count_is_refused_naming_the_variable(monkeypatch, value):
    monkeypatch.setenv(ENV, value)
    with pytest.raises(ValueError, match=f"{ENV}='{value}'.*0: never"):
        cpu_gguf.dense_threshold()


def test_a_model_serves_with_prefill_on_dequantized_tiles_and_decode_on_the_blocks(monkeypatch):
    from iterserve.engine.llm import LLM, SamplingParams

    monkeypatch.setenv(ENV, "4")  # the prompt's prefill (6 tokens) dense, one-sequence decode steps on blocks
    llm = LLM(quantization="auto", device="cpu", max_model_len=128, num_kv_blocks=32)
    assert llm.engine.executor.quantization == "gguf"
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    assert "Paris" in llm.generate(["The capital of France is"], params, use_tqdm=False)[0].outputs[0].text
