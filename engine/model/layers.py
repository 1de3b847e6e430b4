"""The pieces every decoder family is built from: linears (dense or quantized, optional bias),
RMSNorm (plain and Gemma's (1 + w) form), per-head q/k norm, gated MLP activations (SiLU, GELU
tanh). Attention with its options (sliding window, logit soft-cap) is the backend's
(engine/attention/backend.py AttentionOptions); rotary tables are rope.py's.

Each takes the attention backend where the backend has a kernel for it (rms_norm, silu_and_mul),
so the torch reference and the Triton kernels stay interchangeable; the rest is plain torch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from iterserve.engine.attention.backend import AttentionBackend
from iterserve.engine.model.quant import QuantLinear

Weight = torch.Tensor | QuantLinear  # a linear's weight: dense [out, in], or quantized (quant.py)


# Up to this many rows a dense linear is computed as (W @ x.T).T. For 2..32 rows MKL's sgemm on
# x @ W.T packs the weight (the big operand) first, which in a decode step means reading all of
# it twice: on this AVX2 EPYC, 1 thread, the real model's 2-sequence step took 148 ms that way and
# 104 ms as W @ x.T, where the weight is streamed once (bench/kernels/step_overhead.py, docs/performance.md). One row
# is a gemv either way; from ~64 rows the matmul is compute-bound and F.linear is as fast.
SMALL_ROWS = 32


def linear(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    if not isinstance(weight, torch.Tensor):
        out = weight(x)
    elif 1 < x.shape[0] <= SMALL_ROWS and x.device.type == "cpu":
        out = torch.mm(weight, x.t()).t().contiguous()
    else:
        out = F.linear(x, weight)
    return out if bias is None else out + bias


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                   residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Gemma's RMSNorm: normalised in fp32, times (1 + w) in fp32, then cast (transformers'
    Gemma2RMSNorm). Returns (norm(x + residual), x + residual) like AttentionBackend.rms_norm.
    In fp32 it equals the plain norm with the weight 1 + w folded in at load time."""
    if residual is not None:
        x = x + residual
    hidden = x.float()
    hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + eps)
    return (hidden * (1.0 + weight.float())).to(x.dtype), x


def head_rms_norm(backend: AttentionBackend, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each head of x [T, heads, head_dim] over head_dim (Qwen3's and Gemma 3's q/k norm)."""
    tokens, heads, dim = x.shape
    return backend.rms_norm(x.reshape(tokens * heads, dim), weight, eps)[0].view(tokens, heads, dim)


def gated_activation(backend: AttentionBackend, act: str, gate_up: torch.Tensor) -> torch.Tensor:
    """act(gate) * up for gate_up = cat([gate, up], -1): silu (Llama, Qwen, Mistral) through the
    backend's kernel, gelu_pytorch_tanh / gelu (Gemma's GeGLU) in torch."""
    if act == "silu":
        return backend.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    if act in ("gelu_pytorch_tanh", "gelu_tanh"):
        return F.gelu(gate, approximate="tanh") * up
    if act == "gelu":
        return F.gelu(gate) * up
    raise ValueError(f"hidden_act {act!r} is not supported; supported: silu, gelu_pytorch_tanh, gelu")


SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "gelu_tanh", "gelu")
