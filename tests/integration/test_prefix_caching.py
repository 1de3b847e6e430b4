"""Prefix caching on the embedded SmolLM2-135M: greedy tokens with caching on equal those with it
off, for prompts that share prefixes of 16, 17, 32, 33, 48 (the whole prompt), 49 and 64 tokens
with 16-token blocks, a repeated prompt, a second conversation turn that reuses the first turn's
generated blocks, and under preemption by recompute and by swap, and with aborts.

The model is loaded once; each engine sees its own slice of one KV pool (a fresh block manager
never reads a block before writing it), so the test stays cheap on two cores.
"""

from __future__ import annotations

import pytest
import torch

from iterserve.engine.config import EngineConfig
from iterserve.engine.llm_engine import LLMEngine
from iterserve.engine.sampling_params import SamplingParams

MAX_TOKENS = 10
STORY = ("Once upon a time, in a small village at the edge of a great forest, there lived an old clockmaker "
         "who had never once left the valley. Every morning he opened his shop, wound the hundred clocks on "
         "its walls, and waited for customers who rarely came. One winter day, a stranger knocked at the door")
SHARED = [(16, " The"), (17, " Then the"), (32, " Why"), (33, " How did"), (48, ""), (49, " and"), (64, " but"),
          (64, " but")]
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)


class PoolSlice:
    """The loaded model with only the first num_kv_blocks of its KV pool visible."""

    def __init__(self, runner, num_kv_blocks: int):
        self.runner = runner
        self.num_kv_blocks = num_kv_blocks
        self.num_cpu_blocks = runner.num_cpu_blocks

    def execute(self, out):
        return self.runner.execute(out)

    def release(self, request_ids):
        self.runner.release(request_ids)


@pytest.fixture(scope="module")
def runner():
    from iterserve.engine.model_runner import ModelRunner

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield ModelRunner(EngineConfig(num_kv_blocks=48, num_cpu_blocks=48, preemption_mode="swap", max_model_len=256,
                                   device="cpu", attention_backend="torch", dtype="float32"), show_progress=False)
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def prompts(runner):
    story = runner.tokenizer.encode(STORY)
    assert len(story) >= 64
    return [story[:n] + runner.tokenizer.encode(tail, add_special_tokens=False) for n, tail in SHARED]


def engine(runner, num_kv_blocks: int = 48, **options) -> LLMEngine:
    config = EngineConfig(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=32, device="cpu",
                          attention_backend="torch", watermark=0.0, **options).resolve()
    return LLMEngine(config, PoolSlice(runner, num_kv_blocks), runner.tokenizer)


def generate(engine: LLMEngine, prompts: list[list[int]], tag: str, abort: set[int] = frozenset(),
             abort_at_step: int = 3) -> dict[int, list[int]]:
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt_token_ids=prompt, params=GREEDY, request_id=f"{tag}-{i}")
    tokens: dict[int, list[int]] = {}
    steps = 0
    while engine.has_unfinished_requests():
        if steps == abort_at_step:
            for i in abort:
                engine.abort_request(f"{tag}-{i}")
        for output in engine.step():
            if output.finished:
                tokens[int(output.request_id.rsplit("-", 1)[1])] = output.outputs[0].token_ids
        steps += 1
    assert engine.block_manager.usage() == 0.0 and engine.block_manager.cpu.num_used == 0
    return tokens


@pytest.fixture(scope="module")
def reference(runner, prompts):
    """Caching off: the first turn, then a second turn that extends every conversation."""
    off = engine(runner, enable_prefix_caching=False)
    first = generate(off, prompts, "off1")
    second = generate(off, second_turn(prompts, first, runner), "off2")
    assert off.stats().prefix_cache_queries == 0
    return first, second


def second_turn(prompts, first, runner) -> list[list[int]]:
    follow_up = runner.tokenizer.encode(" Later,", add_special_tokens=False)
    return [prompt + first[i] + follow_up for i, prompt in enumerate(prompts)]


@pytest.mark.slow
def test_cached_prefixes_give_the_same_tokens_across_turns(runner, prompts, reference):
    on = engine(runner, enable_prefix_caching=True)
    first = generate(on, prompts, "on1")
    hits_first = on.stats().prefix_cache_hits
    second = generate(on, second_turn(prompts, first, runner), "on2")
    assert (first, second) == reference
    assert hits_first >= 16 * 8  # every prompt after the first shares at least one block
    # The second turn finds the first turn's prompt and generated blocks again.
    assert on.stats().prefix_cache_hits - hits_first >= sum(
        (len(p) + MAX_TOKENS - 1) // 16 * 16 for p in prompts) - 16 * len(prompts)
    assert on.block_manager.num_cached_blocks > 0


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_cached_prefixes_give_the_same_tokens_under_preemption(runner, prompts, reference, mode):
    # 7 blocks of 16 for eight sequences of up to 76 tokens: even with sharing, preemption is certain.
    on = engine(runner, num_kv_blocks=7, enable_prefix_caching=True, preemption_mode=mode)
    swaps = []
    execute = on.executor.execute
    on.executor.execute = lambda out: swaps.extend(out.swap_out) or execute(out)
    assert generate(on, prompts, f"pre-{mode}") == reference[0]
    assert on.scheduler.num_preemptions > 0 and on.stats().prefix_cache_hits > 0
    assert bool(swaps) == (mode == "swap")


@pytest.mark.slow
def test_aborted_requests_leave_the_others_tokens_and_the_cache_intact(runner, prompts, reference):
    on = engine(runner, num_kv_blocks=16, enable_prefix_caching=True)
    got = generate(on, prompts, "abort", abort={0, 3, 6})
    for i, tokens in got.items():
        if i in {0, 3, 6}:
            assert tokens == reference[0][i][: len(tokens)] and len(tokens) < MAX_TOKENS
        else:
            assert tokens == reference[0][i]
    assert generate(on, prompts, "after-abort") == reference[0]  # whatever stayed cached is right
