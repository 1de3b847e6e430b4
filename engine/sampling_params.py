"""Per-request sampling settings, validated where they enter the engine."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


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

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        _check(isinstance(self.max_tokens, int) and not isinstance(self.max_tokens, bool),
               "max_tokens", "must be an integer")
        _check(self.max_tokens >= 1, "max_tokens", f"must be at least 1, got {self.max_tokens}")
        _check(isinstance(self.temperature, (int, float)), "temperature", "must be a number")
        _check(self.temperature >= 0, "temperature", f"must be >= 0, got {self.temperature}")
        _check(isinstance(self.top_p, (int, float)), "top_p", "must be a number")
        _check(0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(isinstance(self.top_k, int), "top_k", "must be an integer")
        _check(self.top_k == -1 or self.top_k >= 1, "top_k", f"must be -1 (off) or >= 1, got {self.top_k}")
        _check(self.seed is None or isinstance(self.seed, int), "seed", "must be an integer")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
               "stop_token_ids", "must be non-negative integers")
        _check(isinstance(self.skip_prefix_cache, bool), "skip_prefix_cache", "must be true or false")
        _check(self.cache_salt is None or isinstance(self.cache_salt, str), "cache_salt", "must be a string")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

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


def _check(ok: bool, param: str, problem: str) -> None:
    if not ok:
        raise InvalidRequestError(f"{param} {problem}", param=param)
