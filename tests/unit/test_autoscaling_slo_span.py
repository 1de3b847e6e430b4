"""SLO mode's workload only from pods whose warm readings cover enough of the window: a pod just
past its warm-up reads a few seconds of counters, which in the whole loop turned 0.5 req/s into
1.3 req/s at twice the real lengths and scaled a lightly loaded pool up."""

from __future__ import annotations

import pytest

from iterserve.operator.autoscaling.slo import MIN_SPAN_FRACTION
from tests.unit.test_autoscaling_slo import (
    NOW,
    PodState,
    predicted,
    ready,
    run,
    served,
    settings_for,
    spec,
)

WINDOW = 120


def test_a_pod_with_seconds_of_warm_readings_gives_no_estimate_and_the_queue_signal_decides():
    s = spec({"ttftP95Ms": 45, "window": WINDOW})
    one = predicted(s, 10, 1)
    short = MIN_SPAN_FRACTION * WINDOW - 10
    pods = {"a": served("a", 10, one.ttft_p95_s, one.itl_p95_s, start=NOW - short, every=1)}
    d = run(settings_for(s), 1, pods, states=[ready("a")])
    assert d.slo.fallback and d.slo.workload is None and d.reason != "slo_predicted_miss", d.message
    assert "over 60 s of the window" in d.slo.note


def test_a_pod_still_short_of_the_span_is_assumed_to_take_the_counted_pods_share():
    s = spec({"ttftP95Ms": 45, "window": WINDOW})
    one = predicted(s, 10, 2)
    pods = {"a": served("a", 5, one.ttft_p95_s, one.itl_p95_s),
            "b": served("b", 5, one.ttft_p95_s, one.itl_p95_s, start=NOW - 20, every=5)}
    d = run(settings_for(s), 2, pods, states=[ready("a"), PodState("b", created_at=NOW - 200, ready_at=NOW - 600)])
    assert d.slo.workload.arrival_rate == pytest.approx(10, rel=0.01), d.message
