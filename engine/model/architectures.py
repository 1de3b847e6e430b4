"""The architecture registry: which model families this engine runs and how each is read.

A family is one small module under engine/model/ (llama.py, mistral.py, qwen2.py, qwen3.py, ...)
that builds a `Family` and calls `register()` at import. A Family says how it is recognised
(config.json's `architectures` / `model_type`, GGUF's `general.architecture`), how its config
becomes a ModelConfig (from config.json and from GGUF metadata), how its tensor names map onto
the HF Llama names the decoder reads (llama.cpp's names, and an optional rewrite of the HF
checkpoint's, e.g. a fused qkv split in three), which tensors each layer must have, and the model
class (DecoderModel, or a subclass for other layer wiring).

In: a config.json dict or GGUF metadata. Out: the Family that runs it, or a one-line
ModelLoadError naming the architecture and listing the supported ones.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from iterserve.engine.model.loader import ModelConfig, ModelLoadError
from iterserve.engine.model.rope import check_rope

# The family modules, imported on the first lookup (each registers itself).
FAMILY_MODULES = ["llama", "mistral", "qwen2", "qwen3", "gemma", "phi3", "qwen3_moe"]

# llama.cpp's per-layer tensor names (blk.N.<name>.weight / .bias) -> HF names under model.layers.N.
GGUF_LAYER_NAMES: Mapping[str, str] = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
GGUF_GLOBAL_NAMES: Mapping[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    # LongRoPE's factors (Phi-3), read into the rope parameters by that family
    "rope_factors_long.weight": "rope.long_factor",
    "rope_factors_short.weight": "rope.short_factor",
}


def default_layer_weights(config: ModelConfig) -> list[str]:
    """The tensors (names under model.layers.N.) every layer of a Llama-style decoder must have."""
    names = ["input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.o_proj.weight",
             *(f"self_attn.{p}_proj.weight" for p in "qkv"), *(f"mlp.{p}_proj.weight" for p in ("gate", "up", "down"))]
    if config.attention_bias:
        names += [f"self_attn.{p}_proj.bias" for p in "qkv"]
    if config.attention_out_bias:
        names.append("self_attn.o_proj.bias")
    if config.mlp_bias:
        names += [f"mlp.{p}_proj.bias" for p in ("gate", "up", "down")]
    if config.qk_norm:
        names += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
    return names


@dataclass(frozen=True)
class Family:
    name: str  # ModelConfig.architecture, and the name docs/models.md uses
    hf_architectures: tuple[str, ...]  # config.json "architectures", e.g. ("LlamaForCausalLM",)
    hf_model_types: tuple[str, ...]  # config.json "model_type", e.g. ("llama",)
    gguf_architectures: tuple[str, ...]  # GGUF general.architecture, e.g. ("llama",)
    hf_config: Callable[[dict, Path], ModelConfig]  # config.json -> ModelConfig
    gguf_config: Callable[[dict, str, Path], ModelConfig]  # (metadata, general.architecture, path) -> ModelConfig
    model_class: type | None = None  # None: DecoderModel
    gguf_layer_names: Mapping[str, str] = field(default_factory=lambda: dict(GGUF_LAYER_NAMES))
    # llama.cpp's convert interleaves q/k rows (and biases) for its rotary only for the llama arch
    gguf_permuted_qk: bool = True
    layer_weights: Callable[[ModelConfig], list[str]] = default_layer_weights
    # In-place rewrite of the loaded tensors onto the decoder's names (e.g. Phi-3's fused qkv split),
    # after every tensor is read, for HF and GGUF alike.
    adapt_weights: Callable[[dict[str, torch.Tensor], ModelConfig], None] | None = None

    def model_cls(self) -> type:
        if self.model_class is not None:
            return self.model_class
        from iterserve.engine.model.decoder import DecoderModel

        return DecoderModel


_FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    _FAMILIES[family.name] = family
    return family


def families() -> dict[str, Family]:
    for module in FAMILY_MODULES:
        importlib.import_module(f"iterserve.engine.model.{module}")
    return _FAMILIES


def get(name: str) -> Family:
    return families()[name]


def supported_list() -> str:
    return ", ".join(f"{f.name} ({'/'.join(f.hf_architectures)})" for f in families().values())


def for_hf_config(raw: dict, path: Path) -> Family:
    """The family of a config.json: by its `model_type` (what transformers' AutoConfig reads), or by
    its `architectures` where it has no model_type."""
    names = raw.get("architectures") or []
    model_type = raw.get("model_type")
    for family in families().values():
        if model_type in family.hf_model_types if model_type else any(n in family.hf_architectures for n in names):
            return family
    shown = "/".join(names) or model_type
    raise ModelLoadError(f"{path}: architecture {shown!r} (model_type {model_type!r}) is not supported; "
                         f"supported: {supported_list()}")


def for_gguf(arch: str | None, path: Path) -> Family:
    for family in families().values():
        if arch in family.gguf_architectures:
            return family
    names = ", ".join(a for f in families().values() for a in f.gguf_architectures)
    raise ModelLoadError(f"{path}: GGUF architecture {arch!r} is not supported; supported: {names}")


# -- config parsing shared by the families ------------------------------------------------------


def hf_rope(raw: dict, path: Path) -> tuple[float, dict | None]:
    """(rope_theta, the scaling parameters or None) from config.json's rope_parameters / rope_scaling,
    as transformers standardises them (original_max_position_embeddings filled where a type needs it)."""
    rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    partial = rope.pop("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise ModelLoadError(f"{path / 'config.json'}: partial_rotary_factor {partial} is not supported; "
                             "the rotary embedding covers the whole head (1.0)")
    theta = float(rope.pop("rope_theta", raw.get("rope_theta", 10000.0)))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind in (None, "default"):
        return theta, None
    rope["rope_type"] = kind
    if kind in ("llama3", "yarn", "longrope", "su"):
        if raw.get("original_max_position_embeddings"):
            rope["original_max_position_embeddings"] = raw["original_max_position_embeddings"]
        rope.setdefault("original_max_position_embeddings", raw.get("max_position_embeddings", 2048))
    check_rope(rope, str(path / "config.json"))
    return theta, rope


def hf_base_config(raw: dict, path: Path, architecture: str) -> ModelConfig:
    """The fields every family shares, from config.json; a missing required key names itself."""
    try:
        hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
        theta, rope = hf_rope(raw, path)
        config = ModelConfig(
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            rope_theta=theta,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            name=path.name,
            architecture=architecture,
            rope_scaling=rope,
            hidden_act=str(raw.get("hidden_act") or raw.get("hidden_activation") or "silu"),
        )
    except KeyError as exc:
        raise ModelLoadError(f"{path / 'config.json'} lacks {exc.args[0]!r}") from exc
    check_activation(config, path / "config.json")
    return config


def hf_layer_types(raw: dict, num_layers: int) -> tuple[str, ...] | None:
    types = raw.get("layer_types")
    if types is None:
        return None
    if len(types) != num_layers:
        raise ModelLoadError(f"config.json layer_types has {len(types)} entries for {num_layers} layers")
    return tuple(str(t) for t in types)


def check_activation(config: ModelConfig, where: Path) -> None:
    from iterserve.engine.model.layers import SUPPORTED_ACTIVATIONS

    if config.hidden_act not in SUPPORTED_ACTIVATIONS:
        raise ModelLoadError(f"{where}: hidden_act {config.hidden_act!r} is not supported; supported: "
                             f"{', '.join(SUPPORTED_ACTIVATIONS)}")


_GGUF_ROPE_TYPES = {"linear": "linear", "yarn": "yarn"}


def gguf_base_config(meta: dict, arch: str, path: Path, architecture: str) -> ModelConfig:
    """The shared fields from GGUF metadata under `<general.architecture>.` (llama.cpp's keys)."""
    def get(key: str, default=None):
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise ModelLoadError(f"{path}: GGUF metadata {arch}.{key} is missing")
        return value

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens", ())) or 0
    scaling = meta.get(f"{arch}.rope.scaling.type") or "none"
    rope = None
    if scaling != "none":
        if scaling not in _GGUF_ROPE_TYPES:
            raise ModelLoadError(f"{path}: GGUF rope scaling type {scaling!r} is not supported; "
                                 f"supported: none, {', '.join(_GGUF_ROPE_TYPES)}")
        rope = {"rope_type": _GGUF_ROPE_TYPES[scaling], "factor": float(get("rope.scaling.factor"))}
        original = meta.get(f"{arch}.rope.scaling.original_context_length")
        if original:
            rope["original_max_position_embeddings"] = int(original)
    window = meta.get(f"{arch}.attention.sliding_window")
    return ModelConfig(
        vocab_size=int(vocab),  # filled from token_embd when the file does not say
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=heads,
        num_kv_heads=int(get("attention.head_count_kv", heads)),
        head_dim=int(meta.get(f"{arch}.attention.key_length") or meta.get(f"{arch}.rope.dimension_count")
                     or hidden // heads),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        max_position_embeddings=int(get("context_length")),
        tie_word_embeddings=False,  # decided once the tensors are read
        name=str(meta.get("general.name", path.stem)),
        architecture=architecture,
        rope_scaling=rope,
        sliding_window=int(window) if window else None,
    )


def model_class(config: ModelConfig) -> type:
    """The class that runs this config's family (DecoderModel or the family's subclass)."""
    return get(config.architecture).model_cls()
