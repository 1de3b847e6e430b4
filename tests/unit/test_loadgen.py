"""The load generator's pure parts: output-length distributions, percentiles, the report."""

from __future__ import annotations

import random
import statistics
from itertools import islice

import pytest

from iterserve.engine.loadgen import LoadSpec, RequestResult, output_lengths, percentiles, summarize


def _draw(dist: str, n: int = 4000, cap: int = 256) -> list[int]:
    return list(islice(output_lengths(LoadSpec(output_dist=dist, max_tokens=cap), random.Random(1)), n))


def test_output_length_distributions_stay_within_bounds_and_have_their_shapes():
    assert set(_draw("fixed", 10)) == {256}
    zipf, expo = _draw("zipf"), _draw("exponential")
    assert min(zipf) == 1 and max(zipf) <= 256 and min(expo) >= 1 and max(expo) <= 256
    # Zipf: most answers short, a long tail; exponential: mean near a quarter of the cap.
    assert statistics.median(zipf) < 20 and sum(n > 128 for n in zipf) > 40
    assert 55 < statistics.mean(expo) < 70


def test_percentiles_interpolate_between_ranks():
    stats = percentiles([float(v) for v in range(1, 101)])
    assert stats["p50"] == pytest.approx(50.5) and stats["p99"] == pytest.approx(99.01)
    assert stats["max"] == 100 and stats["mean"] == pytest.approx(50.5)
    assert percentiles([])["p95"] is None


def test_report_counts_errors_by_status_and_measures_itl_from_token_gaps():
    ok = RequestResult(status=200, ok=True, start=0.0, first_token=0.5, end=1.0,
                       token_times=[0.5, 0.6, 0.8], output_tokens=3, prompt_tokens=4)
    rejected = [RequestResult(status=429), RequestResult(status=429), RequestResult(status="ConnectError")]
    report = summarize([ok, *rejected], elapsed=2.0, spec=LoadSpec(), model="m")
    assert report["completed"] == 1 and report["failed"] == 3
    assert report["errors_by_status"] == {"429": 2, "ConnectError": 1}
    assert report["ttft_s"]["p50"] == 0.5 and report["itl_s"]["max"] == pytest.approx(0.2)
    assert report["output_throughput_tokens_per_s"] == 1.5


def test_spec_rejects_nonsense_naming_the_option():
    with pytest.raises(ValueError, match="--rate"):
        LoadSpec(rate=0).validate()
    with pytest.raises(ValueError, match="--output-dist"):
        LoadSpec(output_dist="uniform").validate()
