"""Per-request sampling: greedy rows, temperature, top-k, top-p, and seeds that make a request's
tokens independent of its batch."""

from __future__ import annotations

import pytest
import torch

from iterserve.engine.sampler import Sampler, apply_top_k_top_p
from iterserve.engine.sampling_params import MAX_SEED, MIN_SEED, SAMPLING_EPS, SamplingParams
from iterserve.engine.sequence import Sequence
from iterserve.engine.step_result import RequestFailed


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
    # The sampled row is the draw its own seeded generator makes from softmax(logits / T).
    expected = torch.multinomial(logits[1].softmax(-1), 1, generator=torch.Generator().manual_seed(1))
    assert tokens[1] == int(expected)
    assert tokens[1] != int(logits[1].argmax())  # seed 1 happens not to draw the argmax: a real draw


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


@pytest.mark.parametrize("temperature", [5e-324, 1e-39, SAMPLING_EPS / 2])
def test_temperatures_below_epsilon_are_greedy(temperature):
    logits = logits_rows(2)
    params = SamplingParams(temperature=temperature)
    assert params.greedy
    tokens = Sampler(torch.device("cpu")).sample(logits, [seq("a", temperature=temperature), seq("b", temperature=0)])
    assert tokens == logits.argmax(-1).tolist()


def test_edge_values_of_every_field_sample_a_token():
    logits = logits_rows(6)
    batch = [seq("k", temperature=1.0, top_k=2**31 - 1), seq("p", temperature=2.0, top_p=5e-324),
             seq("lo", temperature=1.0, seed=MIN_SEED), seq("hi", temperature=1.0, seed=MAX_SEED),
             seq("eps", temperature=SAMPLING_EPS), seq("max", temperature=2.0, top_k=1)]
    tokens = Sampler(torch.device("cpu")).sample(logits, batch)
    assert all(isinstance(t, int) and 0 <= t < 50 for t in tokens)
    assert tokens[1] == int(logits[1].argmax())  # a vanishing nucleus keeps the top token only
    assert tokens[5] == int(logits[5].argmax())


class FailsFor(Sampler):
    """A sampler with a bug that one request's settings trigger."""

    def __init__(self, request_id: str):
        super().__init__(torch.device("cpu"))
        self.request_id = request_id

    def sample_batch(self, logits, seqs):
        if any(s.request_id == self.request_id for s in seqs):
            raise RuntimeError("probability tensor contains either inf, nan or element < 0")
        return super().sample_batch(logits, seqs)


def test_a_sampling_failure_is_kept_to_its_request():
    logits = logits_rows(4)
    batch = [seq("a", temperature=0), seq("bad", temperature=0.7), seq("c", temperature=1.0, seed=3),
             seq("d", top_k=1)]
    tokens = FailsFor("bad").sample(logits, batch)
    assert isinstance(tokens[1], RequestFailed) and "inf, nan" in tokens[1].message
    others = Sampler(torch.device("cpu")).sample(logits[[0, 2, 3]], [batch[0], batch[2], batch[3]])
    assert [tokens[0], tokens[2], tokens[3]] == others
