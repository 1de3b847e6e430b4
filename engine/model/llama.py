"""Llama (1/2/3.x, SmolLM, and Mistral checkpoints converted under the llama name): the reference
family. It is the plain DecoderModel (decoder.py); config.json adds rope scaling (llama3, linear,
dynamic, yarn: rope.py), `attention_bias` (q/k/v/o biases), `mlp_bias` and a separate `head_dim`.
A GGUF carries Llama 3's rope scaling as llama.cpp's rope_freqs tensor (read by the loader).
"""

from __future__ import annotations

from pathlib import Path

from iterserve.engine.model.architectures import Family, gguf_base_config, hf_base_config, register
from iterserve.engine.model.decoder import DecoderLayer, DecoderModel
from iterserve.engine.model.layers import SMALL_ROWS, Weight, linear
from iterserve.engine.model.loader import ModelConfig
from iterserve.engine.model.rope import rotary_cos_sin

LlamaModel = DecoderModel  # the name the engine's other modules and tests know it by

__all__ = ["SMALL_ROWS", "DecoderLayer", "LlamaModel", "Weight", "linear", "rotary_cos_sin"]


def hf_config(raw: dict, path: Path) -> ModelConfig:
    config = hf_base_config(raw, path, "llama")
    config.attention_bias = config.attention_out_bias = bool(raw.get("attention_bias", False))
    config.mlp_bias = bool(raw.get("mlp_bias", False))
    return config


def gguf_config(meta: dict, arch: str, path: Path) -> ModelConfig:
    return gguf_base_config(meta, arch, path, "llama")


FAMILY = register(Family(
    name="llama",
    hf_architectures=("LlamaForCausalLM",),
    hf_model_types=("llama",),
    gguf_architectures=("llama",),
    hf_config=hf_config,
    gguf_config=gguf_config,
))
