"""What the engine hands back per request, shaped like vLLM's outputs."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    # One engine.logprobs.TokenLogprob per generated token, when the request asked for logprobs.
    logprobs: list | None = None


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    # Set when the request failed on its own (finish_reason "error"); the engine carried on.
    error: str | None = None
    # The request field at fault when its own input made it fail (a 400), else None (a 500).
    error_param: str | None = None
    # Per prompt token (None for the first), when the request asked for prompt_logprobs.
    prompt_logprobs: list | None = None
    # Prefill role: the lease on the prompt's KV blocks, for a decode engine to pull (kv_transfer).
    kv_transfer_params: dict | None = None
