"""The w8a8 linear (engine/model/quant.py, its kernel engine/model/cpu_w8a8.py): int8 weights x per-row
int8 activations."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.nn.functional as F

from iterserve.engine.model import cpu_w8a8
from iterserve.engine.model.quant import (
    MODES,
    Int4Linear,
    Int8Linear,
    W8A8Linear,
    check_supported,
    effective_mode,
    quantize_dense,
    quantize_lm_head,
)


@pytest.fixture
def weight():
    torch.manual_seed(0)
    return torch.randn(96, 64) / 8


def test_w8a8_is_close_to_the_fp32_product_row_by_row(weight):
    layer = W8A8Linear(weight)
    x = torch.randn(20, 64)
    x[3] *= 1e4  # a huge row and a tiny one: each row is scaled on its own
    x[4] *= 1e-4
    got, reference = layer(x), F.linear(x, weight)
    assert got.dtype == torch.float32 and got.shape == (20, 96)
    # Per row: activations rounded to 1/127 of the row's max |x|, weights to 1/63 of the channel's max.
    for row in range(20):
        bound = 0.03 * x[row].abs().max() * weight.abs().sum(dim=1).max()
        assert (got[row] - reference[row]).abs().max() < bound, row
    assert (layer.dense - weight).abs().max() <= layer.wscale.max() / 2 + 1e-6
    assert layer.qweight.abs().max() <= 63  # AVX2 pair sums: 2 x 255 x 63 fits in int16


def test_w8a8_rows_do_not_depend_on_the_rest_of_the_batch(weight):
    layer = W8A8Linear(weight)
    x = torch.randn(12, 64)
    in_pairs = torch.cat([layer(x[i:i + 2]) for i in range(0, 12, 2)])
    together = layer(x)
    x_big = x.clone()
    x_big[0] *= 1000  # with one activation scale per batch this would coarsen every other row
    x_big[1] = x_big[1].abs()  # and a batch without negative values would shift the zero point
    assert torch.equal(in_pairs, together)
    assert torch.equal(layer(x_big)[2:], together[2:])
    assert torch.equal(layer(torch.zeros(2, 64)), torch.zeros(2, 96))
    assert torch.equal(layer(torch.zeros(1, 64)), torch.zeros(1, 96))


def test_w8a8_one_row_alone_equals_the_same_row_in_a_batch(weight):
    layer = W8A8Linear(weight)
    torch.manual_seed(1)
    x = torch.randn(37, 64) + 0.5
    alone = torch.cat([layer(x[i:i + 1]) for i in range(37)])
    assert torch.equal(alone, layer(x))


@pytest.mark.skipif(cpu_w8a8.load() is None, reason="needs AVX2 and a C compiler")
@pytest.mark.parametrize("in_features", [32, 64, 576, 1536])
def test_the_kernel_matches_its_torch_reference_bit_for_bit(in_features):
    torch.manual_seed(in_features)
    weight = torch.randn(203, in_features) / 8  # 203: tails of every output tiling (4, 2, 1)
    qweight, wscale, wsum = cpu_w8a8.quantize_weight(weight)
    for rows in (1, 2, 3, 4, 5, 7, 9, 64, 66):
        x = torch.randn(rows, in_features) * torch.rand(rows, 1) * 5
        x[0, : in_features // 2] = 0.0
        if rows > 2:
            x[1] = 0.0  # an all-zero row: result 0
            x[2] *= 1e-35  # below MIN_AMAX
        reference = cpu_w8a8.reference(x, qweight, wscale)
        for threads in (1, 2, 3):
            got = cpu_w8a8.linear(x, qweight, wscale, wsum, threads)
            assert torch.equal(got, reference), (rows, threads, (got - reference).abs().max())
    assert torch.equal(cpu_w8a8.linear(torch.zeros(3, in_features), qweight, wscale, wsum, 2), torch.zeros(3, 203))
    wide = torch.randn(5, in_features * 2)
    strided = wide[:, :in_features]  # rows one stride apart, as a view of a wider tensor
    assert torch.equal(cpu_w8a8.linear(strided, qweight, wscale, wsum, 1), cpu_w8a8.reference(strided, qweight, wscale))


@pytest.mark.skipif(cpu_w8a8.load() is None, reason="needs AVX2 and a C compiler")
def test_the_kernel_turns_a_row_with_nan_or_inf_into_nan_and_leaves_the_others():
    torch.manual_seed(3)
    qweight, wscale, wsum = cpu_w8a8.quantize_weight(torch.randn(70, 64))
    x = torch.randn(4, 64)
    x[1, 5], x[2, 60] = float("nan"), float("inf")
    got = cpu_w8a8.linear(x, qweight, wscale, wsum, 2)
    assert got[1].isnan().all() and got[2].isnan().all()
    assert torch.equal(got[[0, 3]], cpu_w8a8.reference(x[[0, 3]], qweight, wscale))


@pytest.mark.skipif(cpu_w8a8.load() is None, reason="needs AVX2 and a C compiler")
def test_concurrent_callers_each_get_their_own_rows():
    """Split execution calls the kernel from two threads at once; a second parallel caller finds
    the pool busy and runs on its own thread."""
    torch.manual_seed(4)
    qweight, wscale, wsum = cpu_w8a8.quantize_weight(torch.randn(1024, 576) / 8)
    inputs = [torch.randn(3, 576) for _ in range(8)]
    expected = [cpu_w8a8.reference(x, qweight, wscale) for x in inputs]

    def work(i):
        return all(torch.equal(cpu_w8a8.linear(inputs[i], qweight, wscale, wsum, 2), expected[i]) for _ in range(30))

    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(work, range(8)))


@pytest.mark.skipif(cpu_w8a8.load() is None, reason="needs AVX2 and a C compiler")
def test_a_forked_child_gets_its_own_pool():
    import os

    torch.manual_seed(6)
    qweight, wscale, wsum = cpu_w8a8.quantize_weight(torch.randn(512, 64))
    x = torch.randn(5, 64)
    expected = cpu_w8a8.reference(x, qweight, wscale)
    assert torch.equal(cpu_w8a8.linear(x, qweight, wscale, wsum, 2), expected)  # the parent's pool is started
    child = os.fork()
    if child == 0:  # without the fork handler this call would wait forever for the parent's worker
        os._exit(0 if torch.equal(cpu_w8a8.linear(x, qweight, wscale, wsum, 2), expected) else 1)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        pid, status = os.waitpid(child, os.WNOHANG)
        if pid:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.05)
    os.kill(child, 9)
    pytest.fail("the forked child's kernel call did not return")


def test_a_width_the_kernel_cannot_take_runs_the_reference():
    torch.manual_seed(5)
    weight = torch.randn(40, 48)  # 48: not a multiple of 32
    layer = W8A8Linear(weight)
    assert not layer.fast
    x = torch.randn(6, 48)
    assert torch.equal(layer(x), cpu_w8a8.reference(x, layer.qweight, layer.wscale))
    assert (layer(x) - F.linear(x, weight)).abs().max() < 0.05 * x.abs().max() * weight.abs().sum(dim=1).max()


def test_modes_build_their_linears_and_refuse_unknown_ones(weight):
    assert set(MODES) == {"auto", "none", "gguf", "int8", "int4", "w8a8"}
    assert isinstance(quantize_dense("int8", weight), Int8Linear)
    assert isinstance(quantize_dense("int4", weight), Int4Linear)
    assert isinstance(quantize_dense("w8a8", weight), W8A8Linear)
    assert isinstance(quantize_lm_head("w8a8", weight), W8A8Linear)
    assert isinstance(quantize_lm_head("int4", weight), Int8Linear)
    with pytest.raises(ValueError, match="int2"):
        quantize_dense("int2", weight)
    with pytest.raises(ValueError, match="--quantization must be one of auto, none, gguf, int8, int4, w8a8"):
        check_supported("fp8", torch.device("cpu"))
    with pytest.raises(ValueError, match="use --device cpu"):
        check_supported("w8a8", torch.device("cuda"))


def test_auto_computes_on_the_gguf_blocks_only_for_a_gguf_file_on_cpu_under_dtype_auto():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert effective_mode("auto", True, cpu, "auto") == "gguf"
    assert effective_mode("auto", True, cpu, "float32") == "none"  # an explicit fp32 stays exact
    assert effective_mode("auto", False, cpu, "auto") == "none"  # safetensors: fp32 / bf16
    assert effective_mode("auto", True, cuda, "auto") == "none"
    assert effective_mode("w8a8", True, cpu, "float32") == "w8a8"
    with pytest.raises(ValueError, match="not a GGUF file"):
        effective_mode("gguf", False, cpu, "auto")
