"""Per-request sampling settings, validated where they enter the engine.

Every value the sampler, the stop checks and the detokenizer will see is checked here, so a request
the engine accepts can only fail later through a bug, never through a value: temperatures below
SAMPLING_EPS sample greedily (as in vLLM), seeds lie in the range torch's generators take, and the
stop lists are bounded (stop_token_ids is checked in O(1) per token through a frozenset).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from iterserve.engine.structured import StructuredOutput

# Below this temperature, sampling is greedy: dividing logits by 1e-39 overflows to inf/NaN.
SAMPLING_EPS = 1e-5
MAX_TEMPERATURE = 2.0
# torch.Generator.manual_seed accepts [-2**63, 2**64).
MIN_SEED, MAX_SEED = -(2**63), 2**64 - 1
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_TOKEN_ID = 2**31 - 1
MAX_PENALTY = 2.0  # |presence_penalty|, |frequency_penalty| (OpenAI's range); repetition_penalty <= 2
# A logit divided by a smaller repetition_penalty overflows float32 once temperature divides it too
# (5e-324 is 0.0 in float32: inf logits, NaN probabilities), so the range starts here.
MIN_REPETITION_PENALTY = 1e-4
MAX_LOGIT_BIAS_ENTRIES = 300
MAX_LOGIT_BIAS = 100.0
MAX_LOGPROBS = 1024  # the engine's bound; the server's --max-logprobs is usually lower


class InvalidRequestError(ValueError):
    """A request the engine refuses; `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass(slots=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    max_tokens: int = 16
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # Prefix caching, per request: skip it (neither reuse cached blocks nor offer this request's),
    # or salt it (only requests with the same salt share cached blocks).
    skip_prefix_cache: bool = False
    cache_salt: str | None = None
    # Logits processing (engine/sampler.py), applied to greedy and sampled rows alike: OpenAI's presence
    # and frequency penalties (on the generated tokens), HF's repetition penalty (on prompt and
    # generated tokens), a bias per token id, no EOS / stop token before min_tokens, and min_p.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0
    min_p: float = 0.0
    # Log-probabilities (engine/logprobs.py): None = none; n >= 0 = the chosen token's plus the n most
    # likely, for each generated token (logprobs) and each prompt token (prompt_logprobs).
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # Structured outputs (engine/structured): the output must match this grammar; the sampler masks
    # every other token.
    structured: StructuredOutput | None = None
    # stop_token_ids as a set, for the per-token check.
    stop_token_set: frozenset[int] = field(default=frozenset(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        _check(_is_int(self.max_tokens), "max_tokens", "must be an integer")
        _check(self.max_tokens >= 1, "max_tokens", f"must be at least 1, got {self.max_tokens}")
        _check(_is_number(self.temperature), "temperature", "must be a finite number")
        _check(0 <= self.temperature <= MAX_TEMPERATURE, "temperature",
               f"must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature}")
        _check(_is_number(self.top_p), "top_p", "must be a finite number")
        _check(0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(_is_int(self.top_k), "top_k", "must be an integer")
        _check(self.top_k == -1 or self.top_k >= 1, "top_k", f"must be -1 (off) or >= 1, got {self.top_k}")
        _check(self.seed is None or _is_int(self.seed), "seed", "must be an integer")
        _check(self.seed is None or MIN_SEED <= self.seed <= MAX_SEED, "seed",
               f"must be in [{MIN_SEED}, {MAX_SEED}], got {self.seed}")
        _check(isinstance(self.ignore_eos, bool), "ignore_eos", "must be true or false")
        _check(len(self.stop) <= MAX_STOP_STRINGS, "stop", f"may hold at most {MAX_STOP_STRINGS} strings")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        _check(all(len(s) <= MAX_STOP_STRING_CHARS for s in self.stop), "stop",
               f"strings may be at most {MAX_STOP_STRING_CHARS} characters long")
        _check(len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS, "stop_token_ids",
               f"may hold at most {MAX_STOP_TOKEN_IDS} token ids")
        _check(all(_is_int(t) and 0 <= t <= MAX_TOKEN_ID for t in self.stop_token_ids),
               "stop_token_ids", f"must be integers in [0, {MAX_TOKEN_ID}]")
        self.stop_token_set = frozenset(self.stop_token_ids)
        _check(isinstance(self.skip_prefix_cache, bool), "skip_prefix_cache", "must be true or false")
        _check(self.cache_salt is None or isinstance(self.cache_salt, str), "cache_salt", "must be a string")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_is_number(value) and -MAX_PENALTY <= value <= MAX_PENALTY, name,
                   f"must be a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value}")
        _check(_is_number(self.repetition_penalty)
               and MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_PENALTY, "repetition_penalty",
               f"must be in [{MIN_REPETITION_PENALTY:g}, {MAX_PENALTY:g}] (1 = off), got {self.repetition_penalty}")
        _check(_is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p", f"must be in [0, 1], got {self.min_p}")
        _check(_is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens, "min_tokens",
               f"must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(value is None or (_is_int(value) and 0 <= value <= MAX_LOGPROBS), name,
                   f"must be an integer in [0, {MAX_LOGPROBS}], got {value}")
        if self.prompt_logprobs is not None:
            self.skip_prefix_cache = True  # cached prompt blocks are never computed, so give no logprobs
        if self.logit_bias is not None:
            bias = self.logit_bias
            _check(isinstance(bias, dict) and len(bias) <= MAX_LOGIT_BIAS_ENTRIES, "logit_bias",
                   f"must map at most {MAX_LOGIT_BIAS_ENTRIES} token ids to biases")
            _check(all(_is_int(t) and 0 <= t <= MAX_TOKEN_ID for t in bias), "logit_bias",
                   f"keys must be token ids in [0, {MAX_TOKEN_ID}]")
            _check(all(_is_number(b) and -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS for b in bias.values()),
                   "logit_bias", f"biases must be numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
            self.logit_bias = dict(bias) or None
        _check(self.structured is None or hasattr(self.structured, "kind"), "structured",
               "must be an iterserve.engine.structured.StructuredOutput")

    @property
    def processes_logits(self) -> bool:
        """Whether the sampler changes this request's logits before choosing (penalties, bias, min_tokens)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_tokens)

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS or self.top_k == 1

    @classmethod
    def from_dict(cls, values: dict) -> SamplingParams:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise InvalidRequestError(
                f"unknown sampling field {unknown[0]!r}; known fields: {', '.join(sorted(known))}",
                param=unknown[0],
            )
        return cls(**values)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    if isinstance(value, bool):
        return False
    return isinstance(value, int) or (isinstance(value, float) and math.isfinite(value))


def _check(ok: bool, param: str, problem: str) -> None:
    if not ok:
        raise InvalidRequestError(f"{param} {problem}", param=param)
