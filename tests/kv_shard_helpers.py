"""What the sharded-KV unit tests serve from each fake rank (tests/unit/test_kv_transfer_sharded.py,
tests/unit/test_kv_transfer_stages.py)."""

from __future__ import annotations


def shard_blocks(rank: int, layers: int, block_bytes: int):
    """A rank's KV reader: every byte of block b in layer l on rank r is (r * 64 + l * 16 + b) % 256, so a
    shard pulled from the wrong rank, layer or block shows in its bytes."""
    def read(block_ids):
        for layer in range(layers):
            data = b"".join(bytes([(rank * 64 + layer * 16 + b) % 256]) * (block_bytes // 2) for b in block_ids)
            yield memoryview(data), memoryview(data)
    return read
