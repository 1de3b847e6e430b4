"""The early prompt-length refusal (engine/server/prompt_length.py) on the embedded model's real
tokenizer: it never refuses a text that fits in max_model_len tokens, even one made of the
vocabulary's longest token, and refuses one character past its bound with a 400 naming the field."""

from __future__ import annotations

import pytest

from iterserve.engine.model.registry import resolve_model_path
from iterserve.engine.model.tokenizer import Tokenizer
from iterserve.engine.server.errors import APIError
from iterserve.engine.server.prompt_length import (
    check_prompt_chars,
    max_chars_per_token,
    max_prompt_chars,
)


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_path(resolve_model_path(None)[0])


def test_no_text_has_fewer_tokens_than_the_bound_assumes(tokenizer):
    per_token = max_chars_per_token(tokenizer)
    longest = max(tokenizer.backend.get_vocab(with_added_tokens=True), key=len)
    assert per_token >= len(longest) > 1
    spelled = tokenizer.decode([tokenizer.backend.token_to_id(longest)])
    texts = [spelled * 50, "word " * 2000, "\n" * 3000, "x" * 4000, "日本語のテキスト" * 300,
             '{"key": [1, 2, 3]}' * 200, "<|im_start|>" * 100]
    for text in texts:
        assert len(tokenizer.encode(text)) >= len(text) / per_token, text[:20]


def test_a_prompt_one_character_past_the_bound_is_refused_naming_the_field(tokenizer):
    limit = max_prompt_chars(tokenizer, 2048)
    check_prompt_chars(limit, tokenizer, 2048, "prompt")
    with pytest.raises(APIError) as refused:
        check_prompt_chars(limit + 1, tokenizer, 2048, "messages")
    error = refused.value
    assert (error.status, error.param, error.code) == (400, "messages", "context_length_exceeded")
    assert f"{limit + 1} characters" in error.message and "2048 tokens" in error.message


def test_a_conversation_is_checked_again_once_rendered_with_the_templates_own_text():
    from iterserve.engine.fake_executor import FakeTokenizer
    from iterserve.engine.server.chat_tools import render_chat

    tokenizer = FakeTokenizer()
    limit = max_prompt_chars(tokenizer, 64)
    render_chat(tokenizer, [{"role": "user", "content": "a" * (limit - 20)}], None, 64)
    with pytest.raises(APIError) as refused:  # fits by its content, not with "user: ... assistant: "
        render_chat(tokenizer, [{"role": "user", "content": "a" * limit}], None, 64)
    assert refused.value.param == "messages" and refused.value.code == "context_length_exceeded"
