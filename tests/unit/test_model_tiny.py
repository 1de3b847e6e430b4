"""The Llama decoder against HF transformers on a tiny random model: logits of a flat mixed batch,
and greedy tokens through the whole engine from both a GGUF file and an HF directory."""

from __future__ import annotations

import pytest
import torch

from iterserve.engine import LLM, SamplingParams
from iterserve.engine.attention import AttentionMetadata, get_backend
from iterserve.engine.model.llama import LlamaModel
from iterserve.engine.model.loader import load_model
from tests.unit import tiny_llama as tiny

PROMPTS = [[5, 17, 99, 3], list(range(40, 73)), [200, 201, 7, 7, 7, 9, 12, 255, 1, 2, 3], [42]]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    weights = tiny.hf_weights(seed=3)
    root = tmp_path_factory.mktemp("tiny")
    return tiny.write_gguf(root / "tiny.gguf", weights), tiny.write_hf_dir(root / "hf", weights)


@pytest.fixture(scope="module")
def reference(files):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(str(files[1]), dtype=torch.float32).eval()


@torch.inference_mode()
def hf_greedy(model, prompt: list[int], steps: int) -> list[int]:
    ids = list(prompt)
    for _ in range(steps):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


@torch.inference_mode()
def test_flat_batch_logits_match_transformers(files, reference):
    loaded = load_model(files[0], show_progress=False)
    model = LlamaModel.from_weights(loaded.config, loaded.weights, get_backend("torch"), torch.device("cpu"),
                                    torch.float32, max_positions=tiny.CONTEXT)
    block_size, blocks = 4, 32
    kv = [(torch.zeros(blocks, block_size, tiny.KV_HEADS, tiny.HEAD_DIM),
           torch.zeros(blocks, block_size, tiny.KV_HEADS, tiny.HEAD_DIM)) for _ in range(tiny.LAYERS)]
    # Sequence a: first 20 tokens prefilled in step 1, the other 13 in step 2 next to sequence b's prompt.
    a, b = PROMPTS[1], PROMPTS[2]
    tables = [list(range(0, 9)), list(range(20, 23))]
    step1 = AttentionMetadata.build([20], [20], tables[:1], block_size)
    model(torch.tensor(a[:20]), torch.arange(20), kv, step1)
    step2 = AttentionMetadata.build([13, len(b)], [33, len(b)], tables, block_size)
    hidden = model(torch.tensor(a[20:] + b), torch.tensor(list(range(20, 33)) + list(range(len(b)))), kv, step2)
    logits = model.compute_logits(hidden)
    want_a = reference(torch.tensor([a])).logits[0, 20:]
    want_b = reference(torch.tensor([b])).logits[0]
    torch.testing.assert_close(logits[:13], want_a, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits[13:], want_b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(("source", "mode"), [("gguf", "recompute"), ("hf", "swap")])
def test_engine_greedy_tokens_match_transformers(files, reference, source, mode):
    path = files[0] if source == "gguf" else files[1]
    # 12 blocks of 4 tokens for 4 sequences of up to 45 tokens: preemption is certain.
    llm = LLM(str(path), block_size=4, num_kv_blocks=12, num_cpu_blocks=24, max_num_batched_tokens=8,
              max_num_seqs=4, max_model_len=48, preemption_mode=mode, device="cpu")
    swapped_blocks = []
    execute = llm.engine.executor.execute
    llm.engine.executor.execute = lambda out: swapped_blocks.extend(out.swap_out) or execute(out)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(reference, p, 12) for p in PROMPTS]
    assert llm.engine.scheduler.num_preemptions > 0
    assert bool(swapped_blocks) == (mode == "swap")
    assert llm.engine.block_manager.usage() == 0.0
