"""--pipeline-micro-batch-min-tokens through a PP=2 engine with real rank processes over gloo on
127.0.0.1: a run whose prompt steps are cut into micro-batches (three, so prompt chunks are cut too)
and whose decode steps run whole gives the greedy tokens of one process. Every rank derives the cut
from the step plan; a rank that cut a step otherwise would wait on a transfer no one sends, or
receive rows of the wrong shape."""

from __future__ import annotations

import pytest

from iterserve.engine import LLM, SamplingParams
from iterserve.engine.model.registry import resolve_model_path
from iterserve.engine.model.tokenizer import Tokenizer
from iterserve.engine.step_log import as_record
from tests import tp_models

MIN_TOKENS = 8
NEW_TOKENS = 24


def run(model: str, prompts: list[list[int]], pp: int) -> tuple[list[list[int]], list[dict]]:
    """Greedy tokens per prompt and the engine's step records. A 16-token budget makes prompt steps
    of 16 tokens (at least MIN_TOKENS: cut) and decode steps of at most 4 rows (fewer: whole)."""
    llm = LLM(model=model, pipeline_parallel_size=pp, pipeline_micro_batches=3,
              pipeline_micro_batch_min_tokens=MIN_TOKENS, max_num_batched_tokens=16, max_num_seqs=4,
              num_kv_blocks=32, max_model_len=144, device="cpu", attention_backend="torch", dtype="float32")
    try:
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True),
                               use_tqdm=False)
        records = [as_record(r) for r in llm.engine.step_records.after(0, 10_000)[0]]
        return [list(o.outputs[0].token_ids) for o in outputs], records
    finally:
        llm.engine.close()


@pytest.mark.slow
def test_two_stages_cutting_only_large_steps_give_one_process_tokens(tmp_path):
    tokenizer = Tokenizer.from_gguf(resolve_model_path(None)[0])
    model = str(tp_models.build("h8kv4", tmp_path / "h8kv4"))
    story = tokenizer.encode("Once upon a time, in a small village at the edge of a great forest, there lived an "
                             "old clockmaker who had never once left the valley. Every morning he opened his shop")
    # prompts of different lengths, so later prompt chunks share steps with earlier prompts' decodes
    prompts = [story, story[:21], tokenizer.encode("The capital of France is"), story[5:40]]
    one, _ = run(model, prompts, pp=1)
    two, records = run(model, prompts, pp=2)
    assert all(len(tokens) == NEW_TOKENS for tokens in one)
    assert two == one
    tokens = [(r["prefill_tokens"], r["decode_tokens"]) for r in records]
    cut = [t for t in tokens if sum(t) >= MIN_TOKENS]
    whole = [t for t in tokens if 0 < sum(t) < MIN_TOKENS]
    assert any(p for p, _ in cut), "no prompt step was cut"
    assert any(p and d for p, d in cut), "no cut step mixed a prompt chunk with decodes"
    assert any(d and not p for p, d in whole), "no decode-only step ran whole"
