"""Proposers: where the guessed tokens come from.

The interface (Proposer) is one batched call per step, on the engine thread, before scheduling:
`propose(seqs, num_tokens)` gets the decoding sequences allowed to speculate and, per sequence,
the most tokens it may propose; it returns one Proposal per sequence (tokens may be fewer, or
none). `release(request_ids)` drops any per-request state (a draft model's KV) of finished
requests.

A proposal's `probs` is the distribution each token was drawn from ([len(tokens), vocab]), or
None when the proposer is deterministic (a point mass on each token: n-gram, a greedy draft). The
verifier uses it for rejection sampling (engine/spec_decode/rejection.py).

Seam for EAGLE-style heads: such a head proposes from the target's own last hidden states rather
than from tokens. It implements the same interface; the model runner would keep each decoding
sequence's last hidden state (ModelRunner._forward's `hidden` rows of the sampled positions) and
hand it over through `Proposer.observe_hidden(seqs, hidden)`, a no-op here, called after every
step that sampled. Nothing else changes: verification, rollback and policy are the proposer's
callers'.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Any

from iterserve.engine.sequence import Sequence


@dataclass(slots=True)
class Proposal:
    tokens: list[int]
    probs: Any = None  # torch.Tensor [len(tokens), vocab] for sampled draft tokens, else None


class Proposer:
    """Base class; see the module docstring for the contract."""

    name = "none"

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[Proposal]:
        raise NotImplementedError

    def observe_hidden(self, seqs: list[Sequence], hidden) -> None:  # the EAGLE seam
        pass

    def release(self, request_ids: list[str]) -> None:
        pass


class NgramProposer(Proposer):
    """Prompt lookup: the longest n-gram (n from prompt_lookup_max down to prompt_lookup_min) ending
    the sequence's tokens that also occurs earlier in its prompt or output; the tokens that followed
    its most recent earlier occurrence are the proposal. Searches run in C (bytes.rfind), and only
    the last `max_lookback` tokens are searched, so a step's cost is bounded per sequence."""

    name = "ngram"

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int, max_lookback: int = 4096):
        self.min_n, self.max_n, self.max_lookback = prompt_lookup_min, prompt_lookup_max, max_lookback

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[Proposal]:
        return [Proposal(self.lookup(seq.prompt_token_ids + seq.output_token_ids, k)) for seq, k in
                zip(seqs, num_tokens, strict=True)]

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        tokens = tokens[-self.max_lookback:]
        length = len(tokens)
        if k <= 0 or length < self.min_n + 1:
            return []
        data = array("i", tokens).tobytes()
        width = array("i").itemsize
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            suffix = data[(length - n) * width:]
            end = (length - 1) * width  # the match must end before the last token: a continuation exists
            while True:
                at = data.rfind(suffix, 0, end)
                if at < 0:
                    break
                if at % width == 0:
                    start = at // width + n
                    return tokens[start : start + k]
                end = at + len(suffix) - 1
        return []
