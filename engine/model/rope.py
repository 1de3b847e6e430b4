"""Rotary embedding tables for every rope type the families use, computed as transformers'
ROPE_INIT_FUNCTIONS compute them (same formulas, same float32 steps), so logits match the reference.

In: head_dim, the base (rope_theta), the model's rope parameters (HF's `rope_parameters` /
`rope_scaling` dict, None for plain rotary) and the longest sequence the engine serves.
Out: the [max_positions, head_dim] table the attention backends take: cos in the first half of
the last dim, sin in the second, both already multiplied by the type's attention factor (yarn,
longrope). A type is one function in ROPE_TYPES returning (inv_freq [head_dim / 2], attention
factor); an unknown type is a ModelLoadError naming it and the supported ones.

`dynamic` (NTK) rescales the base by the sequence length. transformers recomputes it per forward
from the longest position in the batch, which a paged KV cache cannot follow (keys cached earlier
would carry other frequencies); here the base is fixed for max_model_len, which is what transformers
computes for a sequence of that length (and, like it, the plain base while that is within
max_position_embeddings).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from iterserve.engine.model.loader import ModelLoadError

RopeFn = Callable[[dict, int, float, int, int], tuple[torch.Tensor, float]]


def _plain_inv_freq(head_dim: int, base: float) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def _default(params: dict, head_dim: int, base: float, max_positions: int, max_position_embeddings: int):
    return _plain_inv_freq(head_dim, base), 1.0


def _linear(params: dict, head_dim: int, base: float, max_positions: int, max_position_embeddings: int):
    inv_freq = _plain_inv_freq(head_dim, base)
    inv_freq /= float(params["factor"])
    return inv_freq, 1.0


def _dynamic(params: dict, head_dim: int, base: float, max_positions: int, max_position_embeddings: int):
    factor = float(params["factor"])
    seq_len = max(max_positions, max_position_embeddings)
    base = base * ((factor * seq_len / max_position_embeddings) - (factor - 1)) ** (head_dim / (head_dim - 2))
    return _plain_inv_freq(head_dim, base), 1.0


def _yarn(params: dict, head_dim: int, base: float, max_positions: int, max_position_embeddings: int):
    original = int(params.get("original_max_position_embeddings") or max_position_embeddings)
    factor = params.get("factor")
    factor = float(factor) if factor is not None else max_position_embeddings / original
    attention_factor = params.get("attention_factor")
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")

    def get_mscale(scale: float, m: float = 1) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
        else:
            attention_factor = get_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (head_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, head_dim, 2).to(dtype=torch.float) / head_dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq, float(attention_factor)


def _llama3(params: dict, head_dim: int, base: float, max_positions: int, max_position_embeddings: int):
    inv_freq = _plain_inv_freq(head_dim, base)
    factor = float(params["factor"])
    low_freq_factor, high_freq_factor = float(params["low_freq_factor"]), float(params["high_freq_factor"])
    old_context_len = params.get("original_max_position_embeddings") or max_position_embeddings
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled), 1.0


def _freq_factors(params: dict, head_dim: int, base: float, max_positions: int, max_position_embeddings: int):
    """llama.cpp's rope_freqs tensor (how a GGUF carries Llama 3's scaling): base frequency / factor."""
    factors = torch.tensor(params["factors"], dtype=torch.float32)
    if factors.shape != (head_dim // 2,):
        raise ModelLoadError(f"rope_freqs has {factors.numel()} factors; expected head_dim / 2 = {head_dim // 2}")
    return _plain_inv_freq(head_dim, base) / factors, 1.0


# rope type -> (inv_freq, attention factor). Families with other types (longrope/su) add theirs here.
ROPE_TYPES: dict[str, RopeFn] = {
    "default": _default,
    "linear": _linear,
    "dynamic": _dynamic,
    "yarn": _yarn,
    "llama3": _llama3,
    "freq_factors": _freq_factors,
}


def rope_type(params: dict | None) -> str:
    if not params:
        return "default"
    return str(params.get("rope_type") or params.get("type") or "default")


def check_rope(params: dict | None, where: str) -> None:
    """A one-line ModelLoadError when the rope type is not one this engine computes."""
    kind = rope_type(params)
    if kind not in ROPE_TYPES:
        supported = ", ".join(sorted(t for t in ROPE_TYPES if t != "freq_factors"))
        raise ModelLoadError(f"{where}: rope scaling type {kind!r} is not supported; supported: {supported}")


def inv_freq_and_factor(params: dict | None, head_dim: int, base: float, max_positions: int,
                        max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    check_rope(params, "rope_scaling")
    return ROPE_TYPES[rope_type(params)](params or {}, head_dim, base, max_positions, max_position_embeddings)


def rotary_cos_sin(head_dim: int, theta: float, max_positions: int, params: dict | None = None,
                   max_position_embeddings: int | None = None) -> torch.Tensor:
    """[max_positions, head_dim]: cos of each rotary frequency in the first half, sin in the second
    (computed as transformers does, so rounding matches the reference)."""
    inv_freq, factor = inv_freq_and_factor(params, head_dim, theta, max_positions,
                                           max_position_embeddings or max_positions)
    freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq.float()[None, :]
    cos, sin = freqs.cos(), freqs.sin()
    if factor != 1.0:
        cos, sin = cos * factor, sin * factor
    return torch.cat((cos, sin), dim=-1)
