"""Gemma 2 and Gemma 3 (text): the decoder with Gemma's layer wiring.

What differs from Llama, all as transformers computes it:
- the embedding is scaled by sqrt(hidden) (the factor rounded to the model's dtype first);
- every RMSNorm multiplies by (1 + w), in float32 before the cast back (held here as the float32
  tensor 1 + w: a GGUF stores it so already, llama.cpp's convert adds the 1);
- four norms per layer: input, post-attention (on the attention output, before the residual add),
  pre-feed-forward and post-feed-forward (on the MLP output, before the residual add);
- the MLP is GeGLU with gelu-tanh;
- the attention scale is query_pre_attn_scalar ** -0.5;
- Gemma 2: attention logits soft-capped (50), final logits soft-capped (30), sliding window on
  every other layer (layers 0, 2, ...: config.json's `layer_types`);
- Gemma 3: per-head q/k norms (also 1 + w), five local (sliding) layers to one global, the local
  layers with their own rope base (`rope_local_base_freq`, or rope_parameters' sliding_attention
  entry) and unscaled rotary, the global ones with `rope_theta` and its scaling (linear x8 on 4B+).

Checkpoints: Gemma2ForCausalLM, Gemma3ForCausalLM (model_type gemma3_text, the 1B) and the text part
of Gemma3ForConditionalGeneration (model_type gemma3: its `text_config`, the language model's
tensors; the vision tower is not loaded). GGUF: llama.cpp's gemma2 / gemma3 (attn_norm,
post_attention_norm, ffn_norm = pre-feed-forward, post_ffw_norm; q/k rows not interleaved). A GGUF
does not record query_pre_attn_scalar: as llama.cpp, the 27B models (46 / 62 layers) use
hidden / heads and the others head_dim, unless `<arch>.attention.scale` is given; Gemma 3's
pattern and local base are llama.cpp's (6, 10000) unless `<arch>.attention.sliding_window_pattern`
/ `<arch>.rope.freq_base_swa` say otherwise.

Paths: the torch and Triton backends (attention with window and soft-cap); the norms and GeGLU
run in torch, so not the CPU fused kernels. --quantization int8 / int4 / w8a8 quantize the linears
(the norms stay float32); a GGUF's own blocks are not used (its norms are rewritten at load).
"""

from __future__ import annotations

from pathlib import Path

import torch

from iterserve.engine.model import cpu_gguf
from iterserve.engine.model.architectures import (
    GGUF_LAYER_NAMES,
    Family,
    default_layer_weights,
    gguf_base_config,
    hf_base_config,
    hf_layer_types,
    register,
)
from iterserve.engine.model.decoder import DecoderLayer, DecoderModel
from iterserve.engine.model.layers import gated_activation
from iterserve.engine.model.loader import ModelConfig, ModelLoadError
from iterserve.engine.model.rope import rotary_cos_sin

SLIDING, FULL = "sliding_attention", "full_attention"
EXTRA_NORMS = ("pre_feedforward_layernorm.weight", "post_feedforward_layernorm.weight")
# llama.cpp's 27B Gemma models scale queries by hidden / heads (their query_pre_attn_scalar)
_GGUF_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
_GGUF_NAMES = {**GGUF_LAYER_NAMES, "attn_post_norm": "post_attention_layernorm",
               "post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm"}


def _norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm with weight = 1 + w (float32): normalised and scaled in float32, then cast."""
    hidden = x.float()
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    return (hidden * weight).to(x.dtype)


class GemmaModel(DecoderModel):
    def __init__(self, config: ModelConfig, backend, layers, embed_tokens, norm, lm_head, max_positions: int,
                 quantization: str = "none"):
        super().__init__(config, backend, layers, embed_tokens, norm, lm_head, max_positions, quantization)
        device = embed_tokens.device
        self.embed_scale = torch.tensor(config.hidden_size**0.5, dtype=embed_tokens.dtype)
        local = config.local_rope_theta
        self.local_cos_sin = None if local is None else rotary_cos_sin(config.head_dim, local, max_positions).to(device)

    @classmethod
    def from_weights(cls, config: ModelConfig, weights: dict[str, torch.Tensor], backend, device: torch.device,
                     dtype: torch.dtype, max_positions: int, quantization: str = "none", q4_1=None,
                     **file_blocks) -> GemmaModel:
        # The norms are held as float32 1 + w, whatever the model's dtype, as transformers computes them.
        norms = {name: (weights[name].float() + config.norm_weight_offset).to(device)
                 for name in weights if name.endswith("norm.weight")}
        model = super().from_weights(config, weights, backend, device, dtype, max_positions, quantization, q4_1,
                                     **file_blocks)
        model.norm = norms["model.norm.weight"]
        for i, layer in enumerate(model.layers):
            prefix = f"model.layers.{i}."
            layer.input_norm = norms[prefix + "input_layernorm.weight"]
            layer.post_attention_norm = norms[prefix + "post_attention_layernorm.weight"]
            for name in EXTRA_NORMS:
                layer.extra[name] = norms[prefix + name]
            if layer.q_norm is not None:
                layer.q_norm = norms[prefix + "self_attn.q_norm.weight"]
                layer.k_norm = norms[prefix + "self_attn.k_norm.weight"]
        return model

    @classmethod
    def take_layer_extras(cls, config: ModelConfig, layer: int, decoder_layer: DecoderLayer, take) -> None:
        for name in EXTRA_NORMS:
            take(f"model.layers.{layer}.{name}")  # replaced by the float32 copy in from_weights

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return cpu_gguf.embedding(input_ids, self.embed_tokens) * self.embed_scale

    def attention_input(self, hidden: torch.Tensor, residual: torch.Tensor | None, layer: DecoderLayer,
                        positions: torch.Tensor):
        cfg, num_tokens = self.config, hidden.shape[0]
        heads, kv_heads, head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        residual = hidden if residual is None else hidden + residual
        x = _norm(residual, layer.input_norm, cfg.rms_norm_eps)
        q, k, v = self.adapted_linear(layer, "qkv", x, layer.qkv_proj, layer.qkv_bias).split(
            [self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = q.reshape(num_tokens, heads, head_dim), k.reshape(num_tokens, kv_heads, head_dim)
        if layer.q_norm is not None:
            q, k = _norm(q, layer.q_norm, cfg.rms_norm_eps), _norm(k, layer.k_norm, cfg.rms_norm_eps)
        local = layer.attention.sliding_window is not None and self.local_cos_sin is not None
        q, k = self.backend.rotary(q, k, positions, self.local_cos_sin if local else self.cos_sin)
        return q, k, v.reshape(num_tokens, kv_heads, head_dim), residual

    def mlp(self, attn: torch.Tensor, residual: torch.Tensor, layer: DecoderLayer):
        eps = self.config.rms_norm_eps
        out = self.adapted_linear(layer, "o", attn.reshape(attn.shape[0], self.q_size), layer.o_proj, layer.o_bias)
        residual = residual + _norm(out, layer.post_attention_norm, eps)
        x = _norm(residual, layer.extra["pre_feedforward_layernorm.weight"], eps)
        gate_up = self.adapted_linear(layer, "gate_up", x, layer.gate_up_proj, layer.gate_up_bias)
        out = self.adapted_linear(layer, "down", gated_activation(self.backend, self.config.hidden_act, gate_up),
                                  layer.down_proj, layer.down_bias)
        return _norm(out, layer.extra["post_feedforward_layernorm.weight"], eps), residual

    def final_norm(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return _norm(hidden + residual, self.norm, self.config.rms_norm_eps)


# -- config ------------------------------------------------------------------------------------------


# Gemma3TextConfig's defaults: the multimodal checkpoints' text_config leaves most of them out.
GEMMA3_TEXT_DEFAULTS = {
    "vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256, "rms_norm_eps": 1e-6,
    "max_position_embeddings": 131072, "query_pre_attn_scalar": 256, "sliding_window": 4096,
    "rope_theta": 1e6, "rope_local_base_freq": 10000.0, "hidden_activation": "gelu_pytorch_tanh",
}


def _text_config(raw: dict) -> dict:
    """Gemma3ForConditionalGeneration keeps the language model's config under text_config."""
    if raw.get("model_type") == "gemma3" and isinstance(raw.get("text_config"), dict):
        text = {**GEMMA3_TEXT_DEFAULTS, **raw["text_config"]}
        text.setdefault("tie_word_embeddings", raw.get("tie_word_embeddings", True))
        return text
    if raw.get("model_type") == "gemma3_text":
        return {**GEMMA3_TEXT_DEFAULTS, **raw}
    return raw


def hf_config(raw: dict, path: Path) -> ModelConfig:
    gemma3 = raw.get("model_type") in ("gemma3_text", "gemma3")
    raw = _text_config(raw)
    rope_params = raw.get("rope_parameters") or {}
    local_theta = float(raw.get("rope_local_base_freq", 10000.0)) if gemma3 else None
    if isinstance(rope_params.get(FULL), dict):  # transformers 5: one rope entry per layer type
        sliding = rope_params.get(SLIDING) or {}
        if sliding.get("rope_type", "default") != "default":
            raise ModelLoadError(f"{path / 'config.json'}: rope_parameters.sliding_attention has rope_type "
                                 f"{sliding['rope_type']!r}; Gemma's local layers take the default rotary only")
        local_theta = float(sliding.get("rope_theta", local_theta or 10000.0))
        raw = {**raw, "rope_parameters": rope_params[FULL]}
    act = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
    config = hf_base_config({**raw, "hidden_act": act}, path, "gemma3" if gemma3 else "gemma2")
    config.tie_word_embeddings = bool(raw.get("tie_word_embeddings", True))
    config.norm_weight_offset = 1.0  # the checkpoint's norm weights are w in (1 + w)
    config.query_pre_attn_scalar = float(raw.get("query_pre_attn_scalar") or config.head_dim)
    config.attn_logit_softcap = _cap(raw.get("attn_logit_softcapping"))
    config.final_logit_softcap = _cap(raw.get("final_logit_softcapping"))
    config.qk_norm = gemma3
    config.attention_bias = config.attention_out_bias = bool(raw.get("attention_bias", False))
    window = raw.get("sliding_window")
    config.sliding_window = int(window) if window else None
    types = hf_layer_types(raw, config.num_layers)
    if types is None:
        types = _pattern_types(int(raw.get("sliding_window_pattern") or (6 if gemma3 else 2)), config.num_layers)
    config.layer_types = types
    config.local_rope_theta = local_theta
    return config


def _cap(value) -> float | None:
    return float(value) if value else None


def _pattern_types(pattern: int, num_layers: int) -> tuple[str, ...]:
    """transformers' and llama.cpp's layout: every pattern-th layer global, the others local."""
    return tuple(SLIDING if (i + 1) % pattern else FULL for i in range(num_layers))


def gguf_config(meta: dict, arch: str, path: Path) -> ModelConfig:
    gemma3 = arch == "gemma3"
    config = gguf_base_config(meta, arch, path, arch)
    config.hidden_act = "gelu_pytorch_tanh"
    config.tie_word_embeddings = True  # untied only where the file has output.weight
    scale = meta.get(f"{arch}.attention.scale")
    if scale:
        config.query_pre_attn_scalar = float(scale) ** -2
    elif config.num_layers == _GGUF_27B_LAYERS[arch]:
        config.query_pre_attn_scalar = float(config.hidden_size // config.num_heads)
    else:
        config.query_pre_attn_scalar = float(config.head_dim)
    config.attn_logit_softcap = _cap(meta.get(f"{arch}.attn_logit_softcapping"))
    config.final_logit_softcap = _cap(meta.get(f"{arch}.final_logit_softcapping"))
    config.qk_norm = gemma3
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern")
    if isinstance(pattern, (list, tuple)):  # one flag per layer: True = local
        config.layer_types = tuple(SLIDING if flag else FULL for flag in pattern)
    else:
        config.layer_types = _pattern_types(int(pattern or (6 if gemma3 else 2)), config.num_layers)
    if gemma3:
        config.local_rope_theta = float(meta.get(f"{arch}.rope.freq_base_swa") or 10000.0)
    return config


def adapt_weights(weights: dict[str, torch.Tensor], config: ModelConfig) -> None:
    """Onto the decoder's names: Gemma3ForConditionalGeneration's language model is under
    model.language_model. (or language_model.model.); its vision tower is dropped."""
    for name in list(weights):
        for prefix in ("model.language_model.", "language_model.model."):
            if name.startswith(prefix):
                weights["model." + name.removeprefix(prefix)] = weights.pop(name)
                break
        else:
            if name.startswith(("model.vision_tower.", "model.multi_modal_projector.", "vision_tower.",
                                "multi_modal_projector.", "language_model.lm_head.")):
                del weights[name]


def layer_weights(config: ModelConfig) -> list[str]:
    return default_layer_weights(config) + list(EXTRA_NORMS)


for _name, _hf_archs, _types in (("gemma2", ("Gemma2ForCausalLM",), ("gemma2",)),
                                 ("gemma3", ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration"),
                                  ("gemma3_text", "gemma3"))):
    register(Family(
        name=_name,
        hf_architectures=_hf_archs,
        hf_model_types=_types,
        gguf_architectures=(_name,),
        hf_config=hf_config,
        gguf_config=gguf_config,
        model_class=GemmaModel,
        gguf_layer_names=_GGUF_NAMES,
        gguf_permuted_qk=False,
        layer_weights=layer_weights,
        adapt_weights=adapt_weights,
    ))
