"""The decoder's small ops fused into C for quantized CPU models (`--quantization` on CPU).

A decode step of one or two sequences spends more time dispatching ~40 small torch ops per layer
(norms and residual adds, rotary, the KV write, SiLU) than computing them. Here each layer runs as
nine calls: two fused norm + residual adds, one fused rotary + KV-cache write (k and v go straight
into their slots, q into a contiguous buffer for attention), one fused SiLU x up, the four
linears, and the attention backend's `attend`.

In: the model (LlamaModel), a step's token ids, positions, KV caches and AttentionMetadata, as
LlamaModel.forward takes them. Out: the final hidden states [T, hidden], as LlamaModel.forward
returns them.

`--quantization none` keeps torch's ops (the exact-parity mode): these kernels round the
norm's sum of squares and SiLU's exp differently from torch (within a few ulp; rotary and the KV
write are exact). Without a C compiler or AVX2, or for shapes the kernels do not take (head_dim or
hidden size not a multiple of 8), the model keeps torch's ops.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from typing import TYPE_CHECKING

import torch

from iterserve.engine import native

if TYPE_CHECKING:
    from iterserve.engine.attention.backend import AttentionMetadata
    from iterserve.engine.model.decoder import DecoderModel as LlamaModel

logger = logging.getLogger(__name__)

_SOURCE = native.AVX2_HELPERS + r"""
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

/* out = w * r / sqrt(mean(r^2) + eps) per row, where r = x + residual (or x when residual is NULL);
   r is written to new_residual. Rows of dim floats (dim % 8 == 0), contiguous. */
void rms_norm(const float* x, const float* residual, const float* w, float eps, float* out, float* new_residual,
              int64_t rows, int64_t dim) {
    for (int64_t t = 0; t < rows; t++) {
        const float* xr = x + t * dim;
        float* rr = new_residual + t * dim;
        __m256 sq = _mm256_setzero_ps();
        for (int64_t i = 0; i < dim; i += 8) {
            __m256 v = _mm256_loadu_ps(xr + i);
            if (residual) v = _mm256_add_ps(v, _mm256_loadu_ps(residual + t * dim + i));
            _mm256_storeu_ps(rr + i, v);
            sq = _mm256_fmadd_ps(v, v, sq);
        }
        const __m256 inv = _mm256_set1_ps(1.0f / sqrtf(hsum(sq) / (float)dim + eps));
        float* o = out + t * dim;
        for (int64_t i = 0; i < dim; i += 8)
            _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_loadu_ps(w + i),
                                                  _mm256_mul_ps(_mm256_loadu_ps(rr + i), inv)));
    }
}

/* Rotary (cos in the first half of a cos_sin row, sin in the second; x1 * cos - x2 * sin,
   x2 * cos + x1 * sin, each product rounded as torch does) on q and k of a fused qkv row; q to
   q_out [rows, heads, d], rotated k and v to their cache slots [slot, kv_heads, d]. */
void rotary_write_kv(const float* qkv, int64_t rows, int64_t heads, int64_t kv_heads, int64_t d,
                     const int64_t* positions, const float* cos_sin, const int64_t* slots, float* q_out,
                     float* k_cache, float* v_cache) {
    const int64_t half = d / 2, width = (heads + 2 * kv_heads) * d;
    for (int64_t t = 0; t < rows; t++) {
        const float* row = qkv + t * width;
        const float* cs = cos_sin + positions[t] * d;
        const int64_t slot = slots[t];
        for (int64_t h = 0; h < heads + kv_heads; h++) {
            const float* x = row + h * d;
            float* o = h < heads ? q_out + (t * heads + h) * d : k_cache + (slot * kv_heads + h - heads) * d;
            if (h >= heads && slot < 0) continue;
            int64_t i = 0;
            for (; i + 8 <= half; i += 8) {
                __m256 x1 = _mm256_loadu_ps(x + i), x2 = _mm256_loadu_ps(x + half + i);
                __m256 c = _mm256_loadu_ps(cs + i), s = _mm256_loadu_ps(cs + half + i);
                _mm256_storeu_ps(o + i, _mm256_sub_ps(_mm256_mul_ps(x1, c), _mm256_mul_ps(x2, s)));
                _mm256_storeu_ps(o + half + i, _mm256_add_ps(_mm256_mul_ps(x2, c), _mm256_mul_ps(x1, s)));
            }
            for (; i < half; i++) {
                const float x1 = x[i], x2 = x[half + i], c = cs[i], s = cs[half + i];
                const float a = x1 * c, b = x2 * s, e = x2 * c, f = x1 * s;
                o[i] = a - b;
                o[half + i] = e + f;
            }
        }
        if (slot >= 0) {
            const float* v = row + (heads + kv_heads) * d;
            float* dst = v_cache + slot * kv_heads * d;
            for (int64_t i = 0; i < kv_heads * d; i++) dst[i] = v[i];
        }
    }
}

/* out[t, i] = silu(gate_up[t, i]) * gate_up[t, inner + i]; inner % 8 == 0. */
void silu_mul(const float* gate_up, int64_t rows, int64_t inner, float* out) {
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    for (int64_t t = 0; t < rows; t++) {
        const float* g = gate_up + t * 2 * inner;
        for (int64_t i = 0; i < inner; i += 8) {
            __m256 x = _mm256_loadu_ps(g + i);
            __m256 silu = _mm256_div_ps(x, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, x))));
            _mm256_storeu_ps(out + t * inner + i, _mm256_mul_ps(silu, _mm256_loadu_ps(g + inner + i)));
        }
    }
}
"""


def native_builds(every_isa: bool) -> list[tuple[str, str, list[str]]]:
    """The kernels as native.prebuild compiles them (one path for every AVX2 CPU)."""
    # no FMA contraction: rotary rounds each product as torch does
    return [("cpu_fused", _SOURCE, ["-ffp-contract=off", "-fno-associative-math"])]


@functools.cache
def load() -> ctypes.CDLL | None:
    if not native.has_avx2():
        return None
    lib = native.build(*native_builds(False)[0])
    if lib is None:
        logger.warning("the decoder's small ops stay torch ops: the fused C kernels are unavailable")
        return None
    i64, ptr, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
    lib.rms_norm.argtypes = [ptr, ptr, ptr, f32, ptr, ptr, i64, i64]
    lib.rotary_write_kv.argtypes = [ptr, i64, i64, i64, i64, ptr, ptr, ptr, ptr, ptr, ptr]
    lib.silu_mul.argtypes = [ptr, i64, i64, ptr]
    for fn in (lib.rms_norm, lib.rotary_write_kv, lib.silu_mul):
        fn.restype = None
    return lib


def supports(model: LlamaModel) -> bool:
    """Whether the fused path serves this model: quantized, fp32 on the CPU, shapes the kernels take."""
    cfg = model.config
    return (model.quantization != "none" and model.device.type == "cpu" and model.dtype == torch.float32
            and cfg.head_dim % 2 == 0 and cfg.hidden_size % 8 == 0 and cfg.intermediate_size % 8 == 0
            and load() is not None)


def rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
             eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * normalized(x + residual), x + residual), as AttentionBackend.rms_norm."""
    rows, dim = x.shape
    out, new_residual = torch.empty(rows, dim), torch.empty(rows, dim)
    with native.profiled("cpu_fused::rms_norm"):
        load().rms_norm(x.data_ptr(), None if residual is None else residual.data_ptr(), weight.data_ptr(), eps,
                        out.data_ptr(), new_residual.data_ptr(), rows, dim)
    return out, new_residual


def rotary_write_kv(qkv: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, heads: int,
                    kv_heads: int, head_dim: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor) -> torch.Tensor:
    """q rotated [T, heads, head_dim]; k rotated and v written to the caches' slots."""
    rows = qkv.shape[0]
    query = torch.empty(rows, heads, head_dim)
    with native.profiled("cpu_fused::rotary_write_kv"):
        load().rotary_write_kv(qkv.data_ptr(), rows, heads, kv_heads, head_dim, positions.data_ptr(), cos_sin.data_ptr(),
                               slot_mapping.data_ptr(), query.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr())
    return query


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    rows, inner = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, inner)
    with native.profiled("cpu_fused::silu_mul"):
        load().silu_mul(gate_up.data_ptr(), rows, inner, out.data_ptr())
    return out


def forward(model: LlamaModel, input_ids: torch.Tensor, positions: torch.Tensor,
            kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> torch.Tensor:
    """LlamaModel.forward on the fused kernels (see the module docstring)."""
    from iterserve.engine.model.layers import linear

    cfg = model.config
    heads, kv_heads, head_dim, eps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps
    positions = positions.to(torch.int64).contiguous()
    slots = meta.slot_mapping.contiguous()
    backend, scale = model.backend, model.scale
    hidden, residual = model.embed(input_ids), None
    for layer, (k_cache, v_cache) in zip(model.layers, kv_caches, strict=True):
        x, residual = rms_norm(hidden, residual, layer.input_norm, eps)
        query = rotary_write_kv(linear(x, layer.qkv_proj), positions, model.cos_sin, heads, kv_heads, head_dim,
                                k_cache, v_cache, slots)
        attn = backend.attend(query, k_cache, v_cache, meta, scale, layer.attention)
        x, residual = rms_norm(linear(attn.reshape(attn.shape[0], model.q_size), layer.o_proj), residual,
                               layer.post_attention_norm, eps)
        hidden = linear(silu_mul(linear(x, layer.gate_up_proj)), layer.down_proj)
    return rms_norm(hidden, residual, model.norm, eps)[0]
