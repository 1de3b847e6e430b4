"""The offline LLM API's input forms and ordering, on the fake model (no weights)."""

from __future__ import annotations

import pytest

from iterserve.engine import LLM, ConfigError, SamplingParams
from iterserve.engine.sampling_params import InvalidRequestError


@pytest.fixture(scope="module")
def llm():
    return LLM("fake", num_kv_blocks=64, max_model_len=256, max_num_seqs=4)


def test_prompt_forms_return_one_output_each_in_input_order(llm):
    tokenizer = llm.get_tokenizer()
    prompts = ["a much longer prompt than the others", [104, 105], {"prompt_token_ids": [120]}, "x"]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (3, 9, 1, 5)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [3, 9, 1, 5]
    assert outputs[0].prompt_token_ids == tokenizer.encode(prompts[0])
    assert outputs[1].prompt_token_ids == [104, 105] and outputs[2].prompt_token_ids == [120]
    assert all(o.finished and o.outputs[0].text == tokenizer.decode(o.outputs[0].token_ids) for o in outputs)


def test_single_string_and_single_token_list(llm):
    assert len(llm.generate("hello", SamplingParams(max_tokens=2), use_tqdm=False)) == 1
    [output] = llm.generate([104, 105, 106], SamplingParams(max_tokens=2), use_tqdm=False)
    assert output.prompt_token_ids == [104, 105, 106]


def test_chat_uses_the_template(llm):
    [output] = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=2), use_tqdm=False)
    assert output.prompt == "user: hi\nassistant: "
    assert len(llm.chat([[{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]],
                        use_tqdm=False)) == 2


def test_a_bad_prompt_raises_and_leaves_nothing_queued(llm):
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.generate(["fine", ""], SamplingParams(max_tokens=2), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.block_manager.usage() == 0.0


def test_mismatched_sampling_params_and_unknown_options_are_refused(llm):
    with pytest.raises(ValueError, match="2 prompts but 1 sampling_params"):
        llm.generate(["a", "b"], [SamplingParams()], use_tqdm=False)
    with pytest.raises(ConfigError, match="unknown engine option 'max_seqs'"):
        LLM("fake", max_seqs=3)
