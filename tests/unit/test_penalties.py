"""Logits processing (engine/penalties.py) against transformers' own logits processors on the same
logits, batched over rows that each ask for something different."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from iterserve.engine.penalties import apply_min_p, process_logits, token_counts
from iterserve.engine.sampler import Sampler
from iterserve.engine.sampling_params import InvalidRequestError, SamplingParams
from iterserve.engine.sequence import Sequence

VOCAB, EOS = 64, 2


def make_seq(prompt: list[int], output: list[int], **params) -> Sequence:
    seq = Sequence("r", list(prompt), SamplingParams(max_tokens=50, **params), arrival_time=0.0, eos_token_id=EOS)
    seq.output_token_ids = list(output)
    return seq


def random_logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


PROMPTS = [[5, 6, 7, 7], [9, 10], [11, 12, 13], [1, 2, 3, 4]]
OUTPUTS = [[7, 8, 8, 20], [10, 10, 10], [], [30, 31, 30]]


def hf(processor, seq: Sequence, row: torch.Tensor) -> torch.Tensor:
    ids = torch.tensor([seq.prompt_token_ids + seq.output_token_ids])
    return processor(ids, row.unsqueeze(0).clone())[0]


def test_repetition_penalty_equals_hf_per_row_in_one_batch():
    logits = random_logits(4)
    penalties = [1.3, 0.7, 1.0, 2.0]
    seqs = [make_seq(p, o, repetition_penalty=r) for p, o, r in zip(PROMPTS, OUTPUTS, penalties, strict=True)]
    out = process_logits(logits, seqs)
    for row, (seq, r) in enumerate(zip(seqs, penalties, strict=True)):
        expected = hf(RepetitionPenaltyLogitsProcessor(r), seq, logits[row]) if r != 1.0 else logits[row]
        torch.testing.assert_close(out[row], expected, rtol=0, atol=1e-6)
    assert not torch.equal(out[0], logits[0])  # it did something


def test_logit_bias_equals_hf_sequence_bias():
    logits = random_logits(2, seed=1)
    bias = {3: 5.0, 17: -100.0, 40: 0.25}
    seqs = [make_seq(PROMPTS[0], OUTPUTS[0], logit_bias=bias), make_seq(PROMPTS[1], OUTPUTS[1])]
    out = process_logits(logits, seqs)
    processor = SequenceBiasLogitsProcessor([[[t], b] for t, b in bias.items()])
    torch.testing.assert_close(out[0], hf(processor, seqs[0], logits[0]), rtol=0, atol=1e-5)
    assert torch.equal(out[1], logits[1])


def test_min_tokens_equals_hf_min_new_tokens():
    logits = random_logits(3, seed=2)
    seqs = [make_seq(PROMPTS[i], OUTPUTS[i], min_tokens=3, stop_token_ids=[9] if i == 2 else []) for i in range(3)]
    out = process_logits(logits, seqs)
    for row, seq in enumerate(seqs):
        eos = [EOS, 9] if row == 2 else [EOS]
        processor = MinNewTokensLengthLogitsProcessor(len(seq.prompt_token_ids), 3, eos)
        torch.testing.assert_close(out[row], hf(processor, seq, logits[row]))
    assert torch.isfinite(out[0, EOS]) and out[2, EOS] == float("-inf") and out[2, 9] == float("-inf")


def test_frequency_and_presence_penalties_follow_openais_formula():
    logits = random_logits(4, seed=3)
    settings = [(0.5, 0.0), (0.0, 1.5), (-0.5, 0.3), (2.0, 2.0)]
    seqs = [make_seq(p, o, frequency_penalty=f, presence_penalty=pr)
            for p, o, (f, pr) in zip(PROMPTS, OUTPUTS, settings, strict=True)]
    out = process_logits(logits, seqs)
    for row, (seq, (f, pr)) in enumerate(zip(seqs, settings, strict=True)):
        expected = logits[row].clone()
        for token in set(seq.output_token_ids):  # the documented formula, token by token
            expected[token] -= f * seq.output_token_ids.count(token) + pr
        torch.testing.assert_close(out[row], expected, rtol=0, atol=1e-6)


def test_min_p_equals_hf_min_p_warper():
    logits = random_logits(3, seed=4)
    values = [0.05, 0.3, 0.9]
    out = apply_min_p(logits, values)
    for row, m in enumerate(values):
        torch.testing.assert_close(out[row], MinPLogitsWarper(m)(None, logits[row:row + 1].clone())[0])


def test_penalties_change_the_greedy_choice_and_leave_others_alone():
    logits = torch.zeros(2, VOCAB)
    logits[:, 8] = 5.0
    logits[:, 9] = 4.0
    seqs = [make_seq([1], [8, 8], repetition_penalty=2.0, temperature=0), make_seq([1], [8, 8], temperature=0)]
    tokens = Sampler(torch.device("cpu")).sample(logits, seqs)
    assert tokens == [9, 8]


def test_token_counts_is_one_scatter():
    counts = token_counts([[1, 1, 3], [], [63]], VOCAB, torch.device("cpu"))
    assert counts.shape == (3, VOCAB) and counts[0, 1] == 2 and counts[0, 3] == 1 and counts[1].sum() == 0
    assert counts[2, 63] == 1


@pytest.mark.parametrize(("field", "value"), [
    ("presence_penalty", 2.5), ("frequency_penalty", -3), ("repetition_penalty", 0), ("repetition_penalty", 5e-324), ("min_p", 1.5),
    ("min_tokens", 51), ("logit_bias", {1: 101.0}), ("logit_bias", {-1: 1.0}),
])
def test_out_of_range_values_are_refused(field, value):
    with pytest.raises(InvalidRequestError) as error:
        SamplingParams(max_tokens=50, **{field: value})
    assert error.value.param == field


def test_a_bias_outside_the_vocabulary_fails_only_its_request():
    logits = random_logits(2)
    seqs = [make_seq([1], [], logit_bias={VOCAB + 5: 1.0}), make_seq([1], [], temperature=0)]
    results = Sampler(torch.device("cpu")).sample(logits, seqs)
    assert type(results[0]).__name__ == "RequestFailed" and results[1] == int(logits[1].argmax())
