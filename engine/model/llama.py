"""A Llama decoder over a flat batch: T tokens from many sequences (prefill chunks and decode
tokens mixed), no padding. Attention, the KV cache and the small fused ops go through an
AttentionBackend, so the torch reference and the Triton kernels are interchangeable.

Weights use HuggingFace names (see loader.py); q/k/v and gate/up are fused into one matmul each.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from iterserve.engine.attention.backend import AttentionBackend, AttentionMetadata
from iterserve.engine.model import cpu_fused
from iterserve.engine.model.loader import ModelConfig
from iterserve.engine.model.quant import Int4Linear, QuantLinear, quantize_dense, quantize_lm_head

Weight = torch.Tensor | QuantLinear  # a linear's weight: dense [out, in], or quantized (quant.py)


# Up to this many rows a dense linear is computed as (W @ x.T).T. For 2..32 rows MKL's sgemm on
# x @ W.T packs the weight (the big operand) first, which in a decode step means reading all of
# it twice: on this AVX2 EPYC, 1 thread, the real model's 2-sequence step took 148 ms that way and
# 104 ms as W @ x.T, where the weight is streamed once (bench/step_overhead.py, docs/performance.md). One row
# is a gemv either way; from ~64 rows the matmul is compute-bound and F.linear is as fast.
SMALL_ROWS = 32


def linear(x: torch.Tensor, weight: Weight) -> torch.Tensor:
    if not isinstance(weight, torch.Tensor):
        return weight(x)
    if 1 < x.shape[0] <= SMALL_ROWS and x.device.type == "cpu":
        return torch.mm(weight, x.t()).t().contiguous()
    return F.linear(x, weight)


@dataclass(slots=True)
class DecoderLayer:
    input_norm: torch.Tensor
    qkv_proj: Weight  # [(heads + 2 * kv_heads) * head_dim, hidden]
    o_proj: Weight
    post_attention_norm: torch.Tensor
    gate_up_proj: Weight  # [2 * intermediate, hidden]
    down_proj: Weight


def rotary_cos_sin(head_dim: int, theta: float, max_positions: int) -> torch.Tensor:
    """[max_positions, head_dim]: cos of each rotary frequency in the first half, sin in the second
    (computed as HF Llama does, so rounding matches the reference)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


class LlamaModel:
    def __init__(self, config: ModelConfig, backend: AttentionBackend, layers: list[DecoderLayer],
                 embed_tokens: torch.Tensor, norm: torch.Tensor, lm_head: Weight, max_positions: int,
                 quantization: str = "none"):
        self.config = config
        self.backend = backend
        self.layers = layers
        self.embed_tokens = embed_tokens
        self.norm = norm
        self.lm_head = lm_head
        self.cos_sin = rotary_cos_sin(config.head_dim, config.rope_theta, max_positions).to(embed_tokens.device)
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.scale = config.head_dim**-0.5
        self.quantization = quantization
        self.compiled = None  # a CompiledForward (compiled.py) once compile() ran
        # quantized CPU models run their small ops as fused C kernels (cpu_fused.py)
        self.fused = backend.name == "torch" and cpu_fused.supports(self)

    @classmethod
    def from_weights(cls, config: ModelConfig, weights: dict[str, torch.Tensor], backend: AttentionBackend,
                     device: torch.device, dtype: torch.dtype, max_positions: int, quantization: str = "none",
                     q4_1: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None) -> LlamaModel:
        """quantization int8 / int4 (CPU): the decoder's linears weight-only quantized; int4 takes the
        file's own Q4_1 blocks where it has them (q4_1), else blocks made from the float weight. The
        tied lm_head is int8 in both modes (the GGUF stores it as Q8_0)."""
        def take(name: str) -> torch.Tensor:
            return weights.pop(name).to(device=device, dtype=dtype)

        def fused(*names: str) -> Weight:
            if quantization == "int4" and q4_1 and all(n in q4_1 for n in names):
                parts = [q4_1.pop(n) for n in names]
                for n in names:
                    weights.pop(n)
                return Int4Linear(*(torch.cat([p[i] for p in parts], dim=0) for i in range(3)))
            dense = torch.cat([weights.pop(n) for n in names], dim=0)
            if quantization != "none":
                return quantize_dense(quantization, dense)
            return dense.to(device=device, dtype=dtype)

        layers = []
        for i in range(config.num_layers):
            prefix = f"model.layers.{i}."
            layers.append(DecoderLayer(
                input_norm=take(prefix + "input_layernorm.weight"),
                qkv_proj=fused(*(prefix + f"self_attn.{p}_proj.weight" for p in "qkv")),
                o_proj=fused(prefix + "self_attn.o_proj.weight"),
                post_attention_norm=take(prefix + "post_attention_layernorm.weight"),
                gate_up_proj=fused(prefix + "mlp.gate_proj.weight", prefix + "mlp.up_proj.weight"),
                down_proj=fused(prefix + "mlp.down_proj.weight"),
            ))
        embed = take("model.embed_tokens.weight")
        lm_head = embed if config.tie_word_embeddings else take("lm_head.weight")
        if quantization != "none":
            lm_head = quantize_lm_head(quantization, lm_head)
        return cls(config, backend, layers, embed, take("model.norm.weight"), lm_head, max_positions, quantization)

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
        if self.compiled is not None:
            return self.compiled.forward(input_ids, positions, kv_caches, meta)
        if self.fused and kv_caches[0][0].dtype == torch.float32:
            return cpu_fused.forward(self, input_ids, positions, kv_caches, meta)
        backend = self.backend
        hidden, residual = F.embedding(input_ids, self.embed_tokens), None
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            q, k, v, residual = self.attention_input(hidden, residual, layer, positions)
            backend.write_kv(k, v, k_cache, v_cache, meta)
            attn = backend.attend(q, k_cache, v_cache, meta, self.scale)
            hidden, residual = self.mlp(attn, residual, layer)
        return self.final_norm(hidden, residual)

    def attention_input(self, hidden: torch.Tensor, residual: torch.Tensor | None, layer: DecoderLayer,
                        positions: torch.Tensor):
        """Norm, fused q/k/v projection and rotary: (q [T, heads, d], k, v [T, kv_heads, d], residual)."""
        backend, num_tokens = self.backend, hidden.shape[0]
        heads, kv_heads, head_dim = self.config.num_heads, self.config.num_kv_heads, self.config.head_dim
        x, residual = backend.rms_norm(hidden, layer.input_norm, self.config.rms_norm_eps, residual)
        q, k, v = linear(x, layer.qkv_proj).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = backend.rotary(q.view(num_tokens, heads, head_dim), k.view(num_tokens, kv_heads, head_dim),
                              positions, self.cos_sin)
        return q, k, v.view(num_tokens, kv_heads, head_dim), residual

    def mlp(self, attn: torch.Tensor, residual: torch.Tensor, layer: DecoderLayer):
        """Output projection, norm and the gated MLP: (hidden [T, hidden], residual)."""
        hidden = linear(attn.reshape(attn.shape[0], self.q_size), layer.o_proj)
        x, residual = self.backend.rms_norm(hidden, layer.post_attention_norm, self.config.rms_norm_eps, residual)
        return linear(self.backend.silu_and_mul(linear(x, layer.gate_up_proj)), layer.down_proj), residual

    def final_norm(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.backend.rms_norm(hidden, self.norm, self.config.rms_norm_eps, residual)[0]

    __call__ = forward

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> float32 logits [N, vocab]."""
        return linear(hidden, self.lm_head).float()
