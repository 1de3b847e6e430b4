"""One request's tokens, progress and state inside the engine."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from iterserve.engine.outputs import RequestMetrics
from iterserve.engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    WAITING_FOR_KV = "waiting_for_kv"  # decode role: has its blocks, its prompt KV is being pulled
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    prompt: str | None = None
    eos_token_id: int | None = None
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    # Tokens whose KV is in the cache; the step computes tokens[num_computed_tokens:].
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    # Prefix caching: chained hashes of the full blocks of the tokens so far (tokens only grow, so
    # they are computed once), and how many leading block_table entries were offered to the cache.
    block_hashes: list[int] = field(default_factory=list)
    num_cached_blocks: int = 0
    cpu_block_table: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    num_preemptions: int = 0
    output_text: str = ""
    detok_prefix_offset: int = 0
    detok_read_offset: int = 0
    metrics: RequestMetrics | None = None
    # Requested logprobs (engine/logprobs.py): one TokenLogprob per generated token, and per prompt
    # position (None for the first), filled by the sampler and the model runner.
    logprobs: list | None = None
    prompt_logprobs: list | None = None
    # Prefill/decode disaggregation (engine/kv_transfer/params.py KVTransferState), or None.
    kv_transfer: object | None = None
    # Speculative decoding (engine/spec_decode): this step's proposed tokens (they follow the real
    # tokens in token_slice, so a chunk can compute them; they are never part of num_tokens), the
    # distribution they were drawn from (None: deterministic), and the measured acceptance rate.
    spec_token_ids: list[int] = field(default_factory=list)
    spec_draft_probs: object | None = None
    spec_acceptance: float = 1.0
    spec_skipped: int = 0
    # engine/lora: the adapter this request runs (its `model`), None for the base model.
    lora_name: str | None = None

    def __post_init__(self) -> None:
        if self.metrics is None:
            self.metrics = RequestMetrics(arrival_time=self.arrival_time)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end); positions past num_tokens are this step's proposals."""
        num_tokens = self.num_tokens
        if end > num_tokens:
            head = self.token_slice(start, num_tokens) if start < num_tokens else []
            return head + self.spec_token_ids[max(0, start - num_tokens) : end - num_tokens]
        prompt_len = len(self.prompt_token_ids)
        if end <= prompt_len:
            return self.prompt_token_ids[start:end]
        if start >= prompt_len:
            return self.output_token_ids[start - prompt_len : end - prompt_len]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - prompt_len]

    @property
    def last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]
