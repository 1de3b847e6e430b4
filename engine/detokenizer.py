"""Incremental detokenization, once per new token (stop strings: engine/stop.py)."""

from __future__ import annotations

from iterserve.engine.sequence import Sequence


def append_new_text(seq: Sequence, tokenizer) -> str:
    """Decode seq's newest token(s) into text and append it to seq.output_text.

    Decoding a window (prefix_offset:) and diffing against the window without the newest tokens
    keeps each call O(window) and holds back bytes of a character that is not complete yet.
    """
    ids = seq.output_token_ids
    prefix_text = tokenizer.decode(ids[seq.detok_prefix_offset : seq.detok_read_offset])
    full_text = tokenizer.decode(ids[seq.detok_prefix_offset :])
    if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
        return ""
    new_text = full_text[len(prefix_text) :]
    seq.detok_prefix_offset = seq.detok_read_offset
    seq.detok_read_offset = len(ids)
    seq.output_text += new_text
    return new_text

