"""Phi-3 (and Phi-3.5 / Phi-4-mini, which share its architecture): a Llama decoder whose checkpoint
fuses q/k/v into one `qkv_proj` and gate/up into one `gate_up_proj` (split here onto the decoder's
names, which fuse them again), with LongRoPE scaling (`rope_scaling` type `longrope`, formerly
`su`: rope_longrope.py), an optional partial rotary (`partial_rotary_factor`: only the first
head_dim * factor dims of each head rotate) and a sliding window on every layer where config.json
gives one.

GGUF (llama.cpp arch "phi3"): attn_qkv (or attn_q/k/v), ffn_up holding gate and up stacked,
q/k rows not interleaved; the LongRoPE factors as the rope_factors_long / rope_factors_short
tensors with phi3.rope.scaling.original_context_length and .attn_factor;
phi3.rope.dimension_count is the rotary part of a head.

Paths: the torch and Triton backends, and the CPU fused kernels (quantized) where the rotary is
whole; --quantization int8 / int4 / w8a8 quantize the linears; a GGUF's own blocks are not used
(its fused tensors are split at load).
"""

from __future__ import annotations

from pathlib import Path

import torch

from iterserve.engine.model.architectures import (
    GGUF_LAYER_NAMES,
    Family,
    gguf_base_config,
    hf_base_config,
    register,
)
from iterserve.engine.model.decoder import DecoderLayer, DecoderModel
from iterserve.engine.model.loader import ModelConfig, ModelLoadError
from iterserve.engine.model.rope import rotary_cos_sin
from iterserve.engine.model.rope_longrope import LongRope, LongRopeConfigError

_GGUF_NAMES = {**GGUF_LAYER_NAMES, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.up_proj"}
LONG_FACTORS, SHORT_FACTORS = "rope.long_factor", "rope.short_factor"  # the GGUF's factor tensors, as loaded


class Phi3Model(DecoderModel):
    def __init__(self, config: ModelConfig, backend, layers, embed_tokens, norm, lm_head, max_positions: int,
                 quantization: str = "none"):
        params, config.rope_scaling = config.rope_scaling, None  # the base class builds a plain table
        try:
            super().__init__(config, backend, layers, embed_tokens, norm, lm_head, max_positions, quantization)
        finally:
            config.rope_scaling = params
        self.max_positions = max_positions
        self.rotary_dim = int(config.head_dim * float((params or {}).get("partial_rotary_factor", 1.0)))
        self.long_rope = None
        if params is not None and params.get("rope_type") == "longrope":
            try:
                self.long_rope = LongRope.from_hf(params, config.max_position_embeddings, self.rotary_dim)
            except LongRopeConfigError as exc:
                raise ModelLoadError(f"{config.name}: {exc}") from exc
            table = self.long_rope.cos_sin(self.rotary_dim, config.rope_theta, max_positions)
        else:
            table = rotary_cos_sin(self.rotary_dim, config.rope_theta, max_positions)
        self.cos_sin = table.to(embed_tokens.device)
        self.fused = self.fused and self.rotary_dim == config.head_dim

    def forward(self, input_ids, positions, kv_caches, meta):
        if self.long_rope is not None:  # a sequence past the original length reads the long table
            positions = self.long_rope.table_positions(positions, meta, self.max_positions)
        return super().forward(input_ids, positions, kv_caches, meta)

    __call__ = forward

    def attention_input(self, hidden: torch.Tensor, residual: torch.Tensor | None, layer: DecoderLayer,
                        positions: torch.Tensor):
        """Norm, the q/k/v projection and rotary on the first rotary_dim dims of each head."""
        backend, num_tokens, cfg = self.backend, hidden.shape[0], self.config
        heads, kv_heads, head_dim, r = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, self.rotary_dim
        x, residual = backend.rms_norm(hidden, layer.input_norm, cfg.rms_norm_eps, residual)
        q, k, v = self.adapted_linear(layer, "qkv", x, layer.qkv_proj, None).split(
            [self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = q.reshape(num_tokens, heads, head_dim), k.reshape(num_tokens, kv_heads, head_dim)
        if r == head_dim:
            q, k = backend.rotary(q, k, positions, self.cos_sin)
        else:
            q_rot, k_rot = backend.rotary(q[..., :r], k[..., :r], positions, self.cos_sin)
            q, k = torch.cat([q_rot, q[..., r:]], dim=-1), torch.cat([k_rot, k[..., r:]], dim=-1)
        return q, k, v.reshape(num_tokens, kv_heads, head_dim), residual


# -- config and weights ------------------------------------------------------------------------------


def hf_config(raw: dict, path: Path) -> ModelConfig:
    rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    kind = rope.get("rope_type", rope.get("type"))
    theta = float(rope.get("rope_theta", raw.get("rope_theta", 10000.0)))
    partial = float(rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)))
    long_rope = kind in ("longrope", "su", "yarn")  # transformers reads Phi-3's "su" and "yarn" as longrope
    if kind not in (None, "default") and not long_rope:
        raise ModelLoadError(f"{path / 'config.json'}: rope scaling type {kind!r} is not supported for phi3; "
                             "supported: default, longrope (su)")
    # the rope is this family's own (LongRoPE, partial rotary): the shared parser sees plain rotary
    config = hf_base_config({**raw, "rope_scaling": None, "rope_parameters": {"rope_theta": theta},
                             "partial_rotary_factor": 1.0}, path, "phi3")
    window = raw.get("sliding_window")
    config.sliding_window = int(window) if window else None
    config.attention_bias = config.attention_out_bias = False
    scaling = {"partial_rotary_factor": partial} if partial != 1.0 else None
    if long_rope:
        scaling = {**rope, "rope_type": "longrope", "partial_rotary_factor": partial,
                   "original_max_position_embeddings": rope.get("original_max_position_embeddings")
                   or raw.get("original_max_position_embeddings") or config.max_position_embeddings}
        try:
            LongRope.from_hf(scaling, config.max_position_embeddings, int(config.head_dim * partial))
        except LongRopeConfigError as exc:
            raise ModelLoadError(f"{path / 'config.json'}: {exc}") from exc
    config.rope_scaling = scaling
    return config


def gguf_config(meta: dict, arch: str, path: Path) -> ModelConfig:
    meta = {k: v for k, v in meta.items() if k != f"{arch}.rope.scaling.type"}
    config = gguf_base_config(meta, arch, path, "phi3")
    config.head_dim = config.hidden_size // config.num_heads  # rope.dimension_count is the rotary part only
    rot = int(meta.get(f"{arch}.rope.dimension_count") or config.head_dim)
    scaling: dict = {"partial_rotary_factor": rot / config.head_dim} if rot != config.head_dim else {}
    original = meta.get(f"{arch}.rope.scaling.original_context_length")
    if original:
        scaling |= {"rope_type": "longrope", "original_max_position_embeddings": int(original),
                    "attention_factor": float(meta.get(f"{arch}.rope.scaling.attn_factor") or 1.0)}
    config.rope_scaling = scaling or None
    return config


def adapt_weights(weights: dict[str, torch.Tensor], config: ModelConfig) -> None:
    """Fused qkv / gate_up split onto q/k/v and gate/up; a GGUF's LongRoPE factor tensors into
    the rope parameters."""
    q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    for i in range(config.num_layers):
        attn, mlp = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        qkv = weights.pop(attn + "qkv_proj.weight", None)
        if qkv is not None:
            if qkv.shape[0] != q_size + 2 * kv_size:
                raise ModelLoadError(f"{config.name}: {attn}qkv_proj.weight has {qkv.shape[0]} rows; "
                                     f"heads and kv heads give {q_size + 2 * kv_size}")
            for name, part in zip("qkv", qkv.split([q_size, kv_size, kv_size]), strict=True):
                weights[f"{attn}{name}_proj.weight"] = part
        gate_up = weights.pop(mlp + "gate_up_proj.weight", None)
        if gate_up is None and mlp + "gate_proj.weight" not in weights and mlp + "up_proj.weight" in weights:
            gate_up = weights.pop(mlp + "up_proj.weight")  # a GGUF's ffn_up holds gate and up
        if gate_up is not None:
            if gate_up.shape[0] != 2 * config.intermediate_size:
                raise ModelLoadError(f"{config.name}: layer {i}'s gate_up projection has {gate_up.shape[0]} rows; "
                                     f"expected 2 * intermediate_size = {2 * config.intermediate_size}")
            weights[mlp + "gate_proj.weight"], weights[mlp + "up_proj.weight"] = gate_up.chunk(2)
    long, short = weights.pop(LONG_FACTORS, None), weights.pop(SHORT_FACTORS, None)
    if config.rope_scaling and config.rope_scaling.get("rope_type") == "longrope" and "long_factor" not in config.rope_scaling:
        if long is None or short is None:
            raise ModelLoadError(f"{config.name}: the GGUF gives a LongRoPE original context length but not the "
                                 "rope_factors_long / rope_factors_short tensors")
        config.rope_scaling |= {"long_factor": long.float().reshape(-1).tolist(),
                                "short_factor": short.float().reshape(-1).tolist()}


FAMILY = register(Family(
    name="phi3",
    hf_architectures=("Phi3ForCausalLM",),
    hf_model_types=("phi3",),
    gguf_architectures=("phi3",),
    hf_config=hf_config,
    gguf_config=gguf_config,
    model_class=Phi3Model,
    gguf_layer_names=_GGUF_NAMES,
    gguf_permuted_qk=False,
    adapt_weights=adapt_weights,
))
