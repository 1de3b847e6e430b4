"""The --quantization default: a GGUF model on a CPU computes on the file's own blocks (`auto`, measured at
least as accurate as llama.cpp by bench/kernels/gguf_accuracy.py), and `none` stays the exact model."""

from __future__ import annotations

import pytest
import torch

from iterserve.engine.config import EngineConfig
from iterserve.engine.model import cpu_gguf
from iterserve.engine.model.quant import GGUFLinear

pytestmark = pytest.mark.skipif(cpu_gguf.load() is None, reason="needs AVX2 and a C compiler")


def test_the_embedded_gguf_runs_its_own_blocks_by_default_and_none_stays_the_exact_model():
    from iterserve.engine.llm import LLM, SamplingParams

    assert EngineConfig().quantization == "auto"
    options = dict(device="cpu", max_model_len=128, num_kv_blocks=32)
    default = LLM(**options).engine.executor  # no --quantization, no --dtype: what `iterserve serve` runs
    assert default.quantization == "gguf" and default.dtype == torch.float32
    assert isinstance(default.model.layers[0].gate_up_proj, GGUFLinear)
    assert isinstance(default.model.lm_head, GGUFLinear) and isinstance(default.model.embed_tokens, cpu_gguf.BlockRows)

    exact_llm = LLM(quantization="none", dtype="float32", **options)
    exact = exact_llm.engine.executor
    assert exact.quantization == "none" and not exact.model.fused  # torch's own ops, as the parity tests run
    layer, blocks = exact.model.layers[0], default.model.layers[0]
    # none multiplies by the file's weights dequantized (gguf's own arithmetic), bit for bit
    assert isinstance(layer.gate_up_proj, torch.Tensor) and torch.equal(layer.gate_up_proj, blocks.gate_up_proj.dense)
    assert torch.equal(exact.model.lm_head, default.model.lm_head.dense)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    text = exact_llm.generate(["The capital of France is"], params, use_tqdm=False)[0].outputs[0].text
    assert "Paris" in text


def test_a_sharded_gguf_model_runs_the_dense_model_under_the_default():
    """Tensor parallelism shards dense weights only: under the default the ranks run `none`, and their
    tokens equal the exact model's on one rank."""
    from iterserve.engine.llm import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = ["The capital of France is", "def add(a, b):"]
    options = dict(device="cpu", attention_backend="torch", num_kv_blocks=24, max_model_len=128)
    sharded = LLM(tensor_parallel_size=3, **options)  # SmolLM2: 9 heads, 3 KV heads
    try:
        got = [o.outputs[0].token_ids for o in sharded.generate(prompts, params, use_tqdm=False)]
    finally:
        sharded.engine.close()
    exact = LLM(quantization="none", dtype="float32", **options)
    assert got == [o.outputs[0].token_ids for o in exact.generate(prompts, params, use_tqdm=False)]
