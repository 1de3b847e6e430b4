"""The mixture-of-experts feed-forward block: top-k routing and the experts grouped by expert.

In: the normed hidden states x [T, hidden] of a flat batch, the router weight [E, hidden] and the
experts' fused weights (gate_up [E, 2 * I, hidden], down [E, hidden, I]). Out: [T, hidden], the
routing-weighted sum of each token's top-k experts (plus a shared expert where the family has one).

Routing follows the reference exactly: the router logits come from a matmul in the model's dtype,
their softmax is taken in float32, the top k of those probabilities pick the experts, and
(where the family says so) the k weights are renormalised to sum to one before they are cast
back to the model's dtype.

The experts run grouped by expert: the (token, slot) pairs are sorted by expert id and each expert
that any token chose runs once, over all of its tokens, so its weights are read once per step. The
torch path here is the CPU path and the reference; the Triton kernel (engine/kernels/moe.py) is the
same computation as two grouped GEMMs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True, slots=True)
class MoeSettings:
    """A mixture-of-experts model's expert layout (ModelConfig.moe)."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    normalize_top_k: bool  # renormalise the k routing weights to sum to 1
    sparse_layers: tuple[bool, ...]  # per layer: experts (True) or a dense MLP of intermediate_size

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok must be 1..num_experts ({self.num_experts}); got {self.top_k}")


@dataclass(slots=True)
class SharedExpert:
    """An expert every token runs, scaled by sigmoid(gate . x) when the family has that gate."""

    gate_up: torch.Tensor  # [2 * I_shared, hidden]
    down: torch.Tensor  # [hidden, I_shared]
    gate: torch.Tensor | None = None  # [1, hidden]


@dataclass(slots=True)
class MoeWeights:
    router: torch.Tensor  # [E, hidden]
    gate_up: torch.Tensor  # [E, 2 * I, hidden]: gate rows, then up rows
    down: torch.Tensor  # [E, hidden, I]
    top_k: int
    normalize_top_k: bool
    shared: SharedExpert | None = None

    @property
    def num_experts(self) -> int:
        return self.gate_up.shape[0]


def route(x: torch.Tensor, router: torch.Tensor, top_k: int,
          normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] in x's dtype, expert ids [T, k] int64), as Qwen3-MoE's router computes them."""
    logits = F.linear(x, router)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(x.dtype), ids


def experts_grouped(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor,
                    ids: torch.Tensor, act_and_mul: Callable[[torch.Tensor], torch.Tensor],
                    linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.linear) -> torch.Tensor:
    """sum over k of weights[t, k] * expert_{ids[t, k]}(x[t]), each chosen expert run once over
    all of its tokens. act_and_mul maps [n, 2 * I] (gate, up) to [n, I]."""
    num_tokens, top_k = ids.shape
    out = torch.zeros_like(x)
    if not num_tokens:
        return out
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
    flat_weights = weights.reshape(-1)
    start = 0
    for expert, count in enumerate(counts):
        if not count:
            continue
        pairs = order[start:start + count]
        start += count
        tokens = pairs // top_k
        hidden = act_and_mul(linear(x.index_select(0, tokens), gate_up[expert]))
        y = linear(hidden, down[expert]) * flat_weights.index_select(0, pairs)[:, None]
        out.index_add_(0, tokens, y)
    return out


def shared_expert(x: torch.Tensor, shared: SharedExpert, act_and_mul: Callable[[torch.Tensor], torch.Tensor],
                  linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.linear) -> torch.Tensor:
    y = linear(act_and_mul(linear(x, shared.gate_up)), shared.down)
    if shared.gate is not None:
        y = torch.sigmoid(linear(x, shared.gate)) * y
    return y


def moe_forward(x: torch.Tensor, moe: MoeWeights, act_and_mul: Callable[[torch.Tensor], torch.Tensor],
                experts: Callable[..., torch.Tensor] | None = None,
                linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.linear) -> torch.Tensor:
    """The whole block. experts replaces experts_grouped (the Triton kernel's launcher has its
    signature less `linear`)."""
    weights, ids = route(x, moe.router, moe.top_k, moe.normalize_top_k)
    if experts is None:
        out = experts_grouped(x, moe.gate_up, moe.down, weights, ids, act_and_mul, linear)
    else:
        out = experts(x, moe.gate_up, moe.down, weights, ids, act_and_mul)
    if moe.shared is not None:
        out = out + shared_expert(x, moe.shared, act_and_mul, linear)
    return out
