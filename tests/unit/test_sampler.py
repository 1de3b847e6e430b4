"""Per-request sampling: greedy rows, temperature, top-k, top-p, and seeds that make a request's
tokens independent of its batch."""

from __future__ import annotations

import torch

from iterserve.engine.sampler import Sampler, apply_top_k_top_p
from iterserve.engine.sampling_params import SamplingParams
from iterserve.engine.sequence import Sequence


def seq(request_id: str, **params) -> Sequence:
    return Sequence(request_id, [1], SamplingParams(**params), arrival_time=0.0)


def logits_rows(n: int, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed))


def test_greedy_rows_take_the_argmax_next_to_sampled_rows():
    logits = logits_rows(3)
    sampler = Sampler(torch.device("cpu"))
    tokens = sampler.sample(logits, [seq("a", temperature=0), seq("b", temperature=1.0, seed=1),
                                     seq("c", top_k=1)])
    assert tokens[0] == int(logits[0].argmax()) and tokens[2] == int(logits[2].argmax())
    assert 0 <= tokens[1] < 50


def test_top_k_and_top_p_keep_only_the_allowed_tokens():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05]]))
    masked = apply_top_k_top_p(logits, top_k=[2, -1], top_p=[1.0, 0.7])
    assert torch.isfinite(masked[0]).tolist() == [True, True, False, False]
    # Nucleus 0.7: 0.5 alone is not enough, 0.5 + 0.3 reaches it.
    assert torch.isfinite(masked[1]).tolist() == [True, True, False, False]
    tiny_p = apply_top_k_top_p(logits[:1], top_k=[-1], top_p=[0.01])
    assert torch.isfinite(tiny_p[0]).tolist() == [True, False, False, False]


def test_sampled_tokens_follow_the_filtered_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(400, 1)
    sampler = Sampler(torch.device("cpu"), seed=7)
    tokens = sampler.sample(logits, [seq(f"r{i}", temperature=1.0, top_k=2) for i in range(400)])
    assert set(tokens) == {0, 1}
    assert 0.5 < tokens.count(0) / 400 < 0.75  # 0.5 / 0.8 = 0.625 after renormalising


def test_seed_makes_a_request_reproducible_whatever_the_batch():
    params = {"temperature": 1.0, "top_p": 0.9, "seed": 1234}
    alone = Sampler(torch.device("cpu"))
    crowded = Sampler(torch.device("cpu"), seed=99)
    runs_alone, runs_crowded = [], []
    for step in range(5):
        logits = logits_rows(4, seed=step)
        runs_alone.append(alone.sample(logits[2:3], [seq("x", **params)])[0])
        batch = [seq("other1", temperature=1.0), seq("other2", temperature=0.5), seq("x", **params),
                 seq("other3", temperature=0)]
        runs_crowded.append(crowded.sample(logits, batch)[2])
    assert runs_alone == runs_crowded


def test_release_drops_the_request_generator():
    sampler = Sampler(torch.device("cpu"))
    logits = logits_rows(1)
    first = [sampler.sample(logits, [seq("x", temperature=1.0, seed=5)])[0] for _ in range(6)]
    sampler.release(["x"])
    assert "x" not in sampler._generators
    again = [sampler.sample(logits, [seq("x", temperature=1.0, seed=5)])[0] for _ in range(6)]
    assert again == first
