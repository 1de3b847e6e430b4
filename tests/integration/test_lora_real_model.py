"""LoRA adapters on the embedded model against transformers + peft: the engine's logits equal
peft's (fp32), its greedy tokens equal peft's generate, a step mixing three adapters and the base
gives each request the tokens it gets alone, and cached prefixes are never shared across adapters."""

from __future__ import annotations

import pytest
import torch

from iterserve.engine import LLM, SamplingParams
from iterserve.engine.attention.backend import AttentionMetadata
from iterserve.engine.lora.adapter import UnknownAdapterError
from tests.lora_fixture import peft_adapters  # noqa: F401

pytestmark = pytest.mark.slow  # about a minute: a transformers model, three peft adapters, the engine

MAX_NEW = 10
PROMPT = "The three most useful kitchen tools are"
LONG_PROMPT = ("A recipe for bread: mix flour, water, salt and yeast; knead for ten minutes, let it rise "
               "for an hour, shape it, let it rise again and bake it in a hot oven until golden. ")


@pytest.fixture(scope="module")
def engine_llm(peft_adapters):  # noqa: F811
    root, _, specs = peft_adapters
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    llm = LLM(device="cpu", dtype="float32", quantization="none", max_loras=3, max_lora_rank=8,
              lora_modules=tuple(f"{s.name}={root / s.name}" for s in specs), max_num_seqs=8)
    yield llm
    llm.engine.close()
    torch.set_num_threads(previous)


def run(engine, requests: list[tuple[list[int], str | None]]) -> list[list[int]]:
    """Greedy tokens of each (prompt ids, adapter) request, all submitted before the first step."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    ids = [engine.add_request(None, params, prompt, lora_name=lora) for prompt, lora in requests]
    done = {}
    while len(done) < len(ids):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return [done[i] for i in ids]


def engine_logits(llm, prompt: list[int], lora: str | None) -> torch.Tensor:
    """Every position's logits of prompt through the engine's model (a fresh KV block range)."""
    runner = llm.engine.executor
    block_size = runner.block_size
    blocks = list(range(runner.num_kv_blocks - (len(prompt) + block_size - 1) // block_size, runner.num_kv_blocks))
    meta = AttentionMetadata.build([len(prompt)], [len(prompt)], [blocks], block_size, runner.device)
    model = runner.model
    model.lora_step = runner.lora.step([lora] * len(prompt))
    try:
        with torch.inference_mode():
            hidden = model(torch.tensor(prompt), torch.arange(len(prompt)), runner.kv_caches, meta)
            return model.compute_logits(hidden)
    finally:
        model.lora_step = None


def test_logits_and_greedy_tokens_equal_transformers_with_peft(engine_llm, peft_adapters):  # noqa: F811
    _, peft_model, specs = peft_adapters
    prompt = engine_llm.get_tokenizer().encode(PROMPT)
    for lora in [None, *(s.name for s in specs)]:
        with torch.inference_mode():
            if lora is None:
                with peft_model.disable_adapter():
                    reference = peft_model(torch.tensor([prompt])).logits[0]
                    hf_tokens = peft_model.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False,
                                                    min_new_tokens=MAX_NEW)[0, len(prompt):].tolist()
            else:
                peft_model.set_adapter(lora)
                reference = peft_model(torch.tensor([prompt])).logits[0]
                hf_tokens = peft_model.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False,
                                                min_new_tokens=MAX_NEW)[0, len(prompt):].tolist()
        logits = engine_logits(engine_llm, prompt, lora)
        scale = reference.abs().max()
        torch.testing.assert_close(logits, reference.float(), rtol=1e-4, atol=1e-4 * scale.item(),
                                   msg=lambda m, lora=lora: f"adapter {lora}: {m}")
        assert run(engine_llm.engine, [(prompt, lora)])[0] == hf_tokens, lora
    with torch.inference_mode():  # the adapters change the model: the base logits differ from each adapter's
        base = engine_logits(engine_llm, prompt, None)
        for spec in specs:
            assert (engine_logits(engine_llm, prompt, spec.name) - base).abs().max() > 1e-2, spec.name


def test_a_step_mixing_three_adapters_and_the_base_gives_each_request_its_own_tokens(engine_llm, peft_adapters):  # noqa: F811
    _, _, specs = peft_adapters
    tokenizer = engine_llm.get_tokenizer()
    prompts = [tokenizer.encode(p) for p in (PROMPT, "Once upon a time", "def add(a, b):")]
    names = [s.name for s in specs]
    # one adapter in two separate runs of rows, the base between adapters
    requests = [(prompts[0], names[0]), (prompts[1], None), (prompts[2], names[1]), (prompts[1], names[0]),
                (prompts[0], names[2]), (prompts[2], None)]
    alone = [run(engine_llm.engine, [request])[0] for request in requests]
    together = run(engine_llm.engine, requests)
    assert together == alone
    assert len({tuple(t) for t in alone[:1] + alone[4:5]}) == 2  # same prompt, two adapters: different text


def test_prefix_cache_never_shares_kv_across_adapters(engine_llm, peft_adapters):  # noqa: F811
    _, _, specs = peft_adapters
    engine = engine_llm.engine
    prompt = engine_llm.get_tokenizer().encode(LONG_PROMPT)
    assert len(prompt) >= 2 * engine.config.block_size
    cache = engine.block_manager.prefix_cache

    def hits_of(lora):
        before = cache.hits
        tokens = run(engine, [(prompt, lora)])[0]
        return cache.hits - before, tokens

    first_hits, first = hits_of(specs[0].name)
    other_hits, other = hits_of(specs[1].name)
    again_hits, again = hits_of(specs[0].name)
    base_hits, _ = hits_of(None)
    assert other_hits == 0 and base_hits == 0  # the same prompt under another adapter or the base: no reuse
    assert again_hits >= engine.config.block_size and again == first  # the same adapter again: reused, same tokens
    assert other != first


def test_an_unknown_adapter_is_refused_by_name(engine_llm):
    with pytest.raises(UnknownAdapterError, match="'no-such-adapter'"):
        engine_llm.engine.add_request("hi", SamplingParams(max_tokens=1), lora_name="no-such-adapter")
