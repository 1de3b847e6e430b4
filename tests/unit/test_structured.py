"""Structured outputs in the batched sampler (engine/structured) on the embedded model's real
vocabulary: only grammar-allowed tokens are drawn, unconstrained rows and the raw logits are left
alone, a finished grammar allows only EOS, and a spec is compiled once; the compile pool's queue cap
and deadline, the grammar pinned on a request, and the limits on a spec's counts, enums and depth."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest
import torch

from iterserve.engine.model.registry import resolve_model_path
from iterserve.engine.model.tokenizer import Tokenizer
from iterserve.engine.sampler import Sampler
from iterserve.engine.sampling_params import InvalidRequestError, SamplingParams
from iterserve.engine.sequence import Sequence
from iterserve.engine.structured import Grammars, StructuredOutput
from iterserve.engine.structured.compile_pool import CompileBusy, CompilePool
from iterserve.engine.structured.limits import MAX_ENUM, MAX_REPEAT, check_limits, pattern_expansion


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


def test_a_pinned_grammar_is_used_after_the_cache_evicted_its_spec(tokenizer):
    # Before, the engine thread looked every request's spec up in the shared LRU cache: a burst of other
    # schemas that evicted it made the engine thread compile (seconds on a large schema) mid-step.
    small = Grammars(tokenizer, tokenizer.vocab_size, cache_size=1)
    first = StructuredOutput.choice(["yes", "no"])
    pinned = asyncio.run(small.pool.compile(first))
    assert pinned == first and pinned.compiled is small.compile(first)
    asyncio.run(small.pool.compile(StructuredOutput.choice(["other"])))  # evicts the first spec
    misses = small.misses
    sampler = Sampler(torch.device("cpu"), seed=0, grammars=small)
    seq = Sequence("a", [1], SamplingParams(temperature=1.0, seed=1, structured=pinned), 0.0,
                   eos_token_id=tokenizer.eos_token_id)
    token = sampler.sample(torch.randn(1, tokenizer.vocab_size), [seq])[0]
    assert tokenizer.decode([token]) in ("y", "ye", "yes", "n", "no")
    assert small.misses == misses  # not compiled again
    small.pool.close()


class _SlowGrammars:
    """Grammars whose compile waits for `release`: a compile that outlives its request."""

    compiler = object()

    def __init__(self):
        self.release = threading.Event()

    def cached(self, structured):
        return None

    def compile(self, structured):
        self.release.wait(10)
        return "compiled"


def test_the_compile_pool_refuses_past_its_queue_and_its_deadline_without_growing():
    # Before, every compile ran on asyncio's default executor with no deadline and no queue cap: slow
    # schemas took its threads from tokenizing, and waiting requests piled up without bound.
    grammars = _SlowGrammars()
    pool = CompilePool(grammars, workers=1, max_pending=2, timeout_s=0.2)
    spec = StructuredOutput("regex", "a+", "guided_regex")

    async def scenario():
        results = await asyncio.gather(*(pool.compile(spec) for _ in range(3)), return_exceptions=True)
        busy = [r for r in results if isinstance(r, CompileBusy)]
        late = [r for r in results if isinstance(r, InvalidRequestError)]
        assert len(busy) == 1 and len(late) == 2, results
        assert late[0].param == "guided_regex" and "0.2 s" in str(late[0])
        assert pool.pending == 1  # the running compile still holds its place; the queued one was dropped
        grammars.release.set()
        for _ in range(100):
            if pool.pending == 0:
                break
            await asyncio.sleep(0.01)
        assert pool.pending == 0
        assert (await pool.compile(spec)).compiled == "compiled"

    asyncio.run(scenario())
    pool.close()


SCHEMA_OVER_LIMITS = [
    ({"type": "array", "items": {"type": "integer"}, "maxItems": MAX_REPEAT + 1}, "maxItems"),
    ({"type": "object", "properties": {"s": {"type": "string", "minLength": 10**40}}}, "properties.s.minLength"),
    ({"enum": list(range(MAX_ENUM + 1))}, "enum"),
    ({"type": "string", "pattern": "^x{1,10000}$"}, "pattern"),  # 36 s to compile before the limit
    ({"type": "string", "pattern": "^(x{1,100}y){1,100}$"}, "pattern"),  # nested counts multiply
    (json.loads('{"type":"array","items":' * 70 + '{"type":"integer"}' + "}" * 70), "deeper than"),
]


@pytest.mark.parametrize("schema, where", SCHEMA_OVER_LIMITS)
def test_schemas_over_a_limit_are_refused_naming_the_field_and_the_place(schema, where):
    with pytest.raises(InvalidRequestError) as error:
        check_limits("json_schema", StructuredOutput.json_schema(schema, "guided_json").spec, "guided_json")
    assert error.value.param == "guided_json" and where in str(error.value)


def test_regex_grammar_and_choice_counts_are_limited_and_ordinary_specs_pass():
    for kind, spec in [("regex", "a{0,10001}"), ("grammar", 'root ::= "a"{2, 99999999999999999999}'),
                       ("choice", json.dumps([str(i) for i in range(MAX_ENUM + 1)]))]:
        with pytest.raises(InvalidRequestError):
            check_limits(kind, spec, "guided_x")
    ordinary = {"type": "object", "properties": {
        "maxLength": {"type": "string", "maxLength": 64},  # a property named like a keyword
        "zip": {"type": "string", "pattern": "^[0-9]{5}(-[0-9]{4})?$"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": MAX_REPEAT}}}
    check_limits("json_schema", json.dumps(ordinary), "response_format")
    check_limits("regex", r"\d{3}-\d{4}", "guided_regex")
    assert pattern_expansion("(x{1,100}y){1,100}") == 10_100 and pattern_expansion(r"\{5}[}]{3}") == 6
