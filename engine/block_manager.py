"""Paged KV cache bookkeeping: fixed-size blocks with reference counts, per-sequence block tables,
and a CPU pool that preempted sequences can be swapped into. Pure Python: the tensors live in the
model runner, which copies blocks when the scheduler asks it to.

With prefix caching, full computed blocks are also named in a PrefixCache (engine/prefix_cache.py):
a new sequence starts with the cached blocks of its longest cached prefix, shared with whoever
holds them, and a cached block nobody holds stays in the pool's free count but keeps its KV until
an allocation needs it (least recently used first). Shared blocks are always full and computed,
so no step ever writes into a block another sequence reads.
"""

from __future__ import annotations

from collections import deque

from iterserve.engine.prefix_cache import PrefixCache, hash_block_tokens
from iterserve.engine.sequence import Sequence


class BlockPool:
    """Blocks and their reference counts. A block is held (count > 0), cached and unheld (count 0,
    in the prefix cache's LRU) or free (count 0, on the free list)."""

    def __init__(self, num_blocks: int, cache: PrefixCache | None = None):
        self.num_blocks = num_blocks
        self.cache = cache
        self._free: deque[int] = deque(range(num_blocks))
        self._refs = [0] * num_blocks
        self._num_held = 0

    @property
    def num_free(self) -> int:
        """Blocks an allocation may take: free ones plus cached ones nobody holds."""
        return len(self._free) + (self.cache.num_evictable if self.cache else 0)

    @property
    def num_used(self) -> int:
        """Blocks some sequence holds (a shared block counts once)."""
        return self._num_held

    @property
    def num_cached_free(self) -> int:
        return self.cache.num_evictable if self.cache else 0

    def refcount(self, block: int) -> int:
        return self._refs[block]

    def free_blocks(self) -> list[int]:
        return list(self._free)

    def take(self, count: int) -> list[int]:
        """Fresh blocks, held once each; plain free blocks first, then evicted cached ones."""
        if count > self.num_free:
            raise RuntimeError(f"asked for {count} blocks, {self.num_free} free")
        blocks = [self._free.popleft() if self._free else self.cache.evict() for _ in range(count)]
        for block in blocks:
            self._refs[block] = 1
        self._num_held += count
        return blocks

    def share(self, blocks: list[int]) -> None:
        """Hold already-filled blocks once more (prefix cache hits)."""
        for block in blocks:
            if self._refs[block] == 0:
                self.cache.unpark(block)
                self._num_held += 1
            self._refs[block] += 1

    def give_back(self, blocks: list[int]) -> None:
        # Last block first, so a sequence's tail is evicted before the prefix others may share.
        for block in reversed(blocks) if self.cache is not None else blocks:
            if self._refs[block] <= 0:
                raise RuntimeError(f"block {block} freed more often than it was taken (double free)")
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self._num_held -= 1
                if self.cache is not None and self.cache.is_cached(block):
                    self.cache.park(block)
                else:
                    self._free.append(block)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, num_cpu_blocks: int = 0, watermark: float = 0.0,
                 enable_prefix_caching: bool = False):
        self.block_size = block_size
        self.prefix_cache = PrefixCache() if enable_prefix_caching else None
        self.gpu = BlockPool(num_blocks, self.prefix_cache)
        self.cpu = BlockPool(num_cpu_blocks)
        self.watermark_blocks = int(watermark * num_blocks)

    @property
    def num_blocks(self) -> int:
        return self.gpu.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.gpu.num_free

    @property
    def num_cached_blocks(self) -> int:
        """Cached blocks no sequence holds: counted free, but still holding reusable KV."""
        return self.gpu.num_cached_free

    def usage(self) -> float:
        """Fraction of blocks running sequences hold; cached unheld blocks do not count."""
        return self.gpu.num_used / self.gpu.num_blocks if self.gpu.num_blocks else 0.0

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def new_blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        needed = self.blocks_for(seq.num_computed_tokens + num_new_tokens)
        return max(0, needed - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_new_tokens: int, keep_watermark: bool = False,
                     prefix: list[int] | None = None) -> bool:
        """Whether seq can grow by num_new_tokens; for a sequence without blocks, `prefix` is the
        cached blocks it would start with (match_prefix), computed num_new_tokens after them."""
        reserve = self.watermark_blocks if keep_watermark else 0
        if not prefix:
            return self.new_blocks_needed(seq, num_new_tokens) <= self.gpu.num_free - reserve
        fresh = self.blocks_for(len(prefix) * self.block_size + num_new_tokens) - len(prefix)
        unheld = sum(1 for block in prefix if self.gpu.refcount(block) == 0)  # counted free until shared
        return fresh + unheld <= self.gpu.num_free - reserve

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow seq's block table to hold its computed tokens plus num_new_tokens."""
        seq.block_table.extend(self.gpu.take(self.new_blocks_needed(seq, num_new_tokens)))

    def truncate(self, seq: Sequence) -> None:
        """Speculative decoding's rollback: give back the blocks past seq's computed tokens (they held
        only rejected proposals' KV, never named in the prefix cache)."""
        keep = self.blocks_for(seq.num_computed_tokens)
        if len(seq.block_table) > keep:
            self.gpu.give_back(seq.block_table[keep:])
            del seq.block_table[keep:]

    def pin(self, blocks: list[int]) -> None:
        """Hold blocks once more for a KV transfer lease (engine/kv_transfer): they outlive the
        sequence that filled them, and no preemption can take them (they belong to no sequence)."""
        self.gpu.share(blocks)

    def unpin(self, blocks: list[int]) -> None:
        """A lease ended (released, expired or aborted): drop its hold."""
        self.gpu.give_back(blocks)

    def free(self, seq: Sequence) -> None:
        self.gpu.give_back(seq.block_table)
        seq.block_table = []
        seq.num_cached_blocks = 0
        self.cpu.give_back(seq.cpu_block_table)
        seq.cpu_block_table = []

    # -- prefix caching ----------------------------------------------------------------------
    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding the longest block-aligned prefix of seq's tokens, leaving at least
        one token to compute (the step must sample from something). Changes nothing."""
        if self.prefix_cache is None or seq.params.skip_prefix_cache:
            return []
        return self.prefix_cache.match(self._block_hashes(seq, (seq.num_tokens - 1) // self.block_size))

    def start_with_prefix(self, seq: Sequence, prefix: list[int]) -> None:
        """Admit seq (no blocks yet) with the cached prefix blocks from match_prefix."""
        self.gpu.share(prefix)
        seq.block_table = list(prefix)
        seq.num_computed_tokens = len(prefix) * self.block_size
        seq.num_cached_blocks = len(prefix)
        if self.prefix_cache is not None and not seq.params.skip_prefix_cache:
            self.prefix_cache.record(seq.num_tokens, seq.num_computed_tokens)

    def cache_computed_blocks(self, seq: Sequence) -> None:
        """Name seq's blocks that are now full and computed, so later sequences can share them.
        Called after each step that advanced seq."""
        if self.prefix_cache is None or seq.params.skip_prefix_cache:
            return
        kv = seq.kv_transfer
        if kv is not None and kv.loaded and not kv.remote_prefill.authenticated:
            return  # KV from a peer that did not prove it is one of ours would poison every user's prefix
        num_full = seq.num_computed_tokens // self.block_size
        if num_full <= seq.num_cached_blocks:
            return
        hashes = self._block_hashes(seq, num_full)
        for i in range(seq.num_cached_blocks, num_full):
            self.prefix_cache.insert(seq.block_table[i], hashes[i])
        seq.num_cached_blocks = num_full

    def _block_hashes(self, seq: Sequence, num_blocks: int) -> list[int]:
        """seq's chained block hashes, extended to at least num_blocks (tokens only grow)."""
        hashes, size = seq.block_hashes, self.block_size
        salt = seq.params.cache_salt
        # KV computed under an adapter is that adapter's: its name enters the first block's hash
        first = tuple(key for key in (salt, None if seq.lora_name is None else f"lora:{seq.lora_name}") if key is not None)
        while len(hashes) < num_blocks:
            i = len(hashes)
            extra = first if i == 0 else ()
            hashes.append(hash_block_tokens(hashes[-1] if hashes else None, seq.token_slice(i * size, (i + 1) * size),
                                            extra))
        return hashes

    # -- swapping ----------------------------------------------------------------------------
    def can_swap_out(self, seq: Sequence) -> bool:
        return len(seq.block_table) <= self.cpu.num_free

    def swap_out(self, seq: Sequence) -> list[tuple[int, int]]:
        """Move seq's KV blocks to the CPU pool; returns (gpu_block, cpu_block) copies to make.
        Shared GPU blocks stay with their other holders; seq just drops its reference."""
        cpu_blocks = self.cpu.take(len(seq.block_table))
        mapping = list(zip(seq.block_table, cpu_blocks, strict=True))
        self.gpu.give_back(seq.block_table)
        seq.block_table, seq.cpu_block_table = [], cpu_blocks
        seq.num_cached_blocks = 0  # the swapped-in copies get named again after the next step
        return mapping

    def can_swap_in(self, seq: Sequence, keep_watermark: bool = True) -> bool:
        reserve = self.watermark_blocks if keep_watermark else 0
        return len(seq.cpu_block_table) + 1 <= self.gpu.num_free - reserve

    def swap_in(self, seq: Sequence) -> list[tuple[int, int]]:
        """Bring seq's KV back from the CPU pool; returns (cpu_block, gpu_block) copies to make."""
        gpu_blocks = self.gpu.take(len(seq.cpu_block_table))
        mapping = list(zip(seq.cpu_block_table, gpu_blocks, strict=True))
        self.cpu.give_back(seq.cpu_block_table)
        seq.cpu_block_table, seq.block_table = [], gpu_blocks
        return mapping
