"""The w8a8 linear (engine/model/quant.py): int8 weights x per-row int8 activations."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from iterserve.engine.model.quant import (
    MODES,
    Int4Linear,
    Int8Linear,
    W8A8Linear,
    check_supported,
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
    # Per row: activations rounded to 2/255 of the row's max |x|, weights to 1/63 of the channel's max.
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
    x_big[0] *= 1000  # with fbgemm's per-batch activation scale this would coarsen every other row
    x_big[1] = x_big[1].abs()  # and a batch without negative values would shift the zero point
    assert torch.equal(in_pairs, together)
    assert torch.equal(layer(x_big)[2:], together[2:])
    assert torch.equal(layer(torch.zeros(2, 64)), torch.zeros(2, 96))
    assert torch.equal(layer(torch.zeros(1, 64)), torch.zeros(1, 96))


def test_w8a8_one_row_is_rounded_at_least_as_finely_as_in_a_batch(weight):
    """One row goes to fbgemm unscaled (its own [min, max] range): no worse than the batched path."""
    layer = W8A8Linear(weight)
    torch.manual_seed(1)
    x = torch.randn(64, 64) + 0.5  # mostly positive rows: fbgemm's own range is much narrower than +-max
    reference = F.linear(x, weight)
    alone = torch.cat([layer(x[i:i + 1]) for i in range(64)])
    batched = layer(x)
    assert not torch.equal(alone, batched)  # the one-row path is really taken
    err_alone, err_batched = (alone - reference).abs().mean(), (batched - reference).abs().mean()
    assert err_alone <= err_batched, (err_alone, err_batched)
    assert layer(x[:1] * 1e4).sub(F.linear(x[:1] * 1e4, weight)).abs().max() < 0.03 * 1e4 * x[0].abs().max() * \
        weight.abs().sum(dim=1).max()


def test_modes_build_their_linears_and_refuse_unknown_ones(weight):
    assert set(MODES) == {"none", "int8", "int4", "w8a8"}
    assert isinstance(quantize_dense("int8", weight), Int8Linear)
    assert isinstance(quantize_dense("int4", weight), Int4Linear)
    assert isinstance(quantize_dense("w8a8", weight), W8A8Linear)
    assert isinstance(quantize_lm_head("w8a8", weight), W8A8Linear)
    assert isinstance(quantize_lm_head("int4", weight), Int8Linear)
    with pytest.raises(ValueError, match="int2"):
        quantize_dense("int2", weight)
    with pytest.raises(ValueError, match="--quantization must be one of none, int8, int4, w8a8"):
        check_supported("fp8", torch.device("cpu"))
    with pytest.raises(ValueError, match="use --device cpu"):
        check_supported("w8a8", torch.device("cuda"))
