"""`--compile` on the embedded SmolLM2-135M against the eager fp32 path.

The ten parity prompts run together through the engine (LLM(compile=True): the runner's wiring,
start-up compile, chunked prefill in 64-token steps, so prefill chunks, mixed steps and batched
decodes all go through the compiled graphs), then again with the same model eager (compiled path
switched off, same weights): every greedy token must be equal. The logits of one prompt plus its
continuation, fed as one prefill and as the prompt's prefill then token by token, are compared
too: inductor may sum the norms' reductions in another order, so they are close, not
bit-identical (the bound is printed).
"""

from __future__ import annotations

import pytest
import torch

from iterserve.engine import LLM, SamplingParams
from iterserve.engine.model.compiled import CompiledForward
from iterserve.engine.model.registry import resolve_model_path
from iterserve.engine.model.tokenizer import Tokenizer

from .test_hf_parity import CHATS, RAW_PROMPTS
from .test_quantization import _logits

NEW_TOKENS = 8
MAX_LOGIT_ERROR = 1e-3  # logits span about +-20; fp32 reordering errors are ~1e-5


@pytest.mark.slow
@pytest.mark.beside_cluster
def test_compiled_greedy_tokens_equal_eager():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        tokenizer = Tokenizer.from_gguf(resolve_model_path(None)[0])
        prompts = RAW_PROMPTS + [tokenizer.apply_chat_template(chat) for chat in CHATS]
        llm = LLM(compile=True, device="cpu", dtype="float32", max_num_batched_tokens=64, max_num_seqs=16,
                  max_model_len=512, enable_prefix_caching=False, kv_cache_memory="64MiB")
        model = llm.engine.executor.model
        assert isinstance(model.compiled, CompiledForward)
        params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)

        def generate() -> list[list[int]]:
            return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

        compiled = generate()
        compiled_forward, model.compiled = model.compiled, None
        eager = generate()
        differing = [i for i, (a, b) in enumerate(zip(compiled, eager, strict=True)) if a != b]
        assert not differing, f"prompts {differing}: compiled {[compiled[i] for i in differing]} != eager"

        prompt = tokenizer.encode(RAW_PROMPTS[4])
        tokens = prompt + eager[4]
        with torch.inference_mode():
            errors = []
            # One prefill; the prompt prefilled, then one token per step (the decode path).
            for rows, prefill in ((None, 0), (1, len(prompt))):
                want = _logits(model, tokens, rows, prefill)
                model.compiled = compiled_forward
                got = _logits(model, tokens, rows, prefill)
                model.compiled = None
                assert torch.equal(got.argmax(-1), want.argmax(-1))
                errors.append(float((got - want).abs().max()))
        print(f"compiled vs eager: {len(prompts)} prompts x {NEW_TOKENS} greedy tokens equal; max logit error "
              f"prefill {errors[0]:.2e}, per-token {errors[1]:.2e}")
        assert max(errors) < MAX_LOGIT_ERROR
    finally:
        torch.set_num_threads(previous)
