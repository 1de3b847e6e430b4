"""Qwen2 / Qwen2.5: a Llama decoder with q/k/v biases (no o_proj bias), usually an untied lm_head,
and an optional sliding window (`use_sliding_window`) on the layers from `max_window_layers` on, as
transformers' Qwen2Config lays them out (or config.json's own `layer_types`). In a GGUF (llama.cpp
arch "qwen2") q/k rows are not interleaved: llama.cpp runs Qwen's rotary in the NeoX form.
"""

from __future__ import annotations

from pathlib import Path

from iterserve.engine.model.architectures import (
    Family,
    gguf_base_config,
    hf_base_config,
    hf_layer_types,
    register,
)
from iterserve.engine.model.loader import ModelConfig


def sliding_layers(raw: dict, config: ModelConfig) -> None:
    """Qwen's window options onto config: the window only with use_sliding_window, on layers
    max_window_layers.. unless config.json lists layer_types."""
    window = raw.get("sliding_window") if raw.get("use_sliding_window") else None
    config.sliding_window = int(window) if window else None
    types = hf_layer_types(raw, config.num_layers)
    if types is None and config.sliding_window is not None:
        first = int(raw.get("max_window_layers", 28))
        types = tuple("sliding_attention" if i >= first else "full_attention" for i in range(config.num_layers))
    config.layer_types = types


def hf_config(raw: dict, path: Path) -> ModelConfig:
    config = hf_base_config(raw, path, "qwen2")
    config.attention_bias = True
    sliding_layers(raw, config)
    return config


def gguf_config(meta: dict, arch: str, path: Path) -> ModelConfig:
    config = gguf_base_config(meta, arch, path, "qwen2")
    config.attention_bias = True
    return config


FAMILY = register(Family(
    name="qwen2",
    hf_architectures=("Qwen2ForCausalLM",),
    hf_model_types=("qwen2",),
    gguf_architectures=("qwen2",),
    hf_config=hf_config,
    gguf_config=gguf_config,
    gguf_permuted_qk=False,
))
