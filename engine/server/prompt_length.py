"""A prompt too long for the model refused by its length in characters, before any tokenizing.

In: a prompt's length in characters, the tokenizer and max_model_len. Out: nothing, or a 400
(context_length_exceeded) naming the field. Tokenizing is the costly part of a huge prompt (an
8 MiB body took seconds of a worker thread, only to be refused for its token count): this check is
O(1) and runs first.

Why it never refuses a prompt that fits: no token spells more characters than the vocabulary's
longest entry (SmolLM2's: 81, a newline and 80 spaces), so a text of C characters is at least
C / longest tokens. The text's characters are counted as sent; a tokenizer's normalizer could shorten
them (NFC composes a letter and its marks, or Hangul jamo, three characters into one), hence the
slack factor when the tokenizer has one. A tokenizer without a readable vocabulary (the fake
model's bytes) gets a generous fixed bound.
"""

from __future__ import annotations

import functools

from iterserve.engine.server.errors import invalid

UNKNOWN_TOKEN_CHARS = 128  # a bound for a tokenizer whose vocabulary cannot be read
NORMALIZER_SLACK = 4


@functools.lru_cache(maxsize=8)
def max_chars_per_token(tokenizer) -> int:
    """The most characters of text any one token can stand for (slack included)."""
    backend = getattr(tokenizer, "backend", None)  # the fake model's tokenizer has none
    if backend is None:
        return UNKNOWN_TOKEN_CHARS
    longest = max((len(token) for token in backend.get_vocab(with_added_tokens=True)), default=1)
    return max(1, longest) * (NORMALIZER_SLACK if backend.normalizer is not None else 1)


def max_prompt_chars(tokenizer, max_model_len: int) -> int:
    """Above this many characters a prompt cannot fit in max_model_len tokens."""
    return max_model_len * max_chars_per_token(tokenizer)


def check_prompt_chars(chars: int, tokenizer, max_model_len: int, field: str) -> None:
    limit = max_prompt_chars(tokenizer, max_model_len)
    if chars > limit:
        raise invalid(f"{field}: {chars} characters cannot fit in this model's maximum context length of "
                      f"{max_model_len} tokens (no token here spans more than {limit // max_model_len} "
                      f"characters, so at most {limit} characters could); shorten it", field,
                      "context_length_exceeded")
