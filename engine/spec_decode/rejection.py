"""Verifying one position of a proposal: the speculative sampling rule (Leviathan et al. 2023,
Chen et al. 2023).

With p the target's distribution at the position (after every logits processor, temperature,
top-k/top-p and min_p) and q the distribution the proposed token d was drawn from: accept d with
probability min(1, p(d) / q(d)); otherwise draw from the residual max(0, p - q), normalised. The
emitted token is then distributed exactly as p. A deterministic proposer (n-gram, greedy draft) has
q a point mass on d: accept with probability p(d), else draw from p with d removed. Greedy requests
need no randomness: d is kept iff it is p's argmax, and the argmax is emitted otherwise.
"""

from __future__ import annotations

import torch

# Tests turn this off to show that the distribution check catches a verifier without the residual.
USE_RESIDUAL = True


def verify_position(probs: torch.Tensor, token: int, draft_probs: torch.Tensor | None,
                    generator: torch.Generator) -> tuple[int, bool]:
    """(emitted token, whether it is the proposal) for one sampled row: probs [vocab] (sums to 1)."""
    p_token = float(probs[token])
    q_token = 1.0 if draft_probs is None else float(draft_probs[token])
    uniform = float(torch.rand((), generator=generator, device=generator.device))
    if q_token > 0 and uniform < p_token / q_token:
        return token, True
    if not USE_RESIDUAL:
        residual = probs
    elif draft_probs is None:
        residual = probs.clone()
        residual[token] = 0
    else:
        residual = (probs - draft_probs).clamp_min_(0)
    if float(residual.sum()) <= 0:  # p == q (or p a point mass on d): nothing left to correct
        residual = probs
    return int(torch.multinomial(residual, 1, generator=generator)), False


def sample_position(probs: torch.Tensor, generator: torch.Generator) -> int:
    """The bonus token after every proposal was accepted: a plain draw from p."""
    return int(torch.multinomial(probs, 1, generator=generator))
