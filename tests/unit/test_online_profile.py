"""The step profile fitted online from engines' step records, with a bounded window and the given
profile as the fallback; fed the real engine's recorded step logs (docs/perf/sim/cpu_profile)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from iterserve.replica_model import profile as profiles
from iterserve.replica_model.online import (
    FIT_ERROR_ABOVE_BOUND,
    FITTED,
    TOO_FEW_STEPS,
    OnlineProfile,
)

LOGS = Path(__file__).resolve().parents[2] / "docs" / "perf" / "sim" / "cpu_profile"


def _recorded() -> list[dict]:
    return [*profiles.read_step_log(LOGS / "train_steps-r1.jsonl"),
            *profiles.read_step_log(LOGS / "train_small_steps-r1.jsonl")]


def test_the_fit_takes_over_from_the_given_profile_once_it_has_enough_steps():
    given = profiles.load_profile("modelled-accelerator")
    online = OnlineProfile(given, window=300, min_steps=150, timing="cpu")
    records = _recorded()
    online.observe(records[:100])
    assert online.current() == (given, TOO_FEW_STEPS)
    online.observe(records[100:])
    fitted, reason = online.current()
    assert reason == FITTED and fitted is not given
    assert len(online.steps) == 300  # bounded: the newest steps only
    # It describes the recorded CPU engine (a lone decode ~26 ms of CPU), not the accelerator's 12 ms.
    lone_decode = fitted.step_seconds(profiles.StepFeatures(0, 1, 100, 1, 100))
    assert 0.018 < lone_decode < 0.04
    assert fitted.fit["test_errors"]["all"]["mean"] < 0.25


def test_a_fit_that_errs_beyond_the_bound_falls_back_to_the_given_profile():
    given = profiles.load_profile("smollm2-135m-cpu")
    rng = random.Random(1)
    noise = [dict(r, cpu_s=rng.uniform(0.001, 2.0)) for r in _recorded()]  # times unrelated to the steps
    online = OnlineProfile(given, window=400, min_steps=150, max_error=0.25, timing="cpu")
    online.observe(noise)
    assert online.current() == (given, FIT_ERROR_ABOVE_BOUND)


def test_records_that_are_not_a_steps_figures_are_dropped():
    online = OnlineProfile(profiles.load_profile("smollm2-135m-cpu"), window=50, min_steps=10)
    good = {"prefill_tokens": 0, "decode_tokens": 2, "num_seqs": 2, "context_tokens": 90, "duration_s": 0.1}
    bad = [dict(good, duration_s=float("nan")), dict(good, duration_s=-1.0), dict(good, decode_tokens="2"),
           dict(good, context_tokens=10**12), {"duration_s": 0.1}, "step", dict(good, num_seqs=True)]
    idle = dict(good, decode_tokens=0, num_seqs=0)
    online.observe([good, *bad, idle, good])
    assert online.dropped == len(bad) and len(online.steps) == 2


def test_a_refit_that_describes_the_steps_no_better_keeps_the_profile_in_use():
    records = _recorded()
    random.Random(2).shuffle(records)
    online = OnlineProfile(profiles.load_profile("modelled-accelerator"), window=400, min_steps=150,
                           refit_every=50, timing="cpu")
    online.observe(records[:200])
    first, reason = online.current()
    assert reason == FITTED
    online.observe(records[200:])  # more steps of the same engine: the refit is no better
    assert online.current()[0] is first and online._new == 0  # refitted, and the one in use kept
    # Steps twice as slow: the profile in use no longer describes them, and the refit replaces it.
    online.observe([dict(r, cpu_s=2 * r["cpu_s"]) for r in records])
    second, reason = online.current()
    assert reason == FITTED and second is not first
    lone_decode = profiles.StepFeatures(0, 1, 100, 1, 100)
    assert second.step_seconds(lone_decode) == pytest.approx(2 * first.step_seconds(lone_decode), rel=0.2)
