"""e2e/autoscaling_modes.py's figures on hand-made timelines: a scaler that goes back to min while
the heavy load still runs is reported as such (negative back-to-min, a scale-down while heavy), the
queue's request-seconds integrate over the heavy phase only, and the chart's HPA gains the
running-sequences metric only when asked."""

from __future__ import annotations

from dataclasses import asdict

import pytest

from e2e.autoscaling_modes import chart_hpa, summarize
from e2e.wholeloop.scenario import Scenario

START = 1_800_000_000.0


def row(t, desired, ready, waiting=0, preemptions=None):
    pods = {} if preemptions is None else {"p": {"preemptions_total": preemptions}}
    return {"t": t, "replicas_desired": desired, "replicas_ready": ready, "waiting_total": waiting,
            "ttft_p95_s": None, "pods": pods}


def result(rows, requests=()):
    return {"scenario": asdict(Scenario.quick()), "started_at": START, "wall_seconds": 100.0,
            "phases": {"idle": [0, 10], "heavy": [10, 60], "light": [60, 100]},
            "timeline": rows, "decisions": [], "requests": list(requests)}


def request(start, ttft, ok=True):
    return {"start": START + start, "end": START + start + 1, "ok": ok, "status": "200" if ok else "503",
            "ttft": ttft, "endpoint": "x"}


def test_holding_replicas_until_the_load_ends():
    rows = [row(5, 1, 1), row(10, 1, 1, 10, preemptions=0), row(20, 3, 1, 20, preemptions=5),
            row(30, 3, 3, 0, preemptions=9), row(60, 3, 3, 0, preemptions=9), row(70, 1, 3), row(80, 1, 1)]
    summary = summarize(result(rows, [request(15, 1.0), request(40, 3.0), request(70, 9.0), request(20, None, ok=False)]))
    assert summary["first_scale_up_after_heavy_start_s"] == 10
    assert summary["two_ready_after_heavy_start_s"] == 20
    assert summary["back_to_min_after_heavy_end_s"] == 10 and summary["first_scale_down_during_heavy_s"] is None
    # 10 waiting for 10 s + 20 for 10 s; the 0s after count nothing; rows after the heavy phase are left out
    assert summary["heavy_waiting_request_seconds"] == 300 and summary["heavy_waiting_peak"] == 20
    assert summary["heavy_preemptions"] == 9
    assert summary["heavy_ttft_p95_s"] == 3.0  # the request sent after the heavy phase is left out
    assert (summary["requests_ok"], summary["requests_failed"]) == (3, 1)


def test_back_to_min_while_the_load_still_runs_is_negative():
    rows = [row(5, 1, 1), row(20, 3, 1, 20), row(30, 3, 3), row(50, 1, 3), row(55, 1, 1), row(60, 1, 1, 5),
            row(80, 1, 1)]
    summary = summarize(result(rows))
    assert summary["first_scale_down_during_heavy_s"] == 40
    assert summary["back_to_min_after_heavy_end_s"] == -10


def test_never_scaled_up_has_no_back_to_min():
    summary = summarize(result([row(5, 1, 1), row(30, 1, 1, 50), row(80, 1, 1)]))
    assert summary["first_scale_up_after_heavy_start_s"] is None and summary["back_to_min_after_heavy_end_s"] is None


@pytest.mark.slow
def test_the_chart_hpa_gets_the_running_metric_only_when_asked():
    scenario = Scenario.quick()
    plain = chart_hpa("team-a", scenario)
    assert [m["external"]["metric"]["name"] for m in plain["spec"]["metrics"]] == ["iterserve_waiting_requests"]
    assert plain["metadata"]["namespace"] == "team-a"
    assert plain["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == scenario.scale_down_window_seconds
    both = chart_hpa("team-a", scenario, running=8)
    assert [(m["external"]["metric"]["name"], m["external"]["target"]["averageValue"]) for m in both["spec"]["metrics"]] \
        == [("iterserve_waiting_requests", f"{scenario.target_waiting_per_replica:g}"), ("iterserve_running_sequences", "8")]
