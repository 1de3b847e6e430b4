"""--quantization int8 / int4 / w8a8 against exact fp32 on the embedded SmolLM2-135M and the parity prompts.

Teacher-forced: each prompt plus fp32's 28 greedy tokens goes through every model in one prefill;
at each of those positions we compare the argmax (greedy agreement) and the logits (max |error|).
Both the one-row path (as in a decode step) and the many-row path (as in a prefill or a full
batch) are checked, since int8/int4 linears pick a kernel by their row count (w8a8 quantizes each
row on its own scale, so its two paths differ only by attention's rounding).
"""

from __future__ import annotations

import pytest
import torch

from iterserve.engine.attention.backend import AttentionMetadata, get_backend
from iterserve.engine.model.llama import LlamaModel
from iterserve.engine.model.loader import load_model
from iterserve.engine.model.quant import Int4Linear, Int8Linear, W8A8Linear, int4_from_dense
from iterserve.engine.model.registry import resolve_model_path
from iterserve.engine.model.tokenizer import Tokenizer

from .test_hf_parity import CHATS, MAX_NEW_TOKENS, RAW_PROMPTS

# Floors under what was measured on this machine (2026-12-01, the full test: 10 prompts x 28 tokens
# x 2 paths = 560 positions): int8 546/560 (0.975), max logit error 2.26; int4 550/560 (0.982), 1.07;
# w8a8 496/560 (0.886), 11.72 (activation rounding is most of that; with 7-bit activations: 0.755 /
# 18.6). The fp32 reference runs the dequantized Q4_1 weights, so int4 (the same blocks) is closest.
MIN_AGREEMENT = {"int8": 0.95, "int4": 0.95, "w8a8": 0.85}
MAX_LOGIT_ERROR = {"int8": 4.0, "int4": 2.5, "w8a8": 15.0}


def test_int8_and_int4_linears_match_their_dequantized_weights():
    torch.manual_seed(0)
    weight = torch.randn(96, 64)
    for layer in (Int8Linear(weight, dense_above=4), int4_from_dense(weight, dense_above=4)):
        # The quantized weight is close to the original...
        assert (layer.dense - weight).abs().max() < (0.02 if isinstance(layer, Int8Linear) else 0.3)
        # ...and the kernel path (2 rows) and the dense path (8 rows) compute the same product.
        x = torch.randn(8, 64)
        dense = torch.nn.functional.linear(x, layer.dense)
        kernel = torch.cat([layer(x[i:i + 2]) for i in range(0, 8, 2)])
        assert torch.allclose(layer(x), dense, atol=1e-4)  # 8 rows: W @ x.T, same products, other order
        assert (kernel - dense).abs().max() < 0.05 * dense.abs().max(), type(layer).__name__
    q = torch.randint(0, 16, (16, 64), dtype=torch.uint8)  # the kernel wants rows in multiples of 16
    d, m = torch.rand(16, 2) / 10, -torch.rand(16, 2)
    expected = q.float().view(16, 2, 32) * d[..., None] + m[..., None]
    assert torch.allclose(Int4Linear(q, d, m).dense, expected.view(16, 64), atol=1e-2)


def _logits(model: LlamaModel, tokens: list[int], rows_per_call: int | None) -> torch.Tensor:
    """Logits at every position of one sequence, fed in chunks of rows_per_call tokens (None: one)."""
    block_size, cfg = 16, model.config
    blocks = -(-len(tokens) // block_size)
    caches = [(torch.zeros(blocks, block_size, cfg.num_kv_heads, cfg.head_dim),
               torch.zeros(blocks, block_size, cfg.num_kv_heads, cfg.head_dim)) for _ in range(cfg.num_layers)]
    out, step = [], rows_per_call or len(tokens)
    for start in range(0, len(tokens), step):
        end = min(start + step, len(tokens))
        meta = AttentionMetadata.build([end - start], [end], [list(range(blocks))], block_size)
        hidden = model(torch.tensor(tokens[start:end]), torch.arange(start, end), caches, meta)
        out.append(model.compute_logits(hidden))
    return torch.cat(out)


def _greedy(model: LlamaModel, prompt: list[int], new_tokens: int) -> list[int]:
    """Greedy continuation with a KV cache: one prefill, then one token per step."""
    block_size, cfg = 16, model.config
    blocks = -(-(len(prompt) + new_tokens) // block_size)
    caches = [(torch.zeros(blocks, block_size, cfg.num_kv_heads, cfg.head_dim),
               torch.zeros(blocks, block_size, cfg.num_kv_heads, cfg.head_dim)) for _ in range(cfg.num_layers)]
    tokens, fed = list(prompt), 0
    while len(tokens) < len(prompt) + new_tokens:
        meta = AttentionMetadata.build([len(tokens) - fed], [len(tokens)], [list(range(blocks))], block_size)
        hidden = model(torch.tensor(tokens[fed:]), torch.arange(fed, len(tokens)), caches, meta)
        fed = len(tokens)
        tokens.append(int(model.compute_logits(hidden[-1:])[0].argmax()))
    return tokens


@pytest.fixture(scope="module")
def models():
    torch.set_num_threads(1)
    path = resolve_model_path(None)[0]
    loaded = load_model(path, show_progress=False, keep_q4_1=True)  # once: from_weights only pops
    built = {mode: LlamaModel.from_weights(loaded.config, dict(loaded.weights), get_backend("torch"),
                                           torch.device("cpu"), torch.float32, max_positions=512,
                                           quantization=mode, q4_1=dict(loaded.q4_1))
             for mode in ("none", *MIN_AGREEMENT)}
    tokenizer = Tokenizer.from_gguf(path)
    return built, RAW_PROMPTS + [tokenizer.apply_chat_template(c) for c in CHATS], tokenizer


@pytest.mark.slow
@torch.inference_mode()
def test_quantized_models_agree_with_fp32_on_the_parity_prompts(models):
    built, prompts, tokenizer = models
    reference = built["none"]
    assert isinstance(built["int4"].layers[0].qkv_proj, Int4Linear)  # the file's own Q4_1 blocks
    assert isinstance(built["w8a8"].layers[0].down_proj, W8A8Linear) and isinstance(built["w8a8"].lm_head, W8A8Linear)
    stats = {mode: {"agree": 0, "total": 0, "max_logit_error": 0.0} for mode in MIN_AGREEMENT}
    for prompt in prompts:
        tokens = _greedy(reference, tokenizer.encode(prompt), MAX_NEW_TOKENS)
        n = len(tokens) - MAX_NEW_TOKENS - 1
        ref = _logits(reference, tokens, None)[n:-1]
        for mode, s in stats.items():
            for rows in (None, 1):  # one dense prefill; one row per call (the kernel path)
                got = _logits(built[mode], tokens, rows)[n:-1]
                s["agree"] += int((got.argmax(-1) == ref.argmax(-1)).sum())
                s["total"] += ref.shape[0]
                s["max_logit_error"] = max(s["max_logit_error"], float((got - ref).abs().max()))
    for mode, s in stats.items():
        agreement = s["agree"] / s["total"]
        print(f"{mode}: greedy agreement {agreement:.3f} ({s['agree']}/{s['total']}), "
              f"max logit error {s['max_logit_error']:.2f}")
        assert agreement >= MIN_AGREEMENT[mode], (mode, agreement)
        assert s["max_logit_error"] <= MAX_LOGIT_ERROR[mode], (mode, s["max_logit_error"])
