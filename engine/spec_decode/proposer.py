"""Proposers: where the guessed tokens come from.

The interface (Proposer) is one batched call per step, on the engine thread, before scheduling:
`propose(seqs, num_tokens)` gets the decoding sequences allowed to speculate and, per sequence,
the most tokens it may propose; it returns one Proposal per sequence (tokens may be fewer, or
none). `release(request_ids)` drops any per-request state (a draft model's KV) of finished
requests.

A proposal's `probs` is the distribution each token was drawn from ([len(tokens), vocab]), or
None when the proposer is deterministic (a point mass on each token: n-gram, a greedy draft). The
verifier uses it for rejection sampling (engine/spec_decode/rejection.py).

The seam for EAGLE-style heads is HiddenStateProposer: a proposer that drafts from the target's
own hidden states rather than from tokens alone. It lives beside the model (the model runner's
`proposer`, as the draft model does) and sets `needs_hidden_states`; the model runner then calls
`observe_hidden(states)` after every step that sampled, before the scheduler appends the tokens,
with one HiddenStates per sampled sequence: the target's last-layer hidden states (after the final
norm, the LM head's input) at the rows whose logits were sampled, and the position of the first.
A plain decode or a prompt's last chunk gives one row; a verified chunk 1 + k rows, the states
after its last token and after each proposal. Which of those rows stay true is known at the next
`propose`: a sequence that had n tokens before the step accepted len(seq tokens) - n - 1
proposals, so rows 0..accepted are states of kept tokens and the rest are to be dropped. Nothing
else changes for such a head: verification, rollback, the policy and the metrics are its callers'.
(No EAGLE head is built; tests/unit/test_spec_decode_seams.py checks the seam's rows against the
logits the target sampled.)
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


@dataclass(slots=True)
class HiddenStates:
    """What a HiddenStateProposer sees of one sampled sequence after a step."""

    seq: Sequence
    first_position: int  # the position of rows[0]: the token whose state it is (it predicts first_position + 1)
    rows: Any  # torch.Tensor [n, hidden_size], on the model's device: n = 1, or 1 + k for a verified chunk


class Proposer:
    """Base class; see the module docstring for the contract."""

    name = "none"
    needs_hidden_states = False  # True: the model runner calls observe_hidden after every sampled step

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[Proposal]:
        raise NotImplementedError

    def observe_hidden(self, states: list[HiddenStates]) -> None:
        """The target's hidden states of this step's sampled rows (only with needs_hidden_states)."""

    def release(self, request_ids: list[str]) -> None:
        pass


class HiddenStateProposer(Proposer):
    """The seam for EAGLE-style heads (see the module docstring): propose() as every proposer, fed
    by the states observe_hidden received. Subclasses implement both."""

    needs_hidden_states = True

    def observe_hidden(self, states: list[HiddenStates]) -> None:
        raise NotImplementedError


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
