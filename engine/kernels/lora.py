"""The batched LoRA op: out[rows] += x[rows] @ A[slot] @ B[slot] * scale[slot], segmented by adapter.

In: a step's flat activations x [T, K] and the base linear's output out [T, N]; the adapter slot
pool's stacked weights A [S, K, R] and B [S, R, N] (R the pool's rank; a smaller adapter's rank is
zero-padded, which adds nothing) and scales [S]; the step's segments, runs of consecutive rows of
one adapter (start, length, slot). Rows of no segment (the base model's) are left as they are.
Out: out, updated in place (Punica / S-LoRA's segmented gather matmul, shrink then expand).

Three paths compute the same thing: `lora_add_reference` (a per-row gather and two bmm: the
specification the others are tested against), `lora_add_torch` (two matmuls per segment: the CPU
path) and `lora_add_triton` (one program per segment and column block: the CUDA path, tested on
the Triton interpreter). `lora_add` picks by device.
"""

from __future__ import annotations

import torch

Segments = tuple[list[int], list[int], list[int]]  # (starts, lengths, slots), one entry per segment


def segments_of(row_slots: list[int]) -> Segments:
    """The runs of equal slots of each row's slot (-1: no adapter, not a segment)."""
    starts: list[int] = []
    lengths: list[int] = []
    slots: list[int] = []
    for row, slot in enumerate(row_slots):
        if slots and slots[-1] == slot and starts[-1] + lengths[-1] == row:
            lengths[-1] += 1
        elif slot >= 0:
            starts.append(row)
            lengths.append(1)
            slots.append(slot)
    return starts, lengths, slots


def lora_add_reference(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scales: torch.Tensor,
                       segments: Segments) -> torch.Tensor:
    """Every row of a segment gathers its slot's A and B (bmm over rows), in fp32."""
    starts, lengths, slots = segments
    for start, length, slot in zip(starts, lengths, slots, strict=True):
        rows = slice(start, start + length)
        idx = torch.full((length,), slot, dtype=torch.long, device=x.device)
        shrunk = torch.bmm(x[rows].float().unsqueeze(1), a[idx].float())  # [L, 1, R]
        delta = torch.bmm(shrunk, b[idx].float()).squeeze(1) * scales[idx].float().unsqueeze(1)
        out[rows] += delta.to(out.dtype)
    return out


def lora_add_torch(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scales: torch.Tensor,
                   segments: Segments) -> torch.Tensor:
    """Two matmuls per segment, in the activations' dtype (the CPU path)."""
    starts, lengths, slots = segments
    for start, length, slot in zip(starts, lengths, slots, strict=True):
        rows = slice(start, start + length)
        out[rows] += (x[rows] @ a[slot]) @ b[slot] * scales[slot]
    return out


def lora_add(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scales: torch.Tensor,
             segments: Segments) -> torch.Tensor:
    if not segments[0]:
        return out
    if x.device.type == "cuda":
        return lora_add_triton(out, x, a, b, scales, segments)
    return lora_add_torch(out, x, a, b, scales, segments)


try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only install: the torch path serves
    triton = None

if triton is not None:
    from iterserve.engine.kernels.common import dot_precision, next_pow2

    @triton.jit
    def _lora_kernel(
        x_ptr, out_ptr, a_ptr, b_ptr, scale_ptr, seg_start_ptr, seg_len_ptr, seg_slot_ptr,
        K, N, R, stride_x, stride_out, stride_as, stride_ak, stride_bs, stride_br,
        BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        seg = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        start = tl.load(seg_start_ptr + seg)
        length = tl.load(seg_len_ptr + seg)
        slot = tl.load(seg_slot_ptr + seg).to(tl.int64)
        scale = tl.load(scale_ptr + slot).to(tl.float32)
        ranks = tl.arange(0, BLOCK_R)
        a_base = a_ptr + slot * stride_as
        b_tile = tl.load(b_ptr + slot * stride_bs + ranks[:, None] * stride_br + cols[None, :],
                         mask=(ranks < R)[:, None] & (cols < N)[None, :], other=0.0).to(tl.float32)
        for m in range(0, length, BLOCK_M):
            rows = start + m + tl.arange(0, BLOCK_M)
            row_mask = rows < start + length
            rows64 = rows.to(tl.int64)
            shrunk = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
            for k in range(0, K, BLOCK_K):
                ks = k + tl.arange(0, BLOCK_K)
                x_tile = tl.load(x_ptr + rows64[:, None] * stride_x + ks[None, :],
                                 mask=row_mask[:, None] & (ks < K)[None, :], other=0.0).to(tl.float32)
                a_tile = tl.load(a_base + ks[:, None] * stride_ak + ranks[None, :],
                                 mask=(ks < K)[:, None] & (ranks < R)[None, :], other=0.0).to(tl.float32)
                shrunk += tl.dot(x_tile, a_tile, input_precision=PRECISION)
            delta = tl.dot(shrunk, b_tile, input_precision=PRECISION) * scale
            dst = out_ptr + rows64[:, None] * stride_out + cols[None, :]
            mask = row_mask[:, None] & (cols < N)[None, :]
            old = tl.load(dst, mask=mask, other=0.0).to(tl.float32)
            tl.store(dst, (old + delta).to(out_ptr.dtype.element_ty), mask=mask)

    def lora_add_triton(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                        scales: torch.Tensor, segments: Segments) -> torch.Tensor:
        """One program per (segment, column block); rows in tiles of 16, the shrink accumulated
        over K in fp32 and kept in registers for the expand. Each row is in one segment and each
        column in one block, so no two programs write the same element."""
        starts, lengths, slots = segments
        if not starts:
            return out
        assert x.stride(1) == 1 and out.stride(1) == 1 and a.stride(2) == 1 and b.stride(2) == 1
        num_k, rank, num_n = a.shape[1], a.shape[2], b.shape[2]
        meta = torch.tensor([starts, lengths, slots], dtype=torch.int32, device=x.device)
        block_n = min(128, next_pow2(max(num_n, 16)))
        grid = (len(starts), triton.cdiv(num_n, block_n))
        _lora_kernel[grid](
            x, out, a, b, scales, meta[0], meta[1], meta[2],
            num_k, num_n, rank, x.stride(0), out.stride(0), a.stride(0), a.stride(1), b.stride(0), b.stride(1),
            BLOCK_M=16, BLOCK_K=32, BLOCK_R=next_pow2(max(rank, 16)), BLOCK_N=block_n,
            PRECISION=dot_precision(x.dtype),
        )
        return out
else:  # pragma: no cover
    def lora_add_triton(*args, **kwargs):
        raise RuntimeError("the Triton LoRA kernel needs triton installed")
