"""End to end: the engine on the triton backend (kernels run by the Triton interpreter on CPU)
generates the same greedy tokens as on the torch reference backend, with the embedded model."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton

import pytest  # noqa: E402

from iterserve.engine import LLM, SamplingParams  # noqa: E402

# Tiny on purpose: the interpreter runs every kernel of all 30 layers in numpy, op by op.
PROMPTS = ["The capital of France is", "def add(a, b):"]
GREEDY = SamplingParams(temperature=0, max_tokens=4)


def greedy_tokens(attention_backend: str) -> list[list[int]]:
    llm = LLM(attention_backend=attention_backend, num_kv_blocks=32, max_model_len=256, dtype="float32")
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    return [out.outputs[0].token_ids for out in outputs]


@pytest.mark.slow
def test_triton_backend_generates_the_same_greedy_tokens_as_torch():
    want = greedy_tokens("torch")
    assert all(len(tokens) == GREEDY.max_tokens for tokens in want)
    assert greedy_tokens("triton") == want
