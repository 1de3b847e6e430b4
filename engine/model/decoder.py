"""The decoder every family runs: a pre-norm transformer over a flat batch of T tokens from many
sequences (prefill chunks and decode tokens mixed), no padding. Attention, the KV cache and the
small fused ops go through an AttentionBackend, so the torch reference and the Triton kernels are
interchangeable.

Weights use HuggingFace Llama names (the families' loaders map theirs onto them, see
architectures.py); q/k/v and gate/up are fused into one matmul each. What differs between
Llama, Qwen2, Qwen3 and Mistral is options of this one class, read from ModelConfig: biases
(present in the checkpoint -> used), per-head q/k norm, the rope type (rope.py), each layer's
AttentionOptions (sliding window, soft-cap), the MLP activation, the attention scale and a final
logit soft-cap. A family with other layer wiring (Gemma's extra norms) subclasses it and
overrides `attention_input` / `mlp` / `embed`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from iterserve.engine.attention.backend import (
    FULL_ATTENTION,
    AttentionBackend,
    AttentionMetadata,
    AttentionOptions,
)
from iterserve.engine.model import cpu_fused, cpu_gguf
from iterserve.engine.model.layers import Weight, gated_activation, head_rms_norm, linear
from iterserve.engine.model.loader import ModelConfig, ModelLoadError
from iterserve.engine.model.parallel import RowParallel
from iterserve.engine.model.quant import (
    Int4Linear,
    gguf_embedding,
    gguf_linear,
    quantize_dense,
    quantize_lm_head,
)
from iterserve.engine.model.rope import rotary_cos_sin


@dataclass(slots=True)
class DecoderLayer:
    input_norm: torch.Tensor
    qkv_proj: Weight  # [(heads + 2 * kv_heads) * head_dim, hidden]
    o_proj: Weight
    post_attention_norm: torch.Tensor
    gate_up_proj: Weight  # [2 * intermediate, hidden]
    down_proj: Weight
    attention: AttentionOptions = FULL_ATTENTION
    qkv_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None
    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None  # [head_dim], per-head RMSNorm before rotary
    k_norm: torch.Tensor | None = None
    extra: dict[str, torch.Tensor] = field(default_factory=dict)  # a subclass's own tensors (Gemma's norms)

    @property
    def plain(self) -> bool:
        """No bias, no q/k norm, no window or soft-cap: what cpu_fused's kernels compute."""
        return (self.qkv_bias is None and self.o_bias is None and self.gate_up_bias is None
                and self.down_bias is None and self.q_norm is None and not self.extra)


class DecoderModel:
    # engine/lora's LoraStep while a step has rows of LoRA adapters (set by the model runner), else None
    lora_step = None

    def __init__(self, config: ModelConfig, backend: AttentionBackend, layers: list[DecoderLayer],
                 embed_tokens: torch.Tensor, norm: torch.Tensor, lm_head: Weight, max_positions: int,
                 quantization: str = "none"):
        self.config = config
        self.backend = backend
        self.layers = layers
        self.embed_tokens = embed_tokens
        self.norm = norm
        self.lm_head = lm_head
        self.cos_sin = rotary_cos_sin(config.head_dim, config.rope_theta, max_positions, config.rope_scaling,
                                      config.max_position_embeddings).to(embed_tokens.device)
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.scale = (config.query_pre_attn_scalar or config.head_dim) ** -0.5
        self.quantization = quantization
        self.compiled = None  # a CompiledForward (compiled.py) once compile() ran
        # quantized CPU models run their small ops as fused C kernels (cpu_fused.py)
        self.fused = (backend.name == "torch" and config.hidden_act == "silu" and all(layer.plain for layer in layers)
                      and config.final_logit_softcap is None and cpu_fused.supports(self))

    @classmethod
    def from_weights(cls, config: ModelConfig, weights: dict[str, torch.Tensor], backend: AttentionBackend,
                     device: torch.device, dtype: torch.dtype, max_positions: int, quantization: str = "none",
                     q4_1: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None,
                     gguf_blocks: dict[str, tuple[int, torch.Tensor]] | None = None) -> DecoderModel:
        """quantization int8 / int4 (CPU): the decoder's linears weight-only quantized; int4 takes the
        file's own Q4_1 blocks where it has them (q4_1), else blocks made from the float weight. The
        tied lm_head is int8 in both modes (the GGUF stores it as Q8_0). gguf: the linears and the
        lm_head on the file's own blocks (gguf_blocks, quant.GGUFLinear) where the kernel takes their
        format, else dense. Biases and norms stay dense."""
        def take(name: str) -> torch.Tensor:
            return weights.pop(name).to(device=device, dtype=dtype)

        def maybe(name: str) -> torch.Tensor | None:
            return take(name) if name in weights else None

        def fused(*names: str) -> Weight:
            if quantization == "gguf" and (on_blocks := gguf_linear(gguf_blocks, names)) is not None:
                for n in names:
                    weights.pop(n)
                return on_blocks
            if quantization == "int4" and q4_1 and all(n in q4_1 for n in names):
                parts = [q4_1.pop(n) for n in names]
                for n in names:
                    weights.pop(n)
                return Int4Linear(*(torch.cat([p[i] for p in parts], dim=0) for i in range(3)))
            dense = torch.cat([weights.pop(n) for n in names], dim=0)
            if quantization not in ("none", "gguf"):
                return quantize_dense(quantization, dense)
            return dense.to(device=device, dtype=dtype)

        def fused_bias(*names: str) -> torch.Tensor | None:
            if not any(n in weights for n in names):
                return None
            missing = [n for n in names if n not in weights]
            if missing:
                raise ModelLoadError(f"{missing[0]} is missing while the checkpoint has the other biases of "
                                     f"its fused projection ({names[0]}): a checkpoint has all of them or none")
            return torch.cat([weights.pop(n) for n in names], dim=0).to(device=device, dtype=dtype)

        layers = []
        for i in range(config.num_layers):
            prefix = f"model.layers.{i}."
            attn, mlp = prefix + "self_attn.", prefix + "mlp."
            layers.append(DecoderLayer(
                input_norm=take(prefix + "input_layernorm.weight"),
                qkv_proj=fused(*(attn + f"{p}_proj.weight" for p in "qkv")),
                o_proj=fused(attn + "o_proj.weight"),
                post_attention_norm=take(prefix + "post_attention_layernorm.weight"),
                gate_up_proj=fused(mlp + "gate_proj.weight", mlp + "up_proj.weight"),
                down_proj=fused(mlp + "down_proj.weight"),
                attention=cls.layer_attention(config, i),
                qkv_bias=fused_bias(*(attn + f"{p}_proj.bias" for p in "qkv")),
                o_bias=maybe(attn + "o_proj.bias"),
                gate_up_bias=fused_bias(mlp + "gate_proj.bias", mlp + "up_proj.bias"),
                down_bias=maybe(mlp + "down_proj.bias"),
                q_norm=maybe(attn + "q_norm.weight"),
                k_norm=maybe(attn + "k_norm.weight"),
            ))
            cls.take_layer_extras(config, i, layers[-1], take)
        embed = take("model.embed_tokens.weight")
        lm_head = embed if config.tie_word_embeddings else take("lm_head.weight")
        if quantization == "gguf":
            lm_name = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
            lm_head = gguf_linear(gguf_blocks, (lm_name,)) or lm_head
            embed = gguf_embedding(gguf_blocks, lm_head if config.tie_word_embeddings else None) or embed
        elif quantization != "none":
            lm_head = quantize_lm_head(quantization, lm_head)
        return cls(config, backend, layers, embed, take("model.norm.weight"), lm_head, max_positions, quantization)

    @staticmethod
    def layer_attention(config: ModelConfig, layer: int) -> AttentionOptions:
        """Layer i's sliding window and soft-cap, from the config."""
        return AttentionOptions(sliding_window=config.layer_window(layer), logit_softcap=config.attn_logit_softcap)

    @classmethod
    def take_layer_extras(cls, config: ModelConfig, layer: int, decoder_layer: DecoderLayer, take) -> None:
        """A subclass's hook: move its own per-layer tensors into decoder_layer.extra."""

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.device

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [T]; returns the final hidden states [T, hidden].

        Each layer is: the dense work before attention (`attention_input`), the paged KV write and
        attention (the backend), the dense work after it (`mlp`). With `--compile` (compiled.py) the
        dense work between two attentions runs as one compiled graph; attention stays its boundary."""
        if self.compiled is not None and self.lora_step is None:
            return self.compiled.forward(input_ids, positions, kv_caches, meta)
        if self.fused and kv_caches[0][0].dtype == torch.float32 and self.lora_step is None:
            return cpu_fused.forward(self, input_ids, positions, kv_caches, meta)
        backend = self.backend
        hidden, residual = self.embed(input_ids), None
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            q, k, v, residual = self.attention_input(hidden, residual, layer, positions)
            backend.write_kv(k, v, k_cache, v_cache, meta)
            attn = backend.attend(q, k_cache, v_cache, meta, self.scale, layer.attention)
            hidden, residual = self.mlp(attn, residual, layer)
        return self.final_norm(hidden, residual)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return cpu_gguf.embedding(input_ids, self.embed_tokens)

    def attention_input(self, hidden: torch.Tensor, residual: torch.Tensor | None, layer: DecoderLayer,
                        positions: torch.Tensor):
        """Norm, fused q/k/v projection, q/k norm and rotary: (q [T, heads, d], k, v [T, kv_heads, d], residual)."""
        backend, num_tokens, cfg = self.backend, hidden.shape[0], self.config
        heads, kv_heads, head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        x, residual = backend.rms_norm(hidden, layer.input_norm, cfg.rms_norm_eps, residual)
        q, k, v = self.adapted_linear(layer, "qkv", x, layer.qkv_proj, layer.qkv_bias).split(
            [self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = q.reshape(num_tokens, heads, head_dim), k.reshape(num_tokens, kv_heads, head_dim)
        if layer.q_norm is not None:
            q = head_rms_norm(backend, q, layer.q_norm, cfg.rms_norm_eps)
            k = head_rms_norm(backend, k, layer.k_norm, cfg.rms_norm_eps)
        q, k = backend.rotary(q, k, positions, self.cos_sin)
        return q, k, v.reshape(num_tokens, kv_heads, head_dim), residual

    def mlp(self, attn: torch.Tensor, residual: torch.Tensor, layer: DecoderLayer):
        """Output projection, norm and the gated MLP: (hidden [T, hidden], residual)."""
        hidden = self.adapted_linear(layer, "o", attn.reshape(attn.shape[0], self.q_size), layer.o_proj, layer.o_bias)
        x, residual = self.backend.rms_norm(hidden, layer.post_attention_norm, self.config.rms_norm_eps, residual)
        gate_up = self.adapted_linear(layer, "gate_up", x, layer.gate_up_proj, layer.gate_up_bias)
        return self.adapted_linear(layer, "down", gated_activation(self.backend, self.config.hidden_act, gate_up),
                                   layer.down_proj, layer.down_bias), residual

    def adapted_linear(self, layer: DecoderLayer, target: str, x: torch.Tensor, weight: Weight,
                       bias: torch.Tensor | None) -> torch.Tensor:
        """linear(), plus this step's LoRA deltas on the rows of requests that chose an adapter
        (target: qkv, o, gate_up or down; engine/lora). Every family's projections go through it.
        A row-parallel linear (tensor parallelism) adds the rank's partial delta to its partial
        product before the all-reduce, which then sums the delta too."""
        step = self.lora_step
        if step is None:
            return linear(x, weight, bias)
        if isinstance(weight, RowParallel):
            out = weight.group.all_reduce(step.add(layer, target, x, linear(x, weight.weight)))
            return out if bias is None else out + bias
        return step.add(layer, target, x, linear(x, weight, bias))

    def final_norm(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.backend.rms_norm(hidden, self.norm, self.config.rms_norm_eps, residual)[0]

    __call__ = forward

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> float32 logits [N, vocab] (soft-capped where the family does)."""
        logits = linear(hidden, self.lm_head).float()
        cap = self.config.final_logit_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits
