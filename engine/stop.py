"""When a sequence stops: every stop rule, in one place.

A sequence stops on its end-of-sequence token (unless ignore_eos), on one of its stop_token_ids
(a frozenset: O(1) per token), at max_tokens or max_model_len ("length"), or when its text reaches
one of its stop strings (the text is cut before it). The token rules are checked by the scheduler
as it appends each sampled token, so a finished sequence frees its blocks in the same step; the
stop strings need the detokenized text, so the engine checks them right after detokenizing.
"""

from __future__ import annotations

from iterserve.engine.sequence import Sequence


def token_stop_reason(seq: Sequence, token: int, max_model_len: int) -> str | None:
    """"stop" or "length" if seq's newest token (already appended) ends it, else None."""
    params = seq.params
    if not params.ignore_eos and token == seq.eos_token_id:
        return "stop"
    if token in params.stop_token_set:
        return "stop"
    if len(seq.output_token_ids) >= params.max_tokens or seq.num_tokens >= max_model_len:
        return "length"
    return None


def cut_at_stop_string(seq: Sequence, new_text: str) -> tuple[str, bool]:
    """Apply seq's stop strings to new_text, just appended to seq.output_text: returns the part of
    new_text to stream and whether a stop string ended the sequence (output_text is then cut
    where the stop string starts)."""
    if not seq.params.stop or not new_text:
        return new_text, False
    cut = find_stop_string(seq, len(new_text))
    if cut == -1:
        return new_text, False
    new_text = new_text[: max(0, len(new_text) - (len(seq.output_text) - cut))]
    seq.output_text = seq.output_text[:cut]
    return new_text, True


def find_stop_string(seq: Sequence, new_text_len: int) -> int:
    """Index in seq.output_text where the first stop string starts, or -1."""
    text = seq.output_text
    best = -1
    for stop in seq.params.stop:
        start = max(0, len(text) - new_text_len - len(stop) + 1)
        index = text.find(stop, start)
        if index != -1 and (best == -1 or index < best):
            best = index
    return best
