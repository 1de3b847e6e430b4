"""LongRoPE (`rope_type` "longrope", formerly "su"): Phi-3's per-frequency rotary rescaling.

Two sets of per-frequency factors come with the checkpoint: `short_factor` for sequences within the
pretraining length (`original_max_position_embeddings`) and `long_factor` beyond it; cos and sin
are both scaled by an attention factor (given, or sqrt(1 + ln(factor) / ln(original length))).
The frequencies are computed exactly as transformers' `_compute_longrope_parameters` does.

Which set a token uses follows transformers run with a KV cache: a forward pass over a sequence's
tokens uses the long factors when the sequence's length after that pass exceeds the original
length, else the short ones. Here that is decided per sequence of the flat batch (never from other
sequences in the step): a chunk or decode token of a sequence whose `seq_len` after this step
exceeds the original length reads the long table. The keys already in the cache keep the rotation
they were written with, as in transformers' cached generation. The two tables are stacked into one
[2 * max_positions, rotary_dim] cos/sin table and a long token's position is offset by
max_positions, so the backends' rotary op is unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from iterserve.engine.attention.backend import AttentionMetadata


class LongRopeConfigError(ValueError):
    """A longrope `rope_scaling` / `rope_parameters` entry that cannot be used."""


@dataclass(frozen=True, slots=True)
class LongRope:
    short_factor: tuple[float, ...]
    long_factor: tuple[float, ...]
    original_max_positions: int
    attention_factor: float

    @classmethod
    def from_hf(cls, rope: dict, max_position_embeddings: int, rotary_dim: int,
                original_max_position_embeddings: int | None = None) -> LongRope:
        """rope: config.json's `rope_scaling` (or `rope_parameters`) with type longrope or su;
        original_max_position_embeddings: the top-level field Phi-3 configs carry."""
        original = rope.get("original_max_position_embeddings", original_max_position_embeddings)
        if not original:
            raise LongRopeConfigError("rope scaling 'longrope' needs original_max_position_embeddings "
                                      "(in rope_scaling or at the top of config.json)")
        short, long = rope.get("short_factor"), rope.get("long_factor")
        for name, factors in (("short_factor", short), ("long_factor", long)):
            if not isinstance(factors, (list, tuple)) or len(factors) != rotary_dim // 2:
                raise LongRopeConfigError(f"rope_scaling.{name} must list {rotary_dim // 2} numbers "
                                          f"(rotary dim / 2); got {factors!r:.80}")
        factor = rope.get("factor")
        if factor is None:
            factor = max_position_embeddings / original
        attention_factor = rope.get("attention_factor")
        if attention_factor is None:
            attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        return cls(tuple(float(f) for f in short), tuple(float(f) for f in long), int(original),
                   float(attention_factor))

    def cos_sin(self, rotary_dim: int, theta: float, max_positions: int) -> torch.Tensor:
        """[2 * max_positions, rotary_dim]: the short table's rows, then the long table's."""
        exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
        positions = torch.arange(max_positions, dtype=torch.int64).float()[:, None]
        tables = []
        for factors in (self.short_factor, self.long_factor):
            inv_freq = 1.0 / (torch.tensor(factors, dtype=torch.float32) * theta**exponents)
            freqs = positions * inv_freq[None, :]
            tables.append(torch.cat((freqs.cos() * self.attention_factor, freqs.sin() * self.attention_factor),
                                    dim=-1))
        return torch.cat(tables, dim=0)

    def table_positions(self, positions: torch.Tensor, meta: AttentionMetadata, max_positions: int) -> torch.Tensor:
        """The row of cos_sin each token reads: its position, plus max_positions where its
        sequence is past the original length after this step."""
        long = [seq_len > self.original_max_positions for seq_len in meta.seq_lens_list]
        if not any(long):
            return positions
        offsets = torch.repeat_interleave(torch.tensor(long, dtype=positions.dtype) * max_positions,
                                          torch.tensor(meta.query_lens_list))
        return positions + offsets.to(positions.device)
