"""Logprobs in OpenAI's two shapes, formatted in one place.

In: the engine's logprob entries (a token id, its logprob and the top alternatives; None for a
prompt's first token, which has no logprob). Out: the legacy completions object (tokens,
token_logprobs, top_logprobs, text_offset) or chat's content list (token, logprob, bytes,
top_logprobs).
"""

from __future__ import annotations


def token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


def completion_logprobs(tokenizer, token_ids: list[int], entries: list, text_offset: int) -> dict:
    """OpenAI's legacy completions logprobs, text offsets counted from text_offset.
    An entry of None (the prompt's first token) gives a null logprob and null top_logprobs."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for token_id, entry in zip(token_ids, entries, strict=True):
        piece = token_text(tokenizer, token_id)
        tokens.append(piece)
        offsets.append(text_offset)
        text_offset += len(piece)
        if entry is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(entry.logprob)
        top = {token_text(tokenizer, t): lp for t, lp in entry.top}
        top.setdefault(piece, entry.logprob)  # as vLLM: the chosen token is always among them
        top_logprobs.append(top)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}


def chat_logprobs(tokenizer, entries: list) -> list[dict]:
    """Chat's logprobs content list: each token with its UTF-8 bytes and its top alternatives."""
    def one(token_id: int, logprob: float) -> dict:
        text = token_text(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return [{**one(e.token_id, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]} for e in entries]
