"""Fused mixture-of-experts: the experts of a flat batch as two GEMMs grouped by expert.

The T * k (token, slot) pairs of a step are sorted by the expert they chose, and each expert's run
of pairs is padded to a multiple of BLOCK_M, so every block of BLOCK_M rows belongs to one expert
(`align`). One program computes a BLOCK_M x BLOCK_N tile of one block: it gathers its rows of the
input and streams that expert's weight tile, so an expert's weights are read once per block of its
tokens rather than once per token. The first GEMM maps each pair's token to its gate/up rows
[T * k, 2 * I]; SiLU-and-mul (or the family's activation) gives [T * k, I]; the second GEMM maps
each pair's row through its expert's down projection and scales it by the pair's routing weight;
the k rows of a token are then summed. Torch reference: engine/model/moe.py experts_grouped.

The layout is built with device-side torch ops only (no host sync): the padded length has the
upper bound T * k + E * (BLOCK_M - 1), and blocks past the last expert's run exit at once.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from iterserve.engine.kernels.common import dot_precision


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, w_ptr, out_ptr, sorted_pairs_ptr, block_experts_ptr, pair_weights_ptr,
    num_pairs, n, k, num_experts,
    stride_am, stride_we, stride_wn, stride_wk, stride_om,
    TOP_K: tl.constexpr, ROWS_PER_PAIR: tl.constexpr, MUL_WEIGHT: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """out[pair, :] = a[row(pair), :] @ w[expert(block)].T (times the pair's weight), for the
    pairs of one block; row(pair) is the pair itself (ROWS_PER_PAIR) or its token, pair // TOP_K."""
    pid_m = tl.program_id(0)
    expert = tl.load(block_experts_ptr + pid_m)
    if expert >= num_experts:  # a padding block past the last expert's run
        return
    pairs = tl.load(sorted_pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pairs < num_pairs
    if ROWS_PER_PAIR:
        rows = pairs
    else:
        rows = pairs // TOP_K
    rows64 = tl.where(valid, rows, 0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    inner = tl.arange(0, BLOCK_K)
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        kk = k0 + inner
        a = tl.load(a_ptr + rows64[:, None] * stride_am + kk[None, :],
                    mask=valid[:, None] & (kk < k)[None, :], other=0.0)
        w = tl.load(w_base + cols[None, :].to(tl.int64) * stride_wn + kk[:, None] * stride_wk,
                    mask=(kk < k)[:, None] & (cols < n)[None, :], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
    if MUL_WEIGHT:
        # as the reference: the expert's output in the model's dtype, then times the weight
        out = acc.to(out_ptr.dtype.element_ty)
        scale = tl.load(pair_weights_ptr + tl.where(valid, pairs, 0), mask=valid, other=0.0)
        out = out * scale[:, None]
    else:
        out = acc
    out_rows = tl.where(valid, pairs, 0).to(tl.int64)
    tl.store(out_ptr + out_rows[:, None] * stride_om + cols[None, :], out.to(out_ptr.dtype.element_ty),
             mask=valid[:, None] & (cols < n)[None, :])


def block_m_for(num_pairs: int, num_experts: int) -> int:
    """Rows per block: small when each expert sees few tokens (decode), larger for prefill."""
    per_expert = num_pairs / max(num_experts, 1)
    return 16 if per_expert <= 16 else 32 if per_expert <= 64 else 64


def align(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_pairs [padded], block_experts [padded / block_m]) for ids [T, k].

    sorted_pairs lists the pair indices (t * k + slot) expert by expert, each expert's run padded to
    a multiple of block_m with T * k (no pair); block_experts[b] is block b's expert, num_experts
    for the blocks past the last run."""
    flat = ids.reshape(-1)
    num_pairs = flat.numel()
    max_len = num_pairs + num_experts * (block_m - 1)
    max_blocks = triton.cdiv(max_len, block_m)
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)
    experts_sorted = flat[order]
    rank = torch.arange(num_pairs, device=flat.device) - start[experts_sorted]
    sorted_pairs = torch.full((max_blocks * block_m,), num_pairs, dtype=torch.int64, device=flat.device)
    sorted_pairs[padded_start[experts_sorted] + rank] = order
    block_starts = torch.arange(max_blocks, device=flat.device) * block_m
    block_experts = torch.searchsorted(padded_end, block_starts, right=True)
    return sorted_pairs, block_experts


def _grouped_gemm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, sorted_pairs: torch.Tensor,
                  block_experts: torch.Tensor, pair_weights: torch.Tensor, num_pairs: int, top_k: int,
                  rows_per_pair: bool, block_m: int) -> None:
    n, k = w.shape[1], w.shape[2]
    block_n = 64 if n >= 64 else max(16, triton.next_power_of_2(n))
    block_k = 32 if k >= 32 else 16
    grid = (block_experts.shape[0], triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](
        a, w, out, sorted_pairs, block_experts, pair_weights,
        num_pairs, n, k, w.shape[0],
        a.stride(0), w.stride(0), w.stride(1), w.stride(2), out.stride(0),
        TOP_K=top_k, ROWS_PER_PAIR=rows_per_pair, MUL_WEIGHT=rows_per_pair,
        PRECISION=dot_precision(a.dtype), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )


def fused_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
                  ids: torch.Tensor, act_and_mul: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """x [T, hidden]; gate_up [E, 2 * I, hidden]; down [E, hidden, I]; weights, ids [T, k]
    -> [T, hidden]. Contiguous last dims; x, gate_up, down and weights in one dtype."""
    num_tokens, top_k = ids.shape
    num_experts, hidden = gate_up.shape[0], x.shape[1]
    num_pairs = num_tokens * top_k
    if not num_pairs:
        return torch.zeros_like(x)
    block_m = block_m_for(num_pairs, num_experts)
    sorted_pairs, block_experts = align(ids, num_experts, block_m)
    pair_weights = weights.reshape(-1).contiguous()
    gate_up_out = torch.empty((num_pairs, gate_up.shape[1]), dtype=x.dtype, device=x.device)
    _grouped_gemm(x, gate_up, gate_up_out, sorted_pairs, block_experts, pair_weights, num_pairs, top_k,
                  rows_per_pair=False, block_m=block_m)
    act = act_and_mul(gate_up_out).contiguous()
    down_out = torch.empty((num_pairs, hidden), dtype=x.dtype, device=x.device)
    _grouped_gemm(act, down, down_out, sorted_pairs, block_experts, pair_weights, num_pairs, top_k,
                  rows_per_pair=True, block_m=block_m)
    return down_out.view(num_tokens, top_k, hidden).sum(dim=1)
