"""The KV retune, per pod: lower max_num_seqs multiplicatively while the pod shows KV pressure
(usage above the threshold, or preempting) for enough consecutive samples, raise it additively
once the pod has been quiet for the recovery window, and bring it down to a lowered spec value.
Pure; part of the decode pool's decision (policy.decide), whose pods hold sequences.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from iterserve.operator.autoscaling.readings import (
    PodSample,
    PodState,
    effective_seqs,
    preemption_rate_per_minute,
)
from iterserve.operator.autoscaling.settings import Settings


@dataclass(frozen=True)
class SeqsChange:
    pod: str
    from_max_num_seqs: int
    to_max_num_seqs: int
    reason: str  # kv_pressure | kv_recovered | spec_lowered
    message: str
    # kv_pressure: the readings that showed it, and the preemption counter's rise at each one.
    kv_usage_readings: tuple[float, ...] = ()
    preemptions_at_readings: tuple[float, ...] = ()


def kv_retune(settings: Settings, ready: Sequence[PodState], history, now: float) -> tuple[SeqsChange, ...]:
    changes = []
    for pod in ready:
        samples = history.get(pod.name, ())
        if (not samples or not samples[-1].ok or samples[-1].at < now - settings.stale_sample_seconds
                or now - pod.ready_at < settings.warmup_seconds):
            continue
        change = _retune_pod(settings, pod, samples, now)
        if change is not None:
            changes.append(change)
    return tuple(changes)


def _at_cap(samples: Sequence[PodSample], cap: int) -> list[PodSample]:
    """The latest run of readable samples taken while the engine ran under `cap`. Lowering the
    cap never evicts running sequences, so until they drain below it the pool may still thrash:
    that is no evidence against the new value."""
    run: list[PodSample] = []
    for sample in reversed(samples):
        if (not sample.ok or (sample.max_num_seqs is not None and sample.max_num_seqs != cap)
                or (sample.running is not None and sample.running > cap)):
            break
        run.append(sample)
    return run[::-1]


@dataclass(frozen=True)
class _Pressure:
    description: str
    kv_usage: tuple[float, ...]  # each sample's KV usage
    preemptions: tuple[float, ...]  # each sample's rise of the preemption counter since the one before


def _pressure_run(observed: Sequence[PodSample], count: int, threshold: float) -> _Pressure | None:
    """KV pressure when each of the last `count` samples shows it, else None.

    A sample shows pressure when KV usage is above the threshold, or when the preemption counter
    rose since the sample before: with recompute preemption usage drops each time a sequence is
    evicted, so a thrashing pool can read below the threshold at any given instant."""
    if len(observed) < count:
        return None
    parts, usages, rises = [], [], []
    for index in range(len(observed) - count, len(observed)):
        sample = observed[index]
        if not sample.ok or sample.kv_usage is None:
            return None
        before = observed[index - 1] if index > 0 else None
        rise = (sample.preemptions_total - before.preemptions_total
                if before is not None and before.ok and before.preemptions_total is not None
                and sample.preemptions_total is not None and sample.preemptions_total > before.preemptions_total
                else 0.0)
        if sample.kv_usage > threshold:
            parts.append(f"{sample.kv_usage:.3f}")
        elif rise:
            parts.append(f"{sample.kv_usage:.3f} (+{rise:g} preemptions)")
        else:
            return None
        usages.append(sample.kv_usage)
        rises.append(rise)
    return _Pressure(f"KV usage {', '.join(parts)} above {threshold:g} or preempting", tuple(usages), tuple(rises))


def _retune_pod(settings: Settings, pod: PodState, samples: Sequence[PodSample], now: float) -> SeqsChange | None:
    kv = settings.kv_retune
    current = effective_seqs(pod, samples[-1], settings)
    spec = settings.spec_max_num_seqs
    if current > spec:
        return SeqsChange(pod.name, current, spec, "spec_lowered", f"spec maxNumSeqs is {spec}, pod runs {current}")
    since = pod.ready_at + settings.warmup_seconds
    if pod.max_num_seqs_changed_at is not None:
        since = max(since, pod.max_num_seqs_changed_at)
    observed = [s for s in samples if s.at >= since]

    pressure = _pressure_run(_at_cap(observed, current), kv.consecutive_samples, kv.threshold)
    if pressure is not None:
        lowered = max(kv.floor, math.floor(current * kv.step_factor))
        if lowered < current:
            return SeqsChange(pod.name, current, lowered, "kv_pressure",
                              f"{pressure.description} for {kv.consecutive_samples} samples: "
                              f"max_num_seqs {current} x {kv.step_factor:g} -> {lowered} (floor {kv.floor})",
                              pressure.kv_usage, pressure.preemptions)
        return None

    if current >= spec or since > now - kv.recovery_window_seconds:
        return None
    window = [s for s in observed if s.at >= now - kv.recovery_window_seconds]
    quiet = window and all(s.ok and s.kv_usage is not None and s.kv_usage < kv.recovery_threshold for s in window)
    if not quiet:
        return None
    rate = preemption_rate_per_minute(observed, now, kv.recovery_window_seconds)
    if rate is not None and rate > 0:
        return None
    raised = min(spec, current + kv.recovery_step)
    return SeqsChange(pod.name, current, raised, "kv_recovered",
                      f"KV usage below {kv.recovery_threshold:g} with no preemptions for "
                      f"{kv.recovery_window_seconds:g} s: max_num_seqs {current} + {kv.recovery_step} -> {raised}")
