"""Log-probabilities of chosen tokens and of each position's most likely tokens.

They are the model's own distribution: log_softmax of the raw logits, before penalties, bias,
temperature or top-k/top-p/min-p (vLLM's default, "raw_logprobs"), so they are comparable with any
other implementation of the model.

Generated tokens: the sampler records one TokenLogprob per sampled token on the sequence
(seq.logprobs) when the request asked for logprobs. Prompt tokens: the model runner records, for a
request with prompt_logprobs, the logprob of each prompt token given the ones before it
(seq.prompt_logprobs[i], None for the first token), from the prefill's hidden states.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # the n most likely (token id, logprob), best first


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, top_n: list[int]) -> list[TokenLogprob]:
    """One TokenLogprob per row of logits [R, vocab]: token_ids[r]'s logprob and the row's top_n[r]."""
    logprobs = logits.float().log_softmax(dim=-1)
    chosen = logprobs.gather(1, token_ids.long().unsqueeze(1)).squeeze(1).tolist()
    width = max(top_n, default=0)
    top_values = top_ids = None
    if width:
        top = logprobs.topk(min(width, logprobs.shape[1]), dim=-1)
        top_values, top_ids = top.values.tolist(), top.indices.tolist()
    out = []
    for row, token in enumerate(token_ids.tolist()):
        n = top_n[row]
        top_pairs = tuple(zip(top_ids[row][:n], top_values[row][:n], strict=True)) if n else ()
        out.append(TokenLogprob(token, chosen[row], top_pairs))
    return out


def record_prompt_logprobs(seq, start: int, logits: torch.Tensor) -> None:
    """logits [num_tokens, vocab] for positions start.. of seq's chunk; each predicts the next token.
    Records seq.prompt_logprobs for the prompt tokens they predict (by position: a recomputed chunk
    after preemption overwrites the same entries)."""
    prompt = seq.prompt_token_ids
    if seq.prompt_logprobs is None:
        seq.prompt_logprobs = [None] * len(prompt)
    positions = range(start + 1, min(start + logits.shape[0], len(prompt) - 1) + 1)
    if not positions:
        return
    rows = logits[: len(positions)]
    targets = torch.tensor([prompt[p] for p in positions], device=logits.device)
    n = seq.params.prompt_logprobs or 0
    for position, entry in zip(positions, token_logprobs(rows, targets, [n] * len(positions)), strict=True):
        seq.prompt_logprobs[position] = entry
