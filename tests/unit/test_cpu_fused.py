"""The fused C kernels of quantized CPU models (engine/model/cpu_fused.py) against the torch ops
they replace, and the fused decoder against the torch one on a tiny model."""

from __future__ import annotations

import pytest
import torch

from iterserve.engine.attention import AttentionMetadata, get_backend
from iterserve.engine.model import cpu_fused
from iterserve.engine.model.llama import LlamaModel, rotary_cos_sin
from iterserve.engine.model.loader import load_model
from tests.unit import tiny_llama as tiny

pytestmark = pytest.mark.skipif(cpu_fused.load() is None, reason="needs AVX2 and a C compiler")
TORCH = get_backend("torch")


def test_rms_norm_with_and_without_a_residual_matches_torch():
    torch.manual_seed(0)
    x, residual, weight = torch.randn(7, 576) * 3, torch.randn(7, 576), torch.rand(576) + 0.5
    for res in (None, residual):
        got, got_residual = cpu_fused.rms_norm(x, res, weight, 1e-5)
        want, want_residual = TORCH.rms_norm(x, weight, 1e-5, res)
        assert torch.equal(got_residual, want_residual)
        torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)


def test_rotary_and_kv_write_equal_torchs_bit_for_bit_and_skip_negative_slots():
    torch.manual_seed(1)
    heads, kv_heads, dim, rows = 9, 3, 64, 5
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim)
    positions = torch.tensor([0, 7, 300, 5, 9])
    slots = torch.tensor([3, 17, 40, -1, 0])
    cos_sin = rotary_cos_sin(dim, 10000.0, 512)
    k_cache, v_cache = torch.full((4, 16, kv_heads, dim), 50.0), torch.full((4, 16, kv_heads, dim), 50.0)
    query = cpu_fused.rotary_write_kv(qkv, positions, cos_sin, heads, kv_heads, dim, k_cache, v_cache, slots)

    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    want_q, want_k = TORCH.rotary(q.view(rows, heads, dim), k.view(rows, kv_heads, dim), positions, cos_sin)
    assert torch.equal(query, want_q)
    flat_k, flat_v = k_cache.view(-1, kv_heads, dim), v_cache.view(-1, kv_heads, dim)
    written = [0, 1, 2, 4]
    assert torch.equal(flat_k[slots[written]], want_k[written])
    assert torch.equal(flat_v[slots[written]], v.view(rows, kv_heads, dim)[written])
    untouched = torch.ones(64, dtype=torch.bool)
    untouched[slots[written]] = False
    assert (flat_k[untouched] == 50).all() and (flat_v[untouched] == 50).all()


def test_silu_mul_matches_torch():
    torch.manual_seed(2)
    gate_up = torch.randn(6, 2 * 1536) * 6
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])
    torch.testing.assert_close(cpu_fused.silu_mul(gate_up), TORCH.silu_and_mul(gate_up), rtol=2e-6, atol=1e-6)


@torch.inference_mode()
def test_the_fused_decoder_matches_the_torch_decoder_on_a_mixed_batch(tmp_path):
    loaded = load_model(tiny.write_gguf(tmp_path / "tiny.gguf", tiny.hf_weights(seed=3)), show_progress=False)
    model = LlamaModel.from_weights(loaded.config, dict(loaded.weights), TORCH, torch.device("cpu"), torch.float32,
                                    max_positions=tiny.CONTEXT)
    assert not model.fused  # fp32 keeps torch's ops (its exact-parity mode)
    block_size, blocks = 4, 32
    results = []
    for fused in (False, True):
        model.fused = fused
        kv = [(torch.zeros(blocks, block_size, tiny.KV_HEADS, tiny.HEAD_DIM),
               torch.zeros(blocks, block_size, tiny.KV_HEADS, tiny.HEAD_DIM)) for _ in range(tiny.LAYERS)]
        a, b = list(range(40, 73)), [200, 201, 7, 7, 7, 9, 12, 255, 1, 2, 3]
        tables = [list(range(0, 9)), list(range(20, 23))]
        model(torch.tensor(a[:20]), torch.arange(20), kv, AttentionMetadata.build([20], [20], tables[:1], block_size))
        step2 = AttentionMetadata.build([13, len(b)], [33, len(b)], tables, block_size)
        hidden = model(torch.tensor(a[20:] + b), torch.tensor(list(range(20, 33)) + list(range(len(b)))), kv, step2)
        decode = AttentionMetadata.build([1, 1], [34, len(b) + 1], tables, block_size)
        hidden2 = model(torch.tensor([5, 6]), torch.tensor([33, len(b)]), kv, decode)
        results.append((model.compute_logits(hidden), model.compute_logits(hidden2), kv[1][0].clone()))
    for unfused, fused in zip(*results, strict=True):
        torch.testing.assert_close(fused, unfused, rtol=1e-4, atol=1e-4)


def test_quantized_cpu_models_take_the_fused_path(tmp_path):
    loaded = load_model(tiny.write_gguf(tmp_path / "tiny.gguf", tiny.hf_weights(seed=4)), show_progress=False)
    model = LlamaModel.from_weights(loaded.config, dict(loaded.weights), TORCH, torch.device("cpu"), torch.float32,
                                    max_positions=tiny.CONTEXT, quantization="w8a8")
    assert model.fused
