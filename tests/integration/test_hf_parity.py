"""Greedy parity with HuggingFace transformers on the embedded SmolLM2-135M GGUF.

Ten prompts of different lengths, raw and chat-templated, run concurrently through continuous
batching with chunked prefill in 16-token steps and a KV pool far too small for all of them, so
sequences are preempted and resumed (recompute, then swap); every token must still equal what
transformers' `generate` produces for the prompt alone.
"""

from __future__ import annotations

import pytest
import torch

from iterserve.engine import LLM, SamplingParams
from iterserve.engine.model.registry import resolve_model_path
from iterserve.engine.model.tokenizer import Tokenizer

MAX_NEW_TOKENS = 28
RAW_PROMPTS = [
    "Hello",
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "List three colours of the rainbow:\n1.",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old "
    "clockmaker who had never once left the valley. Every morning he opened his shop, wound the "
    "hundred clocks on its walls, and waited for customers who rarely came. One winter day,",
]
CHATS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "user", "content": "Give me a synonym for happy."}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "Explain what a KV cache is in one sentence."}],
    [{"role": "user", "content": "Translate 'good morning' into French."},
     {"role": "assistant", "content": "Bonjour."},
     {"role": "user", "content": "And into Spanish?"}],
    [{"role": "user", "content": "Write a haiku about continuous batching in LLM servers."}],
]


@pytest.fixture(scope="module")
def one_thread():
    # The machine is small and shared: one thread avoids OpenMP spin-waiting against other work.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def prompts():
    tokenizer = Tokenizer.from_gguf(resolve_model_path(None)[0])
    return RAW_PROMPTS + [tokenizer.apply_chat_template(chat) for chat in CHATS]


@pytest.fixture(scope="module")
def reference_tokens(prompts, one_thread, hf_smollm):
    """transformers' greedy tokens for each prompt on its own."""
    model, tokenizer = hf_smollm
    tokens = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([tokenizer.encode(prompt)])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=MAX_NEW_TOKENS, pad_token_id=tokenizer.eos_token_id)
            tokens.append(out[0, ids.shape[1]:].tolist())
    return tokens


@pytest.mark.slow
@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_greedy_tokens_equal_transformers_under_preemption(prompts, reference_tokens, preemption_mode,
                                                           one_thread):
    # 20 blocks x 16 = 320 tokens of KV for ten sequences of up to ~110 tokens each.
    llm = LLM(num_kv_blocks=20, num_cpu_blocks=64, max_model_len=256, max_num_seqs=8,
              max_num_batched_tokens=16, preemption_mode=preemption_mode, device="cpu",
              attention_backend="torch", dtype="float32")  # the reference runs in fp32
    swapped_blocks = []
    execute = llm.engine.executor.execute
    llm.engine.executor.execute = lambda out: swapped_blocks.extend(out.swap_out) or execute(out)

    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW_TOKENS), use_tqdm=False)

    got = [output.outputs[0].token_ids for output in outputs]
    for prompt, mine, theirs in zip(prompts, got, reference_tokens, strict=True):
        assert mine == theirs, f"prompt {prompt!r}"
    assert llm.engine.scheduler.num_preemptions > 0
    assert bool(swapped_blocks) == (preemption_mode == "swap")
    assert llm.engine.block_manager.usage() == 0.0
    text = outputs[1].outputs[0].text
    assert text == llm.get_tokenizer().decode(got[1]) and "Paris" in text
