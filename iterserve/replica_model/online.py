"""The step profile fitted online: from the steps an engine reports as it serves (its step-log
records: what each step did and how long it took), keep a bounded window of the newest ones and
refit the replica model's profile (profile.fit_profile, the same fit as `iterserve simulate fit`)
from them. Until the window holds enough steps, or while the fit errs on its own held-out steps
by more than a bound, the given profile stands: `current()` says which, and why.

In: step records (dicts as engine/step_log.py writes them), pushed as they come. Out: a
StepProfile and a machine-readable reason. Records that are not a step's figures (missing or
negative numbers, not finite, absurd sizes) are dropped and counted, so a misbehaving source
cannot poison the fit or grow the window.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from iterserve.replica_model.profile import StepProfile, fit_profile, split

FIELDS = ("prefill_tokens", "decode_tokens", "num_seqs", "context_tokens")
MAX_TOKENS_PER_STEP = 1 << 24  # far beyond any real step: a larger figure is not a step's
MAX_STEP_SECONDS = 600.0

FITTED, TOO_FEW_STEPS, FIT_ERROR_ABOVE_BOUND = "fitted", "too_few_steps", "fit_error_above_bound"


@dataclass
class OnlineProfile:
    given: StepProfile  # the fallback, and where the model's KV size and context length come from
    window: int = 2000  # newest steps kept
    min_steps: int = 200  # fewer: the given profile
    max_error: float = 0.25  # mean relative error on the held-out quarter above this: the given profile
    refit_every: int = 100  # new steps between fits
    timing: str = "step"  # "step": each step's duration_s; "cpu": its engine-thread CPU time (cpu_s)
    steps: deque = field(init=False)
    dropped: int = 0
    _new: int = 0
    _fitted: StepProfile | None = None
    _reason: str = TOO_FEW_STEPS

    def __post_init__(self) -> None:
        if self.timing not in ("step", "cpu"):
            raise ValueError(f"timing {self.timing!r}: use step or cpu")
        if not 0 < self.min_steps <= self.window:
            raise ValueError(f"min_steps ({self.min_steps}) must be in 1..window ({self.window})")
        self.steps = deque(maxlen=self.window)

    def observe(self, records: Iterable[dict]) -> None:
        """Add the steps that did something; malformed records are dropped (counted in `dropped`)."""
        key = "duration_s" if self.timing == "step" else "cpu_s"
        for record in records:
            step = _step(record, key)
            if step is None:
                self.dropped += 1
            elif step["prefill_tokens"] + step["decode_tokens"] > 0:
                self.steps.append(step)
                self._new += 1

    def current(self) -> tuple[StepProfile, str]:
        """The profile to plan with now, and why: fitted, too_few_steps or fit_error_above_bound."""
        if len(self.steps) < self.min_steps:
            return self.given, TOO_FEW_STEPS
        if self._fitted is None or self._new >= self.refit_every:
            train, test = split(list(self.steps))
            self._fitted = fit_profile(train, test, f"{self.given.name}-online", self.given.kv_bytes_per_token,
                                       self.given.model_context_len,
                                       source=f"fitted online on the newest {len(self.steps)} steps")
            self._new = 0
            error = self._fitted.fit["test_errors"]["all"]["mean"]
            self._reason = FITTED if error <= self.max_error else FIT_ERROR_ABOVE_BOUND
        return (self._fitted, FITTED) if self._reason == FITTED else (self.given, self._reason)


def _step(record: dict, key: str) -> dict | None:
    """The fit's figures of one step record, or None when they are not a step's."""
    if not isinstance(record, dict):
        return None
    out = {}
    for name in FIELDS:
        value = record.get(name)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_TOKENS_PER_STEP:
            return None
        out[name] = value
    for name in ("max_context_tokens", "prefill_attention_pairs"):
        value = record.get(name)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                return None
            out[name] = value
    seconds = record.get(key)
    if isinstance(seconds, bool) or not isinstance(seconds, int | float) or not math.isfinite(seconds) \
            or not 0 < seconds <= MAX_STEP_SECONDS:
        return None
    out["duration_s"] = float(seconds)
    return out
