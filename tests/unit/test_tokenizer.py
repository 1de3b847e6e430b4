"""The tokenizer built from GGUF metadata: token-id parity with HF transformers on the embedded
model, special tokens, decoding and chat templates."""

from __future__ import annotations

import pytest

from iterserve.engine.model.registry import resolve_model_path
from iterserve.engine.model.tokenizer import Tokenizer
from tests.unit import tiny_llama as tiny

PARITY_TEXTS = [
    "The capital of France is",
    "In 2024, 1,234,567 people paid $3.50 each (a 12.5% rise).",
    "héllo wörld: naïve café, Ελληνικά, русский, 日本語のテキスト, 한국어 🙂🚀",
    "  leading spaces,\ttabs\t\tand\n\nblank lines\r\n  ",
    "don't, I'll, we've, she's, THEY'RE",
    "def f(x):\n    return x ** 2  # square\n",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "",
]
CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Name a prime > 10."},
     {"role": "assistant", "content": "11"}, {"role": "user", "content": "Another, in Ελληνικά?"}],
]


@pytest.fixture(scope="module")
def smollm_path():
    return resolve_model_path(None)[0]


@pytest.fixture(scope="module")
def ours(smollm_path):
    return Tokenizer.from_gguf(smollm_path)


@pytest.fixture(scope="module")
def hf(smollm_path):
    from tests.hf_fixture import hf_tokenizer

    return hf_tokenizer(smollm_path)  # transformers' conversion of the GGUF, cached across sessions


@pytest.mark.slow
@pytest.mark.parametrize("text", PARITY_TEXTS)
def test_token_ids_match_transformers(ours, hf, text):
    ids = ours.encode(text)
    assert ids == hf.encode(text)
    assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    assert ours.decode(ids, skip_special_tokens=False) == hf.decode(ids, skip_special_tokens=False)


@pytest.mark.slow
@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_chat_template_matches_transformers(ours, hf, messages):
    text = ours.apply_chat_template(messages)
    assert text == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.encode(text) == hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                                       return_dict=False)


def test_smollm_special_ids_and_digit_split(ours):
    assert (ours.bos_token_id, ours.eos_token_id, ours.vocab_size) == (1, 2, 49152)
    assert ours.encode("<|im_start|>") == [1] and ours.decode([1, 2]) == ""
    # tokenizer.ggml.pre = "smollm": digits are split one by one, as llama.cpp does (\p{N} first,
    # then the GPT-2 rule). HF's GGUF loader ignores the field; the two agree on ASCII digits.
    assert [ours.backend.id_to_token(i) for i in ours.encode(" 2024")] == ["Ġ", "2", "0", "2", "4"]
    assert [ours.backend.id_to_token(i) for i in ours.encode("x²")] == ["x", "Â²"]


def test_tiny_gguf_and_hf_dir_tokenizers_agree(tmp_path):
    weights = tiny.hf_weights()
    from_gguf = Tokenizer.from_gguf(tiny.write_gguf(tmp_path / "t.gguf", weights))
    from_dir = Tokenizer.from_path(tiny.write_hf_dir(tmp_path / "hf", weights))
    text = from_gguf.apply_chat_template([{"role": "user", "content": "héllo"}])
    assert text == "<|im_start|>user\nhéllo<|im_end|>\n<|im_start|>assistant\n"
    ids = from_gguf.encode(text)
    assert ids[0] == 257 and ids[1:12] == list("user\nhéllo".encode())
    assert from_dir.encode(text) == ids
    assert from_dir.eos_token_id == from_gguf.eos_token_id == tiny.EOS_ID
    assert from_dir.chat_template == from_gguf.chat_template
    assert from_gguf.decode(ids) == "user\nhéllo\nassistant\n"


def test_missing_chat_template_is_a_clear_error(tmp_path):
    tokenizer = Tokenizer.from_gguf(tiny.write_gguf(tmp_path / "t.gguf", tiny.hf_weights()))
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])


def test_chat_template_runs_sandboxed(tmp_path):
    from jinja2.exceptions import SecurityError

    tokenizer = Tokenizer.from_gguf(tiny.write_gguf(tmp_path / "t.gguf", tiny.hf_weights()))
    tokenizer.chat_template = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(SecurityError):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
