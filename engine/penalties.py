"""Per-request logits processing, batched over the rows that ask for it: logit_bias, min_tokens,
and the repetition, frequency and presence penalties (vLLM's order and formulas).

Every operation works on [rows, vocab] tensors: token histories become one padded index tensor
and one scatter_add, so the Python work per step is per token of history, never per vocabulary
entry.

- logit_bias: logits[t] += bias[t].
- min_tokens: while fewer tokens than min_tokens were generated, EOS (unless ignore_eos) and
  stop_token_ids are impossible (-inf).
- repetition_penalty r (HF's RepetitionPenaltyLogitsProcessor, CTRL): every token seen in the prompt
  or the output has its logit divided by r if positive, multiplied by r if negative.
- frequency_penalty f and presence_penalty p (OpenAI): logits[t] -= f * count[t] + p * (count[t] > 0),
  counting the generated tokens only.
- min_p m (applied by the sampler after temperature, top-k and top-p): tokens whose probability is
  below m times the most likely token's are dropped.
"""

from __future__ import annotations

import torch

from iterserve.engine.sequence import Sequence


def process_logits(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """logits [N, vocab] with each row's bias, min_tokens and penalties applied: a new tensor if any
    row asks for processing, else logits itself."""
    rows = [i for i, seq in enumerate(seqs) if seq.params.processes_logits]
    if not rows:
        return logits
    device, vocab = logits.device, logits.shape[1]
    logits = logits.clone()
    index = torch.tensor(rows, device=device)
    part = logits[index]
    chosen = [seqs[i] for i in rows]
    _apply_logit_bias(part, chosen)
    _apply_min_tokens(part, chosen)
    _apply_penalties(part, chosen, vocab)
    logits[index] = part
    return logits


def _apply_logit_bias(part: torch.Tensor, seqs: list[Sequence]) -> None:
    row_ids, token_ids, biases = [], [], []
    for row, seq in enumerate(seqs):
        for token, bias in (seq.params.logit_bias or {}).items():
            row_ids.append(row)
            token_ids.append(token)
            biases.append(bias)
    if row_ids:
        _check_ids(token_ids, part.shape[1], "logit_bias")
        part.index_put_((torch.tensor(row_ids, device=part.device), torch.tensor(token_ids, device=part.device)),
                        torch.tensor(biases, dtype=part.dtype, device=part.device), accumulate=True)


def _apply_min_tokens(part: torch.Tensor, seqs: list[Sequence]) -> None:
    row_ids, token_ids = [], []
    for row, seq in enumerate(seqs):
        params = seq.params
        if len(seq.output_token_ids) >= params.min_tokens:
            continue
        banned = set(params.stop_token_ids)
        if not params.ignore_eos and seq.eos_token_id is not None:
            banned.add(seq.eos_token_id)
        banned = [t for t in banned if t < part.shape[1]]
        row_ids += [row] * len(banned)
        token_ids += banned
    if row_ids:
        part[torch.tensor(row_ids, device=part.device), torch.tensor(token_ids, device=part.device)] = float("-inf")


def _apply_penalties(part: torch.Tensor, seqs: list[Sequence], vocab: int) -> None:
    device, dtype = part.device, part.dtype
    repetition = [row for row, seq in enumerate(seqs) if seq.params.repetition_penalty != 1.0]
    if repetition:
        seen = token_mask(
            [seqs[r].prompt_token_ids + seqs[r].output_token_ids for r in repetition], vocab, device)
        index = torch.tensor(repetition, device=device)
        sub = part[index]
        penalty = torch.tensor([seqs[r].params.repetition_penalty for r in repetition], dtype=dtype,
                               device=device).unsqueeze(1)
        penalized = torch.where(sub > 0, sub / penalty, sub * penalty)
        part[index] = torch.where(seen, penalized, sub)
    additive = [row for row, seq in enumerate(seqs) if seq.params.frequency_penalty or seq.params.presence_penalty]
    if additive:
        counts = token_counts([seqs[r].output_token_ids for r in additive], vocab, device).to(dtype)
        frequency = torch.tensor([seqs[r].params.frequency_penalty for r in additive], dtype=dtype, device=device)
        presence = torch.tensor([seqs[r].params.presence_penalty for r in additive], dtype=dtype, device=device)
        index = torch.tensor(additive, device=device)
        part[index] -= frequency.unsqueeze(1) * counts + presence.unsqueeze(1) * (counts > 0).to(dtype)


def token_counts(histories: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[len(histories), vocab] int32: how often each token occurs in each history (one scatter_add)."""
    width = max((len(h) for h in histories), default=0)
    counts = torch.zeros((len(histories), vocab + 1), dtype=torch.int32, device=device)
    if width:
        padded = torch.tensor([h + [vocab] * (width - len(h)) for h in histories], dtype=torch.long, device=device)
        _check_range(padded, vocab)
        counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.int32))
    return counts[:, :vocab]


def token_mask(histories: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    return token_counts(histories, vocab, device) > 0


def apply_min_p(logits: torch.Tensor, min_p: list[float]) -> torch.Tensor:
    """-inf for every token less likely than min_p times its row's most likely token."""
    probs = logits.softmax(dim=-1)
    threshold = torch.tensor(min_p, dtype=probs.dtype, device=probs.device).unsqueeze(1) * probs.amax(-1, keepdim=True)
    return logits.masked_fill(probs < threshold, float("-inf"))


def _check_ids(token_ids: list[int], vocab: int, field: str) -> None:
    bad = [t for t in token_ids if t >= vocab]
    if bad:
        raise ValueError(f"{field}: token id {bad[0]} is outside the model's vocabulary of {vocab}")


def _check_range(padded: torch.Tensor, vocab: int) -> None:
    if bool((padded > vocab).any()):
        raise ValueError(f"a token id is outside the model's vocabulary of {vocab}")
