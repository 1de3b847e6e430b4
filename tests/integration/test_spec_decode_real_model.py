"""Speculative decoding on the embedded SmolLM2-135M: greedy outputs identical token for token to
plain decoding, for 30 prompts (code, repeated structures, free text) at batch sizes 1, 4 and 32,
each compared with plain decoding at the same batch size (the same requests admitted together,
so a difference can only come from speculation), with chunked prefill (a small step budget) and
prefix caching on; n-gram proposals, and the model as its own draft. The model is
loaded once per runner; each engine gets a fresh block manager."""

from __future__ import annotations

import json

import pytest
import torch

from iterserve.engine.config import EngineConfig
from iterserve.engine.llm_engine import LLMEngine
from iterserve.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.beside_cluster  # ~4 minutes of one core: run in the lane that mostly waits
MAX_TOKENS = 20
CODE = [
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "for i in range(10):\n    print(i)\nfor j in range(10):\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\nclass Size:\n",
    "SELECT name, age FROM users WHERE age > 30;\nSELECT name, city FROM users WHERE",
    "import os\nimport sys\nimport json\nimport",
    "x = [1, 2, 3]\ny = [4, 5, 6]\nz = [",
    "<ul>\n  <li>Apple</li>\n  <li>Banana</li>\n  <li>",
    'config = {"host": "localhost", "port": 8080, "debug": True}\nprod = {"host":',
    "def is_even(n):\n    return n % 2 == 0\n\ndef is_odd(n):\n",
    "if x > 0:\n    sign = 1\nelif x < 0:\n    sign = -1\nelse:\n",
]
REPEATED = [
    "1, 2, 3, 4, 5, 6, 7, 8,",
    "Monday, Tuesday, Wednesday, Thursday,",
    "A B C D E F G H I J",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "red green blue red green blue red green",
    "Q: What is 2+2?\nA: 4\nQ: What is 3+3?\nA: 6\nQ: What is 4+4?\nA:",
    "- item one\n- item two\n- item three\n-",
    "Name: Alice\nAge: 30\n\nName: Bob\nAge: 25\n\nName:",
    "I like cats. I like dogs. I like",
    "January February March April May",
]
FREE = [
    "Once upon a time",
    "The capital of France is",
    "Explain why the sky is blue.",
    "My favourite food is",
    "In the year 2050, cities will",
    "The best way to learn a language is",
    "Write a short poem about the sea.",
    "Photosynthesis is the process by which",
    "Here is a recipe for pancakes:",
    "The history of the Roman Empire",
]
PROMPTS = CODE + REPEATED + FREE


class Slice:
    """The loaded runner under a fresh engine; no `proposer` attribute: the engine's n-gram lookup."""

    def __init__(self, runner):
        self.runner, self.num_kv_blocks, self.num_cpu_blocks = runner, runner.num_kv_blocks, runner.num_cpu_blocks

    def execute(self, out):
        return self.runner.execute(out)

    def release(self, request_ids):
        self.runner.release(request_ids)


OPTIONS = dict(num_kv_blocks=512, max_model_len=512, device="cpu", attention_backend="torch", dtype="float32")


@pytest.fixture(scope="module")
def threads():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def runner(threads):
    from iterserve.engine.model_runner import ModelRunner

    return ModelRunner(EngineConfig(**OPTIONS), show_progress=False)


def generate(executor, tokenizer, prompts, max_num_seqs: int, speculative_config: str | None):
    config = EngineConfig(**OPTIONS, max_num_seqs=max_num_seqs, max_num_batched_tokens=64, chunked_prefill=True,
                          enable_prefix_caching=True, speculative_config=speculative_config).resolve(8192)
    engine = LLMEngine(config, executor, tokenizer)
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt=prompt, params=SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
                           request_id=f"p{i}")
    outputs = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                outputs[output.request_id] = output.outputs[0].token_ids
    assert engine.block_manager.usage() == 0.0
    return outputs, engine.stats()


@pytest.mark.slow
@pytest.mark.timeout(1200)  # batch 1: 600 single-token plain steps, over 340 s of wall time at load average 12-16
@pytest.mark.parametrize("batch", [1, 4, 32])
def test_ngram_greedy_equals_plain_greedy_at_the_same_batch_size(runner, batch):
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                       "prompt_lookup_max": 4, "disable_by_batch_size": 64, "min_acceptance_rate": 0.0})
    plain, _ = generate(Slice(runner), runner.tokenizer, PROMPTS, batch, None)
    fast, stats = generate(Slice(runner), runner.tokenizer, PROMPTS, batch, spec)
    assert len(plain) == len(PROMPTS) and all(plain.values())
    different = sorted(rid for rid in plain if fast[rid] != plain[rid])
    assert not different, f"batch {batch}: {different}"
    assert stats.spec_num_accepted_tokens > 30, stats  # the repeated prompts do accept proposals


@pytest.mark.slow
def test_the_model_as_its_own_draft_is_accepted_and_greedy_equal(threads):
    from iterserve.engine.model_runner import ModelRunner

    spec = json.dumps({"method": "draft_model", "model": "smollm2-135m", "num_speculative_tokens": 3,
                       "disable_by_batch_size": 64})
    drafted = ModelRunner(EngineConfig(**OPTIONS, speculative_config=spec), show_progress=False)
    prompts = PROMPTS[::4]
    plain, _ = generate(Slice(drafted), drafted.tokenizer, prompts, 4, None)
    fast, stats = generate(drafted, drafted.tokenizer, prompts, 4, spec)
    assert fast == plain
    # The same weights propose what they then verify: nearly everything is accepted.
    assert stats.spec_num_accepted_tokens >= 0.9 * stats.spec_num_draft_tokens > 0
    assert not drafted.proposer.states and drafted.proposer.blocks.usage() == 0.0  # released with the requests


@pytest.mark.slow
def test_penalties_grammars_stops_and_logprobs_per_position_match_plain(runner):
    from iterserve.engine.structured import StructuredOutput

    schema = {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "string"}}},
              "required": ["items"]}
    names, likes, numbers = REPEATED[7], REPEATED[8], REPEATED[0]  # prompts the model continues by copying
    cases = [
        (names, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, repetition_penalty=1.2)),
        (likes, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, frequency_penalty=0.5, presence_penalty=0.3)),
        (numbers, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=3)),
        (numbers, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop=["12,"])),
        (REPEATED[6], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logit_bias={12: 5.0}, min_tokens=5)),
        ("List three fruits as JSON: ", SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=1,
                                                       structured=StructuredOutput.json_schema(schema))),
    ]
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                       "disable_by_batch_size": 64, "min_acceptance_rate": 0.0})
    results = {}
    for name, speculative_config in (("plain", None), ("spec", spec)):
        config = EngineConfig(**OPTIONS, max_num_seqs=8, enable_prefix_caching=True,
                              speculative_config=speculative_config).resolve(8192)
        engine = LLMEngine(config, Slice(runner), runner.tokenizer)
        for i, (prompt, params) in enumerate(cases):
            engine.add_request(prompt=prompt, params=params, request_id=f"c{i}")
        outputs = {}
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    outputs[output.request_id] = output.outputs[0]
        results[name] = outputs
        if speculative_config:
            assert engine.stats().spec_num_accepted_tokens >= 10
    for request_id, plain in results["plain"].items():
        fast = results["spec"][request_id]
        assert (fast.token_ids, fast.text, fast.finish_reason) == (plain.token_ids, plain.text, plain.finish_reason)
        if plain.logprobs is not None:
            assert [e.token_id for e in fast.logprobs] == [e.token_id for e in plain.logprobs] == plain.token_ids
            assert [e.logprob for e in fast.logprobs] == pytest.approx([e.logprob for e in plain.logprobs], abs=1e-3)
            assert [[t for t, _ in e.top] for e in fast.logprobs] == [[t for t, _ in e.top] for e in plain.logprobs]
    assert results["plain"]["c3"].finish_reason == "stop" and results["plain"]["c3"].text.endswith("11, ")
