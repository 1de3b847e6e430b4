"""Mistral: a Llama decoder whose every layer attends through a sliding window (config.json's
`sliding_window`, null for none). llama.cpp writes Mistral GGUFs under the llama architecture and
records no window; a `llama.attention.sliding_window` key, where present, is honoured (the llama
family reads it too).
"""

from __future__ import annotations

from pathlib import Path

from iterserve.engine.model.architectures import Family, gguf_base_config, hf_base_config, register
from iterserve.engine.model.loader import ModelConfig


def hf_config(raw: dict, path: Path) -> ModelConfig:
    config = hf_base_config(raw, path, "mistral")
    window = raw.get("sliding_window")
    config.sliding_window = int(window) if window else None
    return config


def gguf_config(meta: dict, arch: str, path: Path) -> ModelConfig:
    return gguf_base_config(meta, arch, path, "mistral")


FAMILY = register(Family(
    name="mistral",
    hf_architectures=("MistralForCausalLM",),
    hf_model_types=("mistral",),
    gguf_architectures=(),  # llama.cpp writes them as "llama"
    hf_config=hf_config,
    gguf_config=gguf_config,
))
