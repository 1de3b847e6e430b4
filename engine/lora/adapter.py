"""One PEFT LoRA adapter read from disk and checked against the base model.

PEFT saves `adapter_config.json` (r, lora_alpha, target_modules, use_rslora, ...) and
`adapter_model.safetensors` with, per adapted linear, `...layers.{i}.{self_attn|mlp}.{name}.lora_A.weight`
[r, in] and `lora_B.weight` [out, r]. The delta of a linear is x @ A.T @ B.T * scale, where scale is
lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA. Options this engine does not implement (per-module
ranks, DoRA, biases, extra trained modules, other target linears) are refused with the field's name.

The linears are the family's own (module_shapes): q/k/v/o_proj and gate/up/down_proj, except Phi-3,
whose checkpoints fuse them, so PEFT targets qkv_proj and gate_up_proj there (one A, one B over the
fused output). A mixture-of-experts layer's experts and router are refused by name (its attention
and any dense layer's MLP are served); a multimodal checkpoint's vision-tower LoRA is ignored (the
engine serves the text model). Under tensor parallelism each rank keeps its part (shard_adapter).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from iterserve.engine.model.loader import ModelConfig
from iterserve.engine.sampling_params import InvalidRequestError

# The linears an adapter can target, grouped as the decoder fuses them (q/k/v, gate/up).
FUSED_TARGETS = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
                 "down": ("down_proj",)}
# A checkpoint's own fused linears (Phi-3): one A and one B over the decoder's fused output.
FUSED_MODULES = {"qkv_proj": "qkv", "gate_up_proj": "gate_up"}
MODULE_TARGET = {**{module: target for target, modules in FUSED_TARGETS.items() for module in modules},
                 **FUSED_MODULES}
MLP_MODULES = ("gate_proj", "up_proj", "down_proj", "gate_up_proj")
FUSED_FAMILIES = ("phi3",)  # families whose checkpoints (hence PEFT adapters) have qkv_proj and gate_up_proj
MAX_CONFIG_BYTES = 1 << 20
_KEY = re.compile(r"(?:.*\.)?layers\.(\d+)\.([\w.]+?)\.lora_([AB])(?:\.\w+)?\.weight")
_IGNORED = ("vision_tower.", "vision_model.", "multi_modal_projector.")  # a multimodal checkpoint's non-text parts


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


def linear_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) of each of the decoder's linears, q/k/v and gate/up apart."""
    hidden, q, kv, inter = (config.hidden_size, config.num_heads * config.head_dim,
                            config.num_kv_heads * config.head_dim, config.intermediate_size)
    return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}


def module_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) of each linear an adapter of this family names (PEFT's target_modules)."""
    shapes = linear_shapes(config)
    if config.architecture not in FUSED_FAMILIES:
        return shapes
    (hidden, q), (_, kv), (_, inter) = shapes["q_proj"], shapes["k_proj"], shapes["gate_proj"]
    return {"qkv_proj": (hidden, q + 2 * kv), "o_proj": shapes["o_proj"], "gate_up_proj": (hidden, 2 * inter),
            "down_proj": shapes["down_proj"]}


def _supported(config: ModelConfig) -> str:
    names = ", ".join(module_shapes(config))
    if config.moe is not None:
        return f"{names} (the MLP ones on dense layers only)"
    return names


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
    if raw.get("target_parameters"):  # peft's LoRA on parameters: a mixture-of-experts model's fused experts
        raise LoraError(f"adapter {name!r}: adapter_config.json target_parameters={raw['target_parameters']!r}: LoRA on "
                        f"parameters (the experts of a mixture-of-experts model) is not supported; adaptable on "
                        f"{config.architecture}: {_supported(config)} (target_modules)")
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
        if any(part in key for part in _IGNORED):
            continue
        match = _KEY.fullmatch(key)
        block, _, module = match.group(2).rpartition(".") if match else ("", "", "")
        if match is None or block not in ("self_attn", "mlp") or module not in shapes:
            path = match.group(2) if match else key
            if config.moe is not None and match is not None and path.startswith("mlp."):
                raise LoraError(f"adapter {name!r}: tensor {key!r} adapts {path}, part of a mixture-of-experts "
                                f"block; LoRA on experts and routers is not supported. Adaptable here: "
                                f"{_supported(config)} (target_modules)")
            raise LoraError(f"adapter {name!r}: tensor {key!r} is not a LoRA A/B of a linear this engine adapts; "
                            f"adaptable on {config.architecture}: {_supported(config)} (target_modules)")
        layer = int(match.group(1))
        if layer >= config.num_layers:
            raise LoraError(f"adapter {name!r}: tensor {key!r} names layer {layer}; the model has {config.num_layers}")
        if config.moe is not None and module in MLP_MODULES and config.moe.sparse_layers[layer]:
            raise LoraError(f"adapter {name!r}: tensor {key!r} adapts mlp.{module} of layer {layer}, a "
                            f"mixture-of-experts layer; LoRA on experts is not supported. Adaptable here: "
                            f"{_supported(config)} (target_modules)")
        pairs.setdefault((layer, module), {})[match.group(3)] = tensor
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


def shard_adapter(adapter: LoraAdapter, config: ModelConfig, shard) -> LoraAdapter:
    """This tensor-parallel rank's part of the adapter (engine/model/parallel.py's Shard of the model
    of this config), split as the base linears are: a column-parallel linear (q/k/v, gate/up) keeps
    the rows of B of its output rows (and all of A); a row-parallel one (o, down) the columns of A of
    its input columns (and all of B), so the ranks' partial deltas sum to the whole one in the
    layer's all-reduce."""
    from iterserve.engine.model.parallel import shard_rows

    q_rows, kv_rows, mlp_rows = shard_rows(config, shard)
    shapes = linear_shapes(config)
    q, kv, inter = shapes["q_proj"][1], shapes["k_proj"][1], shapes["gate_proj"][1]

    def moved(rows: slice, offset: int) -> slice:
        return slice(rows.start + offset, rows.stop + offset)

    out_rows = {"q_proj": [q_rows], "k_proj": [kv_rows], "v_proj": [kv_rows], "gate_proj": [mlp_rows],
                "up_proj": [mlp_rows], "qkv_proj": [q_rows, moved(kv_rows, q), moved(kv_rows, q + kv)],
                "gate_up_proj": [mlp_rows, moved(mlp_rows, inter)]}
    in_columns = {"o_proj": q_rows, "down_proj": mlp_rows}
    weights = {}
    for (layer, module), (a, b) in adapter.weights.items():
        if module in in_columns:
            a = a[:, in_columns[module]].contiguous()
        else:
            b = torch.cat([b[rows] for rows in out_rows[module]]).contiguous()
        weights[(layer, module)] = (a, b)
    return replace(adapter, weights=weights)


class UnknownAdapterError(InvalidRequestError):
    """A request named an adapter this engine does not serve (the server answers 404)."""
