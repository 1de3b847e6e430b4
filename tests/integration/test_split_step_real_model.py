"""Split execution (engine/model/split_step.py) on the embedded SmolLM2-135M: a mixed batch (new
prompts, a prompt's second chunk, decodes of different lengths, scattered block tables) run as
two interleaved groups gives the logits of one call, row for row in chunk order (fp32 within
1e-4: a group's matmuls may take another kernel path for fewer rows; w8a8 quantizes per row, so
bit-equal), and an engine whose runner splits every step generates the same greedy tokens and
prompt logprobs as one that does not."""

from __future__ import annotations

import random

import pytest
import torch

from iterserve.engine.config import EngineConfig
from iterserve.engine.llm_engine import LLMEngine
from iterserve.engine.model.split_step import StepSplit
from iterserve.engine.sampling_params import SamplingParams
from iterserve.engine.scheduler import ScheduledChunk
from iterserve.engine.sequence import Sequence

BLOCKS = 96
BLOCK = 16


@pytest.fixture(scope="module", params=["none", "w8a8"])
def runner(request):
    from iterserve.engine.model_runner import ModelRunner

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield ModelRunner(EngineConfig(num_kv_blocks=BLOCKS, num_cpu_blocks=4, max_model_len=256, device="cpu", dtype="float32",
                                   attention_backend="torch", quantization=request.param), show_progress=False)
    torch.set_num_threads(previous)


def sequence(tag: str, tokens: list[int], blocks: list[int], prompt_logprobs: int | None = None) -> Sequence:
    seq = Sequence(tag, tokens, SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=prompt_logprobs), 0.0)
    seq.block_table = blocks
    return seq


def test_split_logits_equal_one_call_in_chunk_order(runner):
    rng = random.Random(7)
    free = list(range(1, BLOCKS))
    rng.shuffle(free)  # scattered block tables

    def take(n_tokens: int) -> list[int]:
        return [free.pop() for _ in range(-(-n_tokens // BLOCK))]

    def prompt(n: int) -> list[int]:
        return [rng.randrange(100, 20000) for _ in range(n)]

    # Earlier steps: contexts for the decodes (5..130 tokens) and a prompt's first chunk.
    lengths = [5, 17, 33, 64, 90, 130]
    decoding = [sequence(f"d{i}", prompt(n) + [rng.randrange(100, 20000)], take(n + 1)) for i, n in enumerate(lengths)]
    second = sequence("p-second", prompt(70), take(70))
    earlier = [ScheduledChunk(s, 0, s.num_prompt_tokens - 1, False) for s in decoding]
    earlier.append(ScheduledChunk(second, 0, 40, False))
    with torch.inference_mode():
        runner._forward(earlier)

    # The step: decodes, new prompts (one ends short of its prompt's end, so samples nothing), the
    # second chunk of a prompt, interleaved.
    fresh = [sequence("p0", prompt(24), take(24)), sequence("p1", prompt(9), take(9)),
             sequence("p2", prompt(40), take(40))]
    step = [ScheduledChunk(decoding[0], lengths[0], 1, True), ScheduledChunk(fresh[0], 0, 24, True),
            ScheduledChunk(decoding[3], lengths[3], 1, True), ScheduledChunk(second, 40, 30, True),
            ScheduledChunk(decoding[1], lengths[1], 1, True), ScheduledChunk(fresh[1], 0, 9, True),
            ScheduledChunk(decoding[5], lengths[5], 1, True), ScheduledChunk(fresh[2], 0, 32, False),
            ScheduledChunk(decoding[2], lengths[2], 1, True), ScheduledChunk(decoding[4], lengths[4], 1, True)]
    with torch.inference_mode():
        _, whole = runner._forward(step)
    groups = ([1, 2, 5, 6, 9], [0, 3, 4, 7, 8])  # neither a prefix nor in chunk order when joined
    split = runner.split
    runner.split = StepSplit(min_tokens=1)
    try:
        parts = runner.forward_split(step, groups)
        assert runner.split.runs == 1
    finally:
        runner.split.close()
        runner.split = split
    assert parts.shape == whole.shape == (9, whole.shape[1])
    if runner.config.quantization == "w8a8":
        assert torch.equal(parts, whole)
    else:
        torch.testing.assert_close(parts, whole, rtol=0, atol=1e-4)
    # rows differ enough that a swap of any two would fail the comparison above
    distance = torch.cdist(whole, whole) + torch.eye(len(whole)) * 1e9
    assert distance.min() > 1.0


def generate(runner, prompts: list[list[int]], split: StepSplit | None) -> list[tuple[list[int], list]]:
    runner.split = split
    config = EngineConfig(max_model_len=256, max_num_seqs=16, max_num_batched_tokens=96, device="cpu",
                          attention_backend="torch", num_kv_blocks=BLOCKS, num_cpu_blocks=4).resolve()
    engine = LLMEngine(config, runner, runner.tokenizer)
    for i, tokens in enumerate(prompts):
        params = SamplingParams(temperature=0, max_tokens=5, prompt_logprobs=2 if i in (1, 4) else None)
        engine.add_request(prompt_token_ids=tokens, params=params, request_id=f"r{i}")
    done = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                done[output.request_id] = (output.outputs[0].token_ids, output.prompt_logprobs)
    return [done[f"r{i}"] for i in range(len(prompts))]


def test_engine_with_split_steps_generates_the_same_greedy_tokens(runner):
    words = "the a cat dog sat ran on under mat tree house river stone light".split()
    rng = random.Random(3)
    prompts = [runner.tokenizer.encode(" ".join(rng.choice(words) for _ in range(n))) for n in
               (6, 30, 11, 45, 20, 8, 60, 14)]
    saved = runner.split
    split = StepSplit(min_tokens=8)
    try:
        with_split = generate(runner, prompts, split)
        runs = split.runs
        without = generate(runner, prompts, None)
    finally:
        split.close()
        runner.split = saved
    assert runs >= 5  # prefill steps (96-token budget over 8 prompts) and the decode steps split
    for (tokens_split, prompt_split), (tokens, prompt) in zip(with_split, without, strict=True):
        assert tokens_split == tokens
        assert (prompt_split is None) == (prompt is None)
        if prompt is not None:
            assert [e and e.token_id for e in prompt_split] == [e and e.token_id for e in prompt]
            for a, b in zip(prompt_split[1:], prompt[1:], strict=True):
                assert a.logprob == pytest.approx(b.logprob, abs=1e-3)
                assert [t for t, _ in a.top] == [t for t, _ in b.top]
