"""Triton fused ops (residual-add + RMSNorm, rotary, SiLU-and-mul) against the torch reference
backend, run on CPU through the Triton interpreter."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton

import pytest  # noqa: E402
import torch  # noqa: E402

from iterserve.engine.attention.torch_backend import TorchBackend  # noqa: E402
from iterserve.engine.attention.triton_backend import TritonBackend  # noqa: E402

ATOL = 1e-5
REFERENCE = TorchBackend()
TRITON = TritonBackend()


def max_error(got: torch.Tensor, want: torch.Tensor) -> float:
    assert got.shape == want.shape and got.dtype == want.dtype
    return (got - want).abs().max().item()


def rope_cache(head_dim: int, max_position: int, base: float = 10000.0) -> torch.Tensor:
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.outer(torch.arange(max_position).float(), inv_freq)
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


@pytest.mark.parametrize("shape", [(1, 64), (7, 96), (33, 576), (2, 3, 64)])
@pytest.mark.parametrize("with_residual", [True, False])
def test_rms_norm_matches_reference(shape, with_residual):
    gen = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=gen) * 3
    weight = torch.randn(shape[-1], generator=gen)
    residual = torch.randn(shape, generator=gen) if with_residual else None
    want_out, want_sum = REFERENCE.rms_norm(x, weight, 1e-6, residual)
    got_out, got_sum = TRITON.rms_norm(x, weight, 1e-6, residual)
    assert max_error(got_out, want_out) < ATOL
    assert torch.equal(got_sum, want_sum)


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(4, 4, 64), (6, 2, 128), (9, 3, 64)])
def test_rotary_matches_reference(num_heads, num_kv_heads, head_dim):
    gen = torch.Generator().manual_seed(head_dim + num_heads)
    tokens = 11
    # Query and key as strided views into one fused projection, as the model produces them.
    qkv = torch.randn(tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen)
    query = qkv[:, : num_heads * head_dim].view(tokens, num_heads, head_dim)
    key = qkv[:, num_heads * head_dim: (num_heads + num_kv_heads) * head_dim].view(tokens, num_kv_heads, head_dim)
    positions = torch.tensor([0, 1, 2, 7, 8, 9, 100, 101, 511, 3, 3])
    cos_sin = rope_cache(head_dim, 512)
    want_q, want_k = REFERENCE.rotary(query, key, positions, cos_sin)
    got_q, got_k = TRITON.rotary(query, key, positions, cos_sin)
    assert max_error(got_q, want_q) < ATOL
    assert max_error(got_k, want_k) < ATOL


@pytest.mark.parametrize("shape", [(1, 2 * 100), (5, 2 * 1536), (2, 3, 2 * 64)])
def test_silu_and_mul_matches_reference(shape):
    gate_up = torch.randn(shape, generator=torch.Generator().manual_seed(shape[-1])) * 4
    want = REFERENCE.silu_and_mul(gate_up)
    got = TRITON.silu_and_mul(gate_up)
    assert max_error(got, want) < ATOL


def test_bad_op_inputs_are_rejected():
    x = torch.randn(3, 64)
    with pytest.raises(ValueError, match=r"weight has shape \(32,\)"):
        TRITON.rms_norm(x, torch.ones(32), 1e-6)
    with pytest.raises(ValueError, match="residual has dtype torch.float64"):
        TRITON.rms_norm(x, torch.ones(64), 1e-6, torch.randn(3, 64, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"residual has shape \(2, 64\)"):
        TRITON.rms_norm(x, torch.ones(64), 1e-6, torch.randn(2, 64))
    query, key = torch.randn(3, 4, 64), torch.randn(3, 2, 64)
    with pytest.raises(ValueError, match="cos_sin has shape"):
        TRITON.rotary(query, key, torch.arange(3), rope_cache(32, 16))
    with pytest.raises(ValueError, match="positions must be"):
        TRITON.rotary(query, key, torch.arange(4), rope_cache(64, 16))
    with pytest.raises(ValueError, match=r"positions range over \[0, 16\] but cos_sin covers positions 0..15"):
        TRITON.rotary(query, key, torch.tensor([0, 16, 2]), rope_cache(64, 16))
    with pytest.raises(ValueError, match="key has shape"):
        TRITON.rotary(query, torch.randn(3, 2, 32), torch.arange(3), rope_cache(64, 16))
    with pytest.raises(ValueError, match="last dim must be even"):
        TRITON.silu_and_mul(torch.randn(2, 7))
    with pytest.raises(ValueError, match="gate_up has dtype torch.bfloat16"):
        TRITON.silu_and_mul(torch.randn(2, 8, dtype=torch.bfloat16))
