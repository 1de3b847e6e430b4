"""The real model served in bf16 on a CPU, as `--dtype auto` chooses on CPUs with native bf16
(engine/model/cpu_dtype.py): it generates, and its greedy tokens start as fp32's do."""

from __future__ import annotations

import torch

from iterserve.engine import LLM, SamplingParams

PROMPTS = ["The capital of France is", "One, two, three, four,", "def add(a, b):\n    return"]


def greedy(dtype: str) -> list[list[int]]:
    llm = LLM(dtype=dtype)
    assert llm.engine.executor.dtype == getattr(torch, dtype)
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    return [list(out.outputs[0].token_ids) for out in outputs]


def test_bf16_on_cpu_generates_what_fp32_does_at_first():
    bf16, fp32 = greedy("bfloat16"), greedy("float32")
    assert all(len(tokens) == 4 for tokens in bf16)
    # bf16 rounds weights and activations to 8 mantissa bits: later tokens may part ways, the first agree
    assert sum(a[:3] == b[:3] for a, b in zip(bf16, fp32, strict=True)) >= 2, (bf16, fp32)
