"""The offline API's lora_request, as vLLM spells it, on the embedded model: a LoRARequest(name,
int id, path) read on first use or a served adapter's name, one for all prompts or one per prompt
(None: the base model), gives the tokens the engine gives a request of that adapter; misuse is
refused naming the argument."""

from __future__ import annotations

import pytest
import torch

from iterserve.engine import LLM, LoRARequest, SamplingParams
from iterserve.engine.config import ConfigError
from iterserve.engine.lora.adapter import LoraError, UnknownAdapterError
from tests.lora_fixture import write_adapter

PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("lora-llm")
    write_adapter(root / "a", 4, ("q_proj", "v_proj", "down_proj"), seed=1)
    write_adapter(root / "b", 4, ("o_proj", "up_proj"), seed=2)
    llm = LLM(device="cpu", dtype="float32", quantization="none", enable_lora=True, max_loras=2, max_lora_rank=4,
              max_num_seqs=4, max_model_len=256)
    llm.root = root
    yield llm
    llm.engine.close()
    torch.set_num_threads(previous)


def engine_tokens(llm, prompt: str, lora: str | None) -> list[int]:
    request_id = llm.engine.add_request(prompt, PARAMS, lora_name=lora)
    while True:
        for out in llm.engine.step():
            if out.finished and out.request_id == request_id:
                return list(out.outputs[0].token_ids)


def tokens(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_lora_request_per_prompt_and_for_all_equals_the_engine_s_adapter_requests(llm):
    prompts = ["The best thing about Paris is", "Once upon a time", "def add(a, b):"]
    a, b = LoRARequest("a", 1, str(llm.root / "a")), LoRARequest("b", 2, str(llm.root / "b"))
    per_prompt = tokens(llm.generate(prompts, PARAMS, use_tqdm=False, lora_request=[a, None, b]))
    assert {info.name for info in llm.engine.lora.adapters()} == {"a", "b"}  # read on first use
    assert per_prompt == [engine_tokens(llm, prompts[0], "a"), engine_tokens(llm, prompts[1], None),
                          engine_tokens(llm, prompts[2], "b")]
    for_all = tokens(llm.generate(prompts, PARAMS, use_tqdm=False, lora_request="b"))  # by name, once read
    assert for_all == [engine_tokens(llm, p, "b") for p in prompts]
    assert tokens(llm.generate(prompts[:1], PARAMS, use_tqdm=False, lora_request=a)) == per_prompt[:1]
    base = tokens(llm.generate(prompts, PARAMS, use_tqdm=False))
    assert base[0] != per_prompt[0] and base[2] != per_prompt[2]  # the adapters change the text
    chat = llm.chat([{"role": "user", "content": "Hi"}], PARAMS, use_tqdm=False, lora_request=a)
    assert tokens(chat) != tokens(llm.chat([{"role": "user", "content": "Hi"}], PARAMS, use_tqdm=False))


def test_misuse_is_refused_naming_the_argument(llm, tmp_path):
    with pytest.raises(UnknownAdapterError, match="'nobody'"):
        llm.generate(["hi"], PARAMS, use_tqdm=False, lora_request="nobody")
    with pytest.raises(ValueError, match="2 prompts but 1 lora_request"):
        llm.generate(["hi", "there"], PARAMS, use_tqdm=False, lora_request=["a"])
    with pytest.raises(ValueError, match="lora_int_id 1 is adapter 'a', not 'c'"):
        llm.generate(["hi"], PARAMS, use_tqdm=False, lora_request=LoRARequest("c", 1, str(llm.root / "a")))
    with pytest.raises(ValueError, match="adapter 'a' is served from .*, not lora_path"):
        llm.generate(["hi"], PARAMS, use_tqdm=False, lora_request=LoRARequest("a", 1, str(llm.root / "b")))
    with pytest.raises(LoraError, match="adapter_config.json"):
        llm.generate(["hi"], PARAMS, use_tqdm=False, lora_request=LoRARequest("gone", 9, str(tmp_path / "nowhere")))
    with pytest.raises(ValueError, match="lora_int_id must be an integer of at least 1"):
        LoRARequest("x", 0, "/x")
    assert len(tokens(llm.generate(["hi"], PARAMS, use_tqdm=False))[0]) == PARAMS.max_tokens  # nothing left queued


def test_lora_request_without_lora_on_names_the_option():
    llm = LLM(model="fake")
    try:
        with pytest.raises(ConfigError, match="enable_lora=True"):
            llm.generate(["hi"], PARAMS, use_tqdm=False, lora_request=LoRARequest("a", 1, "/a"))
    finally:
        llm.engine.close()
