"""Automatic prefix caching: which KV blocks already hold a given run of tokens.

In: full, computed blocks of running sequences (block index + the hash of their tokens), offered
after each step; lookups by a new sequence's chain of block hashes; blocks whose last holder let
go. Out: the longest run of cached blocks that starts a sequence's tokens, and, when the block
pool runs dry, the least recently used cached block nobody holds (its hash forgotten), plus
query/hit counts in tokens.

A full block is named by a hash chained over its parent block's hash, its token ids and any
extra keys that change the KV (a cache salt, later a LoRA id), so equal hashes mean equal
prefixes, not just equal blocks. `hash_block_tokens` and `prefix_block_hashes` are plain
functions of tokens, stable across processes and Python versions, so a router can compute the
same names for prefix affinity. Reference counts and the free list stay in
engine/block_manager.py, the one owner of blocks; this module only indexes them.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence

HASH_BYTES = 16
HIT_RATE_WINDOW = 1000  # admissions the windowed hit rate looks back over


def hash_block_tokens(parent: int | None, tokens: Sequence[int], extra: Iterable[str | int | bytes] = ()) -> int:
    """The name of one full block: blake2b over the parent block's hash (None for the first
    block), the block's token ids and the extra keys, as a 128-bit integer."""
    h = hashlib.blake2b(digest_size=HASH_BYTES)
    h.update((parent or 0).to_bytes(HASH_BYTES, "little"))
    h.update(struct.pack(f"<I{len(tokens)}I", len(tokens), *tokens))
    for key in extra:
        raw = key if isinstance(key, bytes) else str(key).encode("utf-8")
        h.update(struct.pack("<I", len(raw)) + raw)
    return int.from_bytes(h.digest(), "little")


def prefix_block_hashes(token_ids: Sequence[int], block_size: int, extra: Iterable[str | int | bytes] = ()) -> list[int]:
    """Chained hashes of every full block of token_ids (a partial last block has none). The extra
    keys enter the first block's hash and so, through the chain, every later one."""
    extra = tuple(extra)
    hashes: list[int] = []
    parent = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[start : start + block_size], extra if start == 0 else ())
        hashes.append(parent)
    return hashes


class PrefixCache:
    """hash -> block for full computed blocks, and the LRU of those that no sequence holds."""

    def __init__(self, window: int = HIT_RATE_WINDOW) -> None:
        self._block_of: dict[int, int] = {}
        self._hash_of: dict[int, int] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # oldest first
        self.queries = 0  # prompt tokens looked up, over the engine's life
        self.hits = 0  # of those, tokens found cached
        self._window: deque[tuple[int, int]] = deque(maxlen=window)
        self._window_queries = 0
        self._window_hits = 0

    # -- the index -------------------------------------------------------------------------
    def match(self, hashes: Iterable[int]) -> list[int]:
        """Blocks holding the longest cached run of these chained hashes, from the first."""
        blocks = []
        for block_hash in hashes:
            block = self._block_of.get(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def insert(self, block: int, block_hash: int) -> bool:
        """Name a held block that just became full and computed; False if another block already
        holds these tokens (this one then stays unnamed and is freed as usual)."""
        if block_hash in self._block_of or block in self._hash_of:
            return False
        self._block_of[block_hash] = block
        self._hash_of[block] = block_hash
        return True

    def is_cached(self, block: int) -> bool:
        return block in self._hash_of

    def hash_of(self, block: int) -> int | None:
        return self._hash_of.get(block)

    @property
    def num_cached(self) -> int:
        """Named blocks, held or not."""
        return len(self._hash_of)

    # -- cached blocks nobody holds ----------------------------------------------------------
    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def evictable_blocks(self) -> list[int]:
        return list(self._evictable)

    def park(self, block: int) -> None:
        """The block's last holder let go: keep its KV, most recently used last."""
        self._evictable[block] = None

    def unpark(self, block: int) -> None:
        """A sequence took the block again: it can no longer be evicted."""
        del self._evictable[block]

    def evict(self) -> int:
        """Forget the least recently used unheld block and hand it out for reuse."""
        block, _ = self._evictable.popitem(last=False)
        del self._block_of[self._hash_of.pop(block)]
        return block

    # -- counts ------------------------------------------------------------------------------
    def record(self, num_queried: int, num_hit: int) -> None:
        """One admission looked up num_queried tokens and found num_hit of them cached."""
        self.queries += num_queried
        self.hits += num_hit
        if len(self._window) == self._window.maxlen:
            old_queried, old_hit = self._window[0]
            self._window_queries -= old_queried
            self._window_hits -= old_hit
        self._window.append((num_queried, num_hit))
        self._window_queries += num_queried
        self._window_hits += num_hit

    def hit_rate(self) -> float:
        """Hit tokens / queried tokens over the last HIT_RATE_WINDOW admissions (0 before any)."""
        return self._window_hits / self._window_queries if self._window_queries else 0.0
