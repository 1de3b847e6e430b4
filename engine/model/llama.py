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
from iterserve.engine.model.loader import ModelConfig


@dataclass(slots=True)
class DecoderLayer:
    input_norm: torch.Tensor
    qkv_proj: torch.Tensor  # [(heads + 2 * kv_heads) * head_dim, hidden]
    o_proj: torch.Tensor
    post_attention_norm: torch.Tensor
    gate_up_proj: torch.Tensor  # [2 * intermediate, hidden]
    down_proj: torch.Tensor


def rotary_cos_sin(head_dim: int, theta: float, max_positions: int) -> torch.Tensor:
    """[max_positions, head_dim]: cos of each rotary frequency in the first half, sin in the second
    (computed as HF Llama does, so rounding matches the reference)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


class LlamaModel:
    def __init__(self, config: ModelConfig, backend: AttentionBackend, layers: list[DecoderLayer],
                 embed_tokens: torch.Tensor, norm: torch.Tensor, lm_head: torch.Tensor, max_positions: int):
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

    @classmethod
    def from_weights(cls, config: ModelConfig, weights: dict[str, torch.Tensor], backend: AttentionBackend,
                     device: torch.device, dtype: torch.dtype, max_positions: int) -> LlamaModel:
        def take(name: str) -> torch.Tensor:
            return weights.pop(name).to(device=device, dtype=dtype)

        def fused(*names: str) -> torch.Tensor:
            return torch.cat([weights.pop(n) for n in names], dim=0).to(device=device, dtype=dtype)

        layers = []
        for i in range(config.num_layers):
            prefix = f"model.layers.{i}."
            layers.append(DecoderLayer(
                input_norm=take(prefix + "input_layernorm.weight"),
                qkv_proj=fused(*(prefix + f"self_attn.{p}_proj.weight" for p in "qkv")),
                o_proj=take(prefix + "self_attn.o_proj.weight"),
                post_attention_norm=take(prefix + "post_attention_layernorm.weight"),
                gate_up_proj=fused(prefix + "mlp.gate_proj.weight", prefix + "mlp.up_proj.weight"),
                down_proj=take(prefix + "mlp.down_proj.weight"),
            ))
        embed = take("model.embed_tokens.weight")
        lm_head = embed if config.tie_word_embeddings else take("lm_head.weight")
        return cls(config, backend, layers, embed, take("model.norm.weight"), lm_head, max_positions)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.device

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [T]; returns the final hidden states [T, hidden]."""
        backend, eps = self.backend, self.config.rms_norm_eps
        num_tokens = input_ids.shape[0]
        heads, kv_heads, head_dim = self.config.num_heads, self.config.num_kv_heads, self.config.head_dim
        split = [self.q_size, self.kv_size, self.kv_size]
        hidden = F.embedding(input_ids, self.embed_tokens)
        residual = None
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches, strict=True):
            x, residual = backend.rms_norm(hidden, layer.input_norm, eps, residual)
            q, k, v = F.linear(x, layer.qkv_proj).split(split, dim=-1)
            q, k = backend.rotary(q.view(num_tokens, heads, head_dim), k.view(num_tokens, kv_heads, head_dim),
                                  positions, self.cos_sin)
            backend.write_kv(k, v.view(num_tokens, kv_heads, head_dim), k_cache, v_cache, meta)
            attn = backend.attend(q, k_cache, v_cache, meta, self.scale)
            hidden = F.linear(attn.reshape(num_tokens, self.q_size), layer.o_proj)
            x, residual = backend.rms_norm(hidden, layer.post_attention_norm, eps, residual)
            hidden = F.linear(backend.silu_and_mul(F.linear(x, layer.gate_up_proj)), layer.down_proj)
        hidden, _ = backend.rms_norm(hidden, self.norm, eps, residual)
        return hidden

    __call__ = forward

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> float32 logits [N, vocab]."""
        return F.linear(hidden, self.lm_head).float()
