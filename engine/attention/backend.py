"""The attention backend interface and the per-step batch metadata it works on.

A step's batch is flat: T new tokens from S sequences, packed one sequence after another with no
padding. Sequence i owns query rows query_start_loc[i]:query_start_loc[i+1]; after this step it
has seq_lens[i] tokens in the cache, the last query_lens[i] of which are this step's new tokens.

KV cache layout, per layer: k_cache and v_cache are [num_blocks, block_size, num_kv_heads,
head_dim]; token p of sequence i lives in block block_tables[i, p // block_size] at offset
p % block_size. slot_mapping[t] = block * block_size + offset is where new token t is written.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    query_start_loc: torch.Tensor  # int32 [S + 1]
    seq_lens: torch.Tensor  # int32 [S]
    block_tables: torch.Tensor  # int32 [S, max_blocks], padded with 0
    slot_mapping: torch.Tensor  # int64 [T]
    query_lens_list: list[int]  # host copies, so backends need no device sync
    seq_lens_list: list[int]
    max_query_len: int
    max_seq_len: int

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_list)

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        width = max((len(t) for t in block_tables), default=1) or 1
        table = torch.zeros((len(block_tables), width), dtype=torch.int32)
        slots: list[int] = []
        for i, (blocks, q_len, s_len) in enumerate(zip(block_tables, query_lens, seq_lens, strict=True)):
            if blocks:
                table[i, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
            for pos in range(s_len - q_len, s_len):
                slots.append(blocks[pos // block_size] * block_size + pos % block_size)
        return cls(
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=table.to(device),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            query_lens_list=list(query_lens),
            seq_lens_list=list(seq_lens),
            max_query_len=max(query_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
        )


@dataclass(frozen=True, slots=True)
class AttentionOptions:
    """What a layer's attention does besides causal softmax(q.k * scale) v; every backend takes both.

    sliding_window: a query at position p sees keys p - window + 1 .. p (transformers' rule:
    key > p - window), in prefill chunks and decodes alike; None sees every earlier key.
    logit_softcap: scores (after the scale) become cap * tanh(scores / cap) before the softmax."""

    sliding_window: int | None = None
    logit_softcap: float | None = None

    def __post_init__(self) -> None:
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None; got {self.sliding_window}")
        if self.logit_softcap is not None and not self.logit_softcap > 0:
            raise ValueError(f"logit_softcap must be > 0 or None; got {self.logit_softcap}")


FULL_ATTENTION = AttentionOptions()


class AttentionBackend(ABC):
    name: str

    @abstractmethod
    def write_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, meta: AttentionMetadata) -> None:
        """Scatter this step's key/value [T, num_kv_heads, head_dim] into their cache slots."""

    @abstractmethod
    def attend(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float, options: AttentionOptions = FULL_ATTENTION) -> torch.Tensor:
        """Causal attention of query [T, num_heads, head_dim] over each sequence's cached KV, with the
        layer's sliding window and soft-cap (AttentionOptions)."""

    @abstractmethod
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (rmsnorm(x + residual) * weight, x + residual); residual None means zeros."""

    @abstractmethod
    def rotary(self, query: torch.Tensor, key: torch.Tensor, positions: torch.Tensor,
               cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate-half (NeoX/HF Llama) rotary embedding. cos_sin is [max_pos, head_dim]:
        cos in the first half of the last dim, sin in the second."""

    @abstractmethod
    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for gate_up = cat([gate, up], -1)."""


def get_backend(name: str, device: torch.device | str = "cpu") -> AttentionBackend:
    """'auto' is triton on CUDA and torch elsewhere."""
    if name == "auto":
        name = "triton" if torch.device(device).type == "cuda" else "torch"
    if name == "torch":
        from iterserve.engine.attention.torch_backend import TorchBackend

        return TorchBackend()
    if name == "triton":
        from iterserve.engine.attention.triton_backend import TritonBackend

        return TritonBackend()
    raise ValueError(f"unknown attention backend {name!r}; choose torch or triton")
