"""Paged KV cache bookkeeping: a free list of fixed-size blocks, per-sequence block tables, and a
CPU pool that preempted sequences can be swapped into. Pure Python: the tensors live in the
model runner, which copies blocks when the scheduler asks it to."""

from __future__ import annotations

from collections import deque

from iterserve.engine.sequence import Sequence


class BlockPool:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def take(self, count: int) -> list[int]:
        if count > len(self._free):
            raise RuntimeError(f"asked for {count} blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(count)]
        self._used.update(blocks)
        return blocks

    def give_back(self, blocks: list[int]) -> None:
        for block in blocks:
            self._used.remove(block)  # KeyError here means a double free
            self._free.append(block)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, num_cpu_blocks: int = 0, watermark: float = 0.0):
        self.block_size = block_size
        self.gpu = BlockPool(num_blocks)
        self.cpu = BlockPool(num_cpu_blocks)
        self.watermark_blocks = int(watermark * num_blocks)

    @property
    def num_blocks(self) -> int:
        return self.gpu.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.gpu.num_free

    def usage(self) -> float:
        return self.gpu.num_used / self.gpu.num_blocks if self.gpu.num_blocks else 0.0

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def new_blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        needed = self.blocks_for(seq.num_computed_tokens + num_new_tokens)
        return max(0, needed - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_new_tokens: int, keep_watermark: bool = False) -> bool:
        reserve = self.watermark_blocks if keep_watermark else 0
        return self.new_blocks_needed(seq, num_new_tokens) <= self.gpu.num_free - reserve

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow seq's block table to hold its computed tokens plus num_new_tokens."""
        seq.block_table.extend(self.gpu.take(self.new_blocks_needed(seq, num_new_tokens)))

    def free(self, seq: Sequence) -> None:
        self.gpu.give_back(seq.block_table)
        seq.block_table = []
        self.cpu.give_back(seq.cpu_block_table)
        seq.cpu_block_table = []

    def can_swap_out(self, seq: Sequence) -> bool:
        return len(seq.block_table) <= self.cpu.num_free

    def swap_out(self, seq: Sequence) -> list[tuple[int, int]]:
        """Move seq's KV blocks to the CPU pool; returns (gpu_block, cpu_block) copies to make."""
        cpu_blocks = self.cpu.take(len(seq.block_table))
        mapping = list(zip(seq.block_table, cpu_blocks, strict=True))
        self.gpu.give_back(seq.block_table)
        seq.block_table, seq.cpu_block_table = [], cpu_blocks
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
