"""Qwen3: a Llama decoder with a per-head RMSNorm on q and k before rotary (q_norm / k_norm,
[head_dim] weights), no q/k/v bias (unless `attention_bias`), head_dim given separately, and
Qwen's optional sliding window layout (qwen2.py). GGUF arch "qwen3": attn_q_norm / attn_k_norm,
q/k rows not interleaved.
"""

from __future__ import annotations

from pathlib import Path

from iterserve.engine.model.architectures import Family, gguf_base_config, hf_base_config, register
from iterserve.engine.model.loader import ModelConfig
from iterserve.engine.model.qwen2 import sliding_layers


def hf_config(raw: dict, path: Path) -> ModelConfig:
    config = hf_base_config(raw, path, "qwen3")
    config.qk_norm = True
    config.attention_bias = config.attention_out_bias = bool(raw.get("attention_bias", False))
    sliding_layers(raw, config)
    return config


def gguf_config(meta: dict, arch: str, path: Path) -> ModelConfig:
    config = gguf_base_config(meta, arch, path, "qwen3")
    config.qk_norm = True
    return config


FAMILY = register(Family(
    name="qwen3",
    hf_architectures=("Qwen3ForCausalLM",),
    hf_model_types=("qwen3",),
    gguf_architectures=("qwen3",),
    hf_config=hf_config,
    gguf_config=gguf_config,
    gguf_permuted_qk=False,
))
