"""The step profile fitted online: from the steps an engine reports as it serves (its step-log
records: what each step did and how long it took), keep a bounded window of the newest ones and
refit the replica model's profile (profile.fit_profile, the same fit as `iterserve simulate fit`)
from them; a refit replaces the fitted profile in use only when it errs KEEP_MARGIN less on the
newest held-out steps, so a steady engine keeps one profile (and the plans memoized on it).
Until the window holds enough steps, or while the fit errs on its own held-out steps by more
than a bound, the given profile stands: `current()` says which, and why.

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

import numpy as np

from iterserve.replica_model.profile import StepProfile, evaluate, fit_profile, split

FIELDS = ("prefill_tokens", "decode_tokens", "num_seqs", "context_tokens")
MAX_TOKENS_PER_STEP = 1 << 24  # far beyond any real step: a larger figure is not a step's
MAX_STEP_SECONDS = 600.0

FITTED, TOO_FEW_STEPS, FIT_ERROR_ABOVE_BOUND = "fitted", "too_few_steps", "fit_error_above_bound"
GIVEN = "given"  # no online fit asked for: the given profile, as given
WINDOW, MIN_STEPS, MAX_ERROR = 2000, 200, 0.25  # OnlineProfile's defaults
KEEP_MARGIN = 0.02  # a refit replaces the fitted profile in use only when it errs this much less


@dataclass(frozen=True)
class ProfileChoice:
    """Which profile a plan runs and why: `reason` is FITTED, TOO_FEW_STEPS, FIT_ERROR_ABOVE_BOUND
    or GIVEN (no online fit); the rest are the figures that decided it."""

    reason: str = GIVEN
    steps: int = 0
    error: float | None = None
    min_steps: int = MIN_STEPS
    max_error: float = MAX_ERROR

    def describe(self) -> str:
        if self.reason == FITTED:
            return f"fitted online on {self.steps} steps, {self.error:.0%} off on held-out steps"
        if self.reason == TOO_FEW_STEPS:
            return f"given: the online fit has {self.steps} of the {self.min_steps} steps it needs"
        if self.reason == FIT_ERROR_ABOVE_BOUND:
            off = "failed" if self.error is None or math.isinf(self.error) else f"is {self.error:.0%} off"
            return (f"given: the online fit on {self.steps} steps {off} on held-out steps "
                    f"(bound {self.max_error:.0%})")
        return "given"


@dataclass
class OnlineProfile:
    given: StepProfile  # the fallback, and where the model's KV size and context length come from
    window: int = WINDOW  # newest steps kept
    min_steps: int = MIN_STEPS  # fewer: the given profile
    max_error: float = MAX_ERROR  # mean relative error on the held-out quarter above this: the given profile
    refit_every: int = 100  # new steps between fits
    timing: str = "step"  # "step": each step's duration_s; "cpu": its engine-thread CPU time (cpu_s)
    steps: deque = field(init=False)
    dropped: int = 0
    error: float | None = None  # the last fit's mean relative error on its held-out steps (inf: it failed)
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

    def choice(self) -> ProfileChoice:
        """What `current()` chose, for a status and a message (call it after `current()`)."""
        return ProfileChoice(self._reason if len(self.steps) >= self.min_steps else TOO_FEW_STEPS,
                             len(self.steps), self.error, self.min_steps, self.max_error)

    def current(self) -> tuple[StepProfile, str]:
        """The profile to plan with now, and why: fitted, too_few_steps or fit_error_above_bound."""
        if len(self.steps) < self.min_steps:
            return self.given, TOO_FEW_STEPS
        if self._fitted is None or self._new >= self.refit_every:
            train, test = split(list(self.steps))
            self._new = 0
            try:
                fitted = fit_profile(train, test, f"{self.given.name}-online", self.given.kv_bytes_per_token,
                                     self.given.model_context_len,
                                     source=f"fitted online on the newest {len(self.steps)} steps")
                error = float(fitted.fit["test_errors"]["all"]["mean"])
                if self._reason == FITTED and self._fitted is not None:
                    # The profile in use stays while it describes the newest steps about as well as
                    # the refit: a plan is memoized per profile, and a profile that changes with
                    # every refit makes every tick plan from cold.
                    kept = float(evaluate(self._fitted, test)["all"].mean)
                    if kept <= error + KEEP_MARGIN:
                        fitted, error = self._fitted, kept
                self._fitted = fitted
            except (ValueError, ArithmeticError, np.linalg.LinAlgError):  # steps no model fits (all alike)
                self._fitted, error = self.given, math.inf
            self.error = error if math.isfinite(error) else math.inf  # a NaN error is no fit either
            self._reason = FITTED if self.error <= self.max_error else FIT_ERROR_ABOVE_BOUND
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
