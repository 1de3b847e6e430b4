"""Structured outputs in the batched sampler (engine/structured) on the embedded model's real
vocabulary: only grammar-allowed tokens are drawn, unconstrained rows and the raw logits are left
alone, a finished grammar allows only EOS, and a spec is compiled once."""

from __future__ import annotations

import json

import pytest
import torch

from iterserve.engine.model.registry import resolve_model_path
from iterserve.engine.model.tokenizer import Tokenizer
from iterserve.engine.sampler import Sampler
from iterserve.engine.sampling_params import InvalidRequestError, SamplingParams
from iterserve.engine.sequence import Sequence
from iterserve.engine.structured import Grammars, StructuredOutput


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_path(resolve_model_path(None)[0])


@pytest.fixture(scope="module")
def grammars(tokenizer):
    return Grammars(tokenizer, tokenizer.vocab_size)


def test_a_spec_is_compiled_once_and_bad_specs_name_their_field(grammars):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    before = grammars.misses, grammars.hits
    first = grammars.compile(StructuredOutput.json_schema(schema))
    assert grammars.compile(StructuredOutput.json_schema(dict(schema))) is first
    assert (grammars.misses, grammars.hits) == (before[0] + 1, before[1] + 1)
    with pytest.raises(InvalidRequestError) as error:
        grammars.compile(StructuredOutput("regex", "(", "guided_regex"))
    assert error.value.param == "guided_regex"


def test_constrained_rows_draw_only_allowed_tokens_until_eos(tokenizer, grammars):
    sampler = Sampler(torch.device("cpu"), seed=0, grammars=grammars)
    choice = StructuredOutput.choice(["yes please", "no thanks"])
    schema = StructuredOutput.json_schema({"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                                                  "maximum": 99}},
                                           "required": ["n"]})
    seqs = [Sequence("a", [1], SamplingParams(temperature=1.0, seed=1, structured=choice), 0.0,
                     eos_token_id=tokenizer.eos_token_id),
            Sequence("b", [1], SamplingParams(temperature=0), 0.0, eos_token_id=tokenizer.eos_token_id),
            Sequence("c", [1], SamplingParams(temperature=0, structured=schema, logprobs=0), 0.0,
                     eos_token_id=tokenizer.eos_token_id)]
    generator = torch.Generator().manual_seed(0)
    done: set[str] = set()
    for _ in range(40):
        live = [s for s in seqs if s.request_id not in done]
        if not any(s.params.structured for s in live):
            break
        logits = torch.randn(len(live), tokenizer.vocab_size, generator=generator)
        raw = logits.clone()
        tokens = sampler.sample(logits, live)
        assert torch.equal(logits, raw)  # masked on a copy: logprobs see the model's distribution
        for s, token in zip(live, tokens, strict=True):
            assert isinstance(token, int), token
            if s.request_id == "b":
                assert token == int(raw[live.index(s)].argmax())  # unconstrained row untouched
            if s.request_id == "c":
                assert s.logprobs[-1].logprob == pytest.approx(float(raw[live.index(s)].log_softmax(-1)[token]))
            s.output_token_ids.append(token)
            if token == tokenizer.eos_token_id:
                done.add(s.request_id)
    assert {"a", "c"} <= done
    text = {s.request_id: tokenizer.decode(s.output_token_ids) for s in seqs}
    assert text["a"] in ("yes please", "no thanks")
    assert 0 <= json.loads(text["c"])["n"] <= 99
    sampler.release(["a", "b", "c"])
    assert not sampler._matchers._matchers
