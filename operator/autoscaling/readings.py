"""What a pod's engine metrics say, read the way Prometheus would: the samples (PodSample), the
pod as the autoscaler knows it (PodState), counter rates and histogram quantiles over a window.
Pure: the decision (policy.py), the KV retune (retune.py) and the scrapers (metrics_source.py)
share them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from iterserve.operator.autoscaling.settings import Settings


@dataclass(frozen=True)
class PodSample:
    """One reading of one pod's engine metrics. `error` set means the reading failed."""

    pod: str
    at: float
    waiting: float | None = None
    running: float | None = None
    kv_usage: float | None = None
    preemptions_total: float | None = None
    max_num_seqs: float | None = None
    prompt_tokens_total: float | None = None  # prompt tokens of finished requests (for the average prompt)
    requests_total: float | None = None  # finished requests
    # The prefill pool's signals: prompt tokens not computed yet, and the TTFT histogram as
    # cumulative (upper bound, count) pairs, +Inf last.
    queued_prompt_tokens: float | None = None
    ttft_buckets: tuple[tuple[float, float], ...] | None = None
    # SLO mode: generated tokens of finished requests and the ITL histogram (cumulative, +Inf last).
    generation_tokens_total: float | None = None
    itl_buckets: tuple[tuple[float, float], ...] | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(frozen=True)
class PodState:
    name: str
    created_at: float
    ready_at: float | None = None  # None: not ready
    max_num_seqs: int | None = None  # effective value the operator last set; None: spec value
    max_num_seqs_changed_at: float | None = None


def preemption_rate_per_minute(samples: Sequence[PodSample], now: float, window: float) -> float | None:
    """Counter rate over the window, as Prometheus' rate() would give it; None when unknown.

    Uses the last sample before the window as the base, and treats a drop as a counter reset.
    """
    points = [(s.at, s.preemptions_total) for s in samples if s.ok and s.preemptions_total is not None]
    if not points:
        return None
    start = now - window
    base_index = 0
    for index, (at, _) in enumerate(points):
        if at <= start:
            base_index = index
    points = points[base_index:]
    if len(points) < 2 or points[-1][0] <= points[0][0]:
        return None
    increase = 0.0
    for (_, before), (_, after) in zip(points, points[1:], strict=False):
        increase += after - before if after >= before else after
    return increase * 60.0 / (points[-1][0] - points[0][0])


def usable_samples(samples: Sequence[PodSample], pod: PodState, settings: Settings) -> list[PodSample]:
    """Samples taken after the pod's warm-up ended."""
    if pod.ready_at is None:
        return []
    warm_from = pod.ready_at + settings.warmup_seconds
    return [s for s in samples if s.at >= warm_from]


def effective_seqs(pod: PodState, latest: PodSample | None, settings: Settings) -> int:
    if latest is not None and latest.ok and latest.max_num_seqs is not None and not math.isnan(latest.max_num_seqs):
        return int(latest.max_num_seqs)
    return pod.max_num_seqs if pod.max_num_seqs is not None else settings.spec_max_num_seqs


def histogram_quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float | None:
    """Prometheus' histogram_quantile over cumulative (upper bound, count) buckets, +Inf last:
    linear inside the bucket that holds the q-th observation; None without observations. An
    answer in the +Inf bucket is the highest finite bound (what Prometheus returns too)."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = bound, count
    return lower_bound


def _bucket_increase(samples: Sequence[PodSample], now: float, window: float,
                     field: str = "ttft_buckets") -> dict[float, float] | None:
    """One pod's histogram increase over the window: the latest reading less the last one at
    or before the window's start (else the first usable one); a reset counts from zero."""
    points = [s for s in samples if s.ok and getattr(s, field)]
    if len(points) < 2:
        return None
    start = now - window
    base = points[0]
    for sample in points:
        if sample.at <= start:
            base = sample
    latest = points[-1]
    if latest is base:
        return None
    before = dict(getattr(base, field))
    after = dict(getattr(latest, field))
    reset = any(after.get(bound, 0.0) < count for bound, count in before.items())
    return {bound: count - (0.0 if reset else before.get(bound, 0.0)) for bound, count in after.items()}


def windowed_ttft_quantile(q: float, histories: Sequence[Sequence[PodSample]], now: float,
                           window: float) -> tuple[float | None, int]:
    """(the q-quantile of TTFT over the last `window` seconds across pods, observations in it),
    from bucket deltas between readings, as rate()-then-histogram_quantile would give it."""
    return windowed_quantile(q, histories, now, window, "ttft_buckets")


def windowed_quantile(q: float, histories: Sequence[Sequence[PodSample]], now: float, window: float,
                      field: str) -> tuple[float | None, int]:
    """windowed_ttft_quantile for any histogram field of PodSample (ttft_buckets, itl_buckets)."""
    total: dict[float, float] = {}
    for samples in histories:
        increase = _bucket_increase(samples, now, window, field)
        for bound, count in (increase or {}).items():
            total[bound] = total.get(bound, 0.0) + count
    buckets = sorted(total.items())
    if not buckets:
        return None, 0
    return histogram_quantile(q, buckets), int(round(buckets[-1][1]))


def counter_increase(samples: Sequence[PodSample], field: str, now: float,
                     window: float) -> tuple[float, float] | None:
    """(increase, seconds it covers) of one pod's counter over the window, as increase() would
    give it (base: the last reading at or before the window's start, else the first; a drop is a
    reset); None without two readings of it."""
    points = [(s.at, getattr(s, field)) for s in samples if s.ok and getattr(s, field) is not None
              and not math.isnan(getattr(s, field))]
    if len(points) < 2:
        return None
    start = now - window
    base = 0
    for index, (at, _) in enumerate(points):
        if at <= start:
            base = index
    points = points[base:]
    if len(points) < 2 or points[-1][0] <= points[0][0]:
        return None
    increase = sum(after - before if after >= before else after
                   for (_, before), (_, after) in zip(points, points[1:], strict=False))
    return increase, points[-1][0] - points[0][0]
