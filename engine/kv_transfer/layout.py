"""What a KV block holds, and whether two engines' blocks are interchangeable.

Two engines can exchange blocks only if the model (and its quantization), the dtype, the layer
count, the KV heads, the head size, the block size, the shard and the stage all match. A
tensor-parallel engine's rank holds the KV of its heads only: its layout is that shard's (`shard`
"i/N", N the tensor-parallel size). A pipeline-parallel engine's rank holds the KV of its stage's
layers only: `stage` "s/S" (S the pipeline-parallel size), `num_layers` that stage's layer count
and `first_layer` the model's number of its first. So rank r of a decode group can talk only to
rank r of a prefill group of the same tensor and pipeline sizes and the same split of the layers
into stages. The compatibility hash names that tuple; the transport's handshake compares the
fields themselves so a refusal can say which one differs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass


@dataclass(frozen=True)
class KVLayout:
    model: str  # the model's identity, including a quantization that changes its KV
    dtype: str
    num_layers: int  # the layers these blocks hold (a pipeline stage's, else the model's)
    num_kv_heads: int
    head_size: int
    block_size: int
    itemsize: int
    shard: str = "0/1"  # tensor rank / tensor-parallel size of the engine holding these blocks
    stage: str = "0/1"  # pipeline stage / pipeline-parallel size of the engine holding these blocks
    first_layer: int = 0  # the model's layer held as this layout's layer 0 (its stage's first)

    @property
    def block_bytes_per_layer(self) -> int:
        """K and V of one block in one layer."""
        return 2 * self.block_size * self.num_kv_heads * self.head_size * self.itemsize

    @property
    def bytes_per_token(self) -> int:
        return self.block_bytes_per_layer * self.num_layers // self.block_size

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, value: dict) -> KVLayout:
        names = [f.name for f in dataclasses.fields(cls)]
        missing = [n for n in names if n not in value]
        if missing:
            raise ValueError(f"the peer's KV layout lacks {', '.join(missing)}")
        return cls(**{n: value[n] for n in names})

    @property
    def compat_hash(self) -> str:
        raw = json.dumps(self.as_dict(), sort_keys=True, separators=(",", ":")).encode()
        return hashlib.blake2b(raw, digest_size=8).hexdigest()

    def mismatch(self, other: KVLayout) -> list[str]:
        """'field: ours vs theirs' for every field that differs."""
        return [f"{name}: {getattr(self, name)!r} here vs {getattr(other, name)!r} there"
                for name in (f.name for f in dataclasses.fields(self)) if getattr(self, name) != getattr(other, name)]
