"""Speculative sampling keeps the output distribution: chi-square checks that fail when the residual
distribution is removed on purpose.

- The verification rule alone (engine/spec_decode/rejection.py), on random target and draft
  distributions over 6 tokens, for a sampled draft (q a distribution) and a point mass (n-gram).
- The whole engine on a tiny random Llama (tests/unit/tiny_llama.py): sampled next-token counts at
  output positions 1..3 with speculation equal those without it, with logit_bias restricting the
  vocabulary to 4 tokens and a frequency penalty whose state must advance token by token through
  the accepted proposals; proposals from a point-mass proposer and from a second tiny model as draft.
"""

from __future__ import annotations

import json
import random
from collections import Counter

import pytest
import torch

from iterserve.engine import LLM, SamplingParams
from iterserve.engine.spec_decode import rejection
from iterserve.engine.spec_decode.proposer import Proposal, Proposer
from tests.unit import tiny_llama as tiny

CHOICES = [40, 41, 42, 43]
NUM_REQUESTS = 1200


def p_value(table: list[Counter]) -> float:
    """Chi-square test that the rows of a contingency table (Counters over categories) share one
    distribution; with one row and `expected` probabilities, use goodness_of_fit."""
    categories = sorted(set().union(*table))
    totals = [sum(row.values()) for row in table]
    column = {c: sum(row[c] for row in table) for c in categories}
    grand = sum(totals)
    stat = sum((row[c] - totals[i] * column[c] / grand) ** 2 / (totals[i] * column[c] / grand)
               for i, row in enumerate(table) for c in categories)
    df = (len(table) - 1) * (len(categories) - 1)
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64))) if df else 1.0


def goodness_of_fit(counts: Counter, probs: torch.Tensor) -> float:
    n = sum(counts.values())
    stat = sum((counts[t] - n * float(p)) ** 2 / (n * float(p)) for t, p in enumerate(probs) if p > 0)
    df = int((probs > 0).sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


# -- the rule alone -------------------------------------------------------------------------------------
def emitted_counts(probs: torch.Tensor, draft: torch.Tensor | None, draws: int) -> Counter:
    generator = torch.Generator().manual_seed(0)
    counts = Counter()
    for _ in range(draws):
        if draft is None:  # a deterministic proposer: always the same token
            token, q = 2, None
        else:
            token, q = int(torch.multinomial(draft, 1, generator=generator)), draft
        counts[rejection.verify_position(probs, token, q, generator)[0]] += 1
    return counts


@pytest.mark.parametrize("point_mass", [False, True])
def test_the_rule_emits_the_target_distribution_and_fails_without_the_residual(point_mass, monkeypatch):
    generator = torch.Generator().manual_seed(1)
    target = torch.rand(6, generator=generator).pow(2)
    target[5] = 0  # a token the target never emits (top-k, a grammar) but the draft may propose
    target /= target.sum()
    draft = torch.rand(6, generator=generator)
    draft /= draft.sum()
    q = None if point_mass else draft
    assert goodness_of_fit(emitted_counts(target, q, 6000), target) > 1e-3
    monkeypatch.setattr(rejection, "USE_RESIDUAL", False)
    assert goodness_of_fit(emitted_counts(target, q, 6000), target) < 1e-6


# -- the whole engine on a tiny random model -----------------------------------------------------------------
class Favourite(Proposer):
    """Point-mass proposals leaning on one token (a proposer that is uniform over the support would
    hide a missing residual: its errors cancel out)."""

    def __init__(self):
        self.rng = random.Random(5)

    def propose(self, seqs, num_tokens):
        return [Proposal([CHOICES[0] if self.rng.random() < 0.8 else self.rng.choice(CHOICES) for _ in range(k)])
                for k in num_tokens]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    previous = torch.get_num_threads()
    torch.set_num_threads(1)  # many tiny steps on a shared machine: threads only contend
    root = tmp_path_factory.mktemp("tiny-spec")
    paths = []
    for name, seed in (("target", 3), ("draft", 4)):
        weights = tiny.hf_weights(seed=seed)
        weights["model.embed_tokens.weight"] *= 0.15  # tied head: logit gaps of a few units, not tens
        paths.append(tiny.write_gguf(root / f"{name}.gguf", weights))
    yield paths
    torch.set_num_threads(previous)


def sampled_counts(path, speculative_config: str | None, proposer: Proposer | None = None) -> list[Counter]:
    llm = LLM(str(path), speculative_config=speculative_config, device="cpu", attention_backend="torch",
              dtype="float32", max_model_len=64, block_size=4, num_kv_blocks=2048, max_num_seqs=128,
              max_num_batched_tokens=1024)
    if proposer is not None:
        llm.engine.proposer = proposer
    params = [SamplingParams(temperature=1.0, max_tokens=4, seed=i, ignore_eos=True, frequency_penalty=0.7,
                             logit_bias={t: 40.0 for t in CHOICES}) for i in range(NUM_REQUESTS)]
    outputs = llm.generate([[7, 8, 9]] * NUM_REQUESTS, params, use_tqdm=False)
    stats = llm.engine.stats()
    if speculative_config is not None:
        assert stats.spec_num_draft_tokens > NUM_REQUESTS
    return [Counter(o.outputs[0].token_ids[position] for o in outputs) for position in (1, 2, 3)]


@pytest.mark.slow
def test_sampled_tokens_keep_their_distribution_through_the_engine(models, monkeypatch):
    target, draft = models
    ngram_like = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "min_acceptance_rate": 0.0,
                             "disable_by_batch_size": 1024})
    drafted = json.dumps({"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3,
                          "min_acceptance_rate": 0.0, "disable_by_batch_size": 1024})
    plain = sampled_counts(target, None)
    assert all(set(counts) <= set(CHOICES) and len(counts) == 4 for counts in plain), plain
    point_mass = sampled_counts(target, ngram_like, Favourite())
    with_draft = sampled_counts(target, drafted)
    for position in range(3):
        assert p_value([plain[position], point_mass[position]]) > 1e-3, (position, plain, point_mass)
        assert p_value([plain[position], with_draft[position]]) > 1e-3, (position, plain, with_draft)
    monkeypatch.setattr(rejection, "USE_RESIDUAL", False)
    broken = sampled_counts(target, ngram_like, Favourite())
    assert min(p_value([plain[position], broken[position]]) for position in range(3)) < 1e-6
