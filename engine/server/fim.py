"""Fill-in-the-middle for /v1/completions' `suffix`: StarCoder's prefix-suffix-middle prompt, for a
model whose vocabulary has the FIM tokens."""

from __future__ import annotations

from iterserve.engine.server.errors import invalid

FIM_TOKENS = ("<fim_prefix>", "<fim_suffix>", "<fim_middle>")


def fill_in_the_middle(tokenizer, prompt, suffix: str) -> str:
    backend = getattr(tokenizer, "backend", None)
    if backend is None or any(backend.token_to_id(token) is None for token in FIM_TOKENS):
        raise invalid("suffix: this model has no fill-in-the-middle tokens (<fim_prefix>, <fim_suffix>, "
                      "<fim_middle>); leave suffix out", "suffix")
    if not isinstance(prompt, str):
        raise invalid("suffix: only with a text prompt", "suffix")
    return f"<fim_prefix>{prompt}<fim_suffix>{suffix}<fim_middle>"
