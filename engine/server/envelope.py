"""What every OpenAI answer and stream chunk carries around its choices: id, object, created,
model and usage, built in one place for completions and chat, whole or streamed."""

from __future__ import annotations

import dataclasses
import time
import uuid

from iterserve.engine.outputs import RequestOutput
from iterserve.engine.server.protocol import _SamplingFields


class ResponseIds:
    """One answer's id, creation time and model name, shared by all of its chunks."""

    def __init__(self, prefix: str, model: str):
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model

    def body(self, kind: str, choices: list[dict], **extra) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices,
                **extra}


def usage_of(finals: list[RequestOutput], n: int) -> dict:
    """Token counts of choices in index order (n per prompt): each prompt counted once."""
    prompt = sum(len(f.prompt_token_ids) for f in finals[::n])
    completion = sum(len(f.outputs[0].token_ids) for f in finals)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


@dataclasses.dataclass(frozen=True, slots=True)
class StreamUsage:
    """stream_options: a last chunk with the usage of all choices, and (vLLM's continuous_usage_stats)
    each chunk with its own choice's usage so far."""

    final: bool = False
    continuous: bool = False

    @classmethod
    def of(cls, body: _SamplingFields) -> StreamUsage:
        options = body.stream_options
        return cls(bool(options and options.include_usage), bool(options and options.continuous_usage_stats))

    def chunk(self, ids: ResponseIds, kind: str, choice: dict, out: RequestOutput) -> dict:
        """One choice's chunk; with either option set it has a usage field (null unless continuous)."""
        if not (self.final or self.continuous):
            return ids.body(kind, [choice])
        return ids.body(kind, [choice], usage=usage_of([out], 1) if self.continuous else None)

    def last_chunk(self, ids: ResponseIds, kind: str, finals: dict[int, RequestOutput], n: int) -> list[dict]:
        """The closing usage chunk, if asked for: no choices, every choice's usage."""
        if not (self.final and finals):
            return []
        return [ids.body(kind, [], usage=usage_of([finals[i] for i in sorted(finals)], n))]
