"""One PEFT LoRA adapter read from disk and checked against the base model.

PEFT saves `adapter_config.json` (r, lora_alpha, target_modules, use_rslora, ...) and
`adapter_model.safetensors` with, per adapted linear, `...layers.{i}.{self_attn|mlp}.{name}.lora_A.weight`
[r, in] and `lora_B.weight` [out, r]. The delta of a linear is x @ A.T @ B.T * scale, where scale is
lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA. Options this engine does not implement (per-module
ranks, DoRA, biases, extra trained modules, other target linears) are refused with the field's name.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from iterserve.engine.model.loader import ModelConfig
from iterserve.engine.sampling_params import InvalidRequestError

# The linears an adapter can target, grouped as the decoder fuses them (q/k/v, gate/up).
FUSED_TARGETS = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
                 "down": ("down_proj",)}
MODULE_TARGET = {module: target for target, modules in FUSED_TARGETS.items() for module in modules}
MAX_CONFIG_BYTES = 1 << 20
_KEY = re.compile(r"(?:.*\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight")


class LoraError(ValueError):
    """An adapter that cannot be served; the message names the adapter, the field and the fix."""


@dataclass
class LoraAdapter:
    name: str
    path: str
    rank: int
    scale: float
    # (layer, module name e.g. "q_proj") -> (A [r, in], B [out, r]), fp32 on the host
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    @property
    def modules(self) -> set[str]:
        return {module for _, module in self.weights}


def module_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) of each adaptable linear of the base model."""
    hidden, q, kv, inter = (config.hidden_size, config.num_heads * config.head_dim,
                            config.num_kv_heads * config.head_dim, config.intermediate_size)
    return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}


def load_adapter(name: str, path: str | Path, config: ModelConfig, max_rank: int) -> LoraAdapter:
    """Read and check the adapter at path (a directory) for a base model of this config."""
    from safetensors.torch import load_file

    root = Path(path)
    config_file, weights_file = root / "adapter_config.json", root / "adapter_model.safetensors"
    for needed in (config_file, weights_file):
        if not needed.is_file():
            raise LoraError(f"adapter {name!r}: {needed} not found; a LoRA adapter is a directory in PEFT's "
                            "format (adapter_config.json + adapter_model.safetensors)")
    if config_file.stat().st_size > MAX_CONFIG_BYTES:
        raise LoraError(f"adapter {name!r}: {config_file} is over {MAX_CONFIG_BYTES} bytes")
    try:
        raw = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise LoraError(f"adapter {name!r}: {config_file} is not JSON: {exc}") from None
    rank, alpha = raw.get("r"), raw.get("lora_alpha", raw.get("r"))
    if not isinstance(rank, int) or rank < 1:
        raise LoraError(f"adapter {name!r}: adapter_config.json r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise LoraError(f"adapter {name!r}: rank r={rank} exceeds --max-lora-rank {max_rank}; raise --max-lora-rank")
    if not isinstance(alpha, int | float):
        raise LoraError(f"adapter {name!r}: adapter_config.json lora_alpha must be a number, got {alpha!r}")
    for option, allowed in (("rank_pattern", ({}, None)), ("alpha_pattern", ({}, None)), ("use_dora", (False, None)),
                            ("bias", ("none", None)), ("modules_to_save", (None, [])), ("fan_in_fan_out", (False, None))):
        if raw.get(option) not in allowed:
            raise LoraError(f"adapter {name!r}: adapter_config.json {option}={raw.get(option)!r} is not supported "
                            f"(supported: {allowed[0]!r})")
    scale = alpha / math.sqrt(rank) if raw.get("use_rslora") else alpha / rank
    shapes = module_shapes(config)
    tensors = load_file(str(weights_file))
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.fullmatch(key)
        if match is None or match.group(2) not in shapes:
            raise LoraError(f"adapter {name!r}: tensor {key!r} is not a LoRA A/B of q/k/v/o_proj or gate/up/down_proj; "
                            "only those linears can be adapted (target_modules)")
        layer = int(match.group(1))
        if layer >= config.num_layers:
            raise LoraError(f"adapter {name!r}: tensor {key!r} names layer {layer}; the model has {config.num_layers}")
        pairs.setdefault((layer, match.group(2)), {})[match.group(3)] = tensor
    weights = {}
    for (layer, module), pair in pairs.items():
        if set(pair) != {"A", "B"}:
            raise LoraError(f"adapter {name!r}: layer {layer} {module} has lora_{next(iter(pair))} without its pair")
        a, b = pair["A"].float(), pair["B"].float()
        fan_in, fan_out = shapes[module]
        if a.shape != (rank, fan_in) or b.shape != (fan_out, rank):
            raise LoraError(f"adapter {name!r}: layer {layer} {module} has lora_A {tuple(a.shape)} and lora_B "
                            f"{tuple(b.shape)}; this base model needs {(rank, fan_in)} and {(fan_out, rank)} "
                            "(an adapter of another base model?)")
        weights[(layer, module)] = (a, b)
    if not weights:
        raise LoraError(f"adapter {name!r}: {weights_file} holds no LoRA weights")
    return LoraAdapter(name=name, path=str(root), rank=rank, scale=float(scale), weights=weights)


class UnknownAdapterError(InvalidRequestError):
    """A request named an adapter this engine does not serve (the server answers 404)."""
