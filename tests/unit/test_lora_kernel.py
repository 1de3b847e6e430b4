"""The batched LoRA op: the Triton kernel (on the interpreter) and the CPU torch path against the
per-row reference, with odd ranks, segments that start and end mid-tile, base rows between
segments and one adapter in two separate runs."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton

import pytest  # noqa: E402
import torch  # noqa: E402

from iterserve.engine.kernels import lora  # noqa: E402


def pool(gen, slots, k, rank, n):
    a = torch.randn(slots, k, rank, generator=gen)
    b = torch.randn(slots, rank, n, generator=gen)
    return a, b, torch.rand(slots, generator=gen) + 0.5


def test_segments_are_runs_of_one_adapter_and_skip_base_rows():
    assert lora.segments_of([-1, 0, 0, 2, -1, 0, 1, 1]) == ([1, 3, 5, 6], [2, 1, 1, 2], [0, 2, 0, 1])
    assert lora.segments_of([-1, -1]) == ([], [], [])


@pytest.mark.parametrize("rank,k,n,row_slots", [
    (7, 40, 33, [0] * 5 + [-1] * 3 + [2] * 19 + [1] * 1 + [0] * 17),  # odd rank, tiles cut mid-segment
    (1, 64, 128, [1, 1, -1, 0]),
    (13, 96, 200, [2] * 40 + [-1] * 2),  # a segment over three row tiles, N over two column blocks
])
@pytest.mark.parametrize("path", ["triton", "torch"])
def test_lora_add_matches_the_reference(path, rank, k, n, row_slots):
    gen = torch.Generator().manual_seed(rank)
    a, b, scales = pool(gen, 3, k, rank, n)
    x = torch.randn(len(row_slots), k, generator=gen)
    base = torch.randn(len(row_slots), n, generator=gen)
    segments = lora.segments_of(row_slots)
    expected = lora.lora_add_reference(base.clone(), x, a, b, scales, segments)
    fn = lora.lora_add_triton if path == "triton" else lora.lora_add_torch
    got = fn(base.clone(), x, a, b, scales, segments)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    base_rows = [i for i, s in enumerate(row_slots) if s < 0]
    assert torch.equal(got[base_rows], base[base_rows])  # the base model's rows are untouched
