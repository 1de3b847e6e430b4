"""The whole-loop run's judgements on hand-made timelines: a scale-up past the formula or while
new pods still load is runaway; a failed request during the scale-down counts; every decision
needs its Event. And the ready endpoints leave terminating pods out."""

from __future__ import annotations

from dataclasses import asdict
from datetime import UTC, datetime

from e2e.wholeloop.checks import evaluate
from e2e.wholeloop.endpoints import ready_urls
from e2e.wholeloop.scenario import Scenario

START = 1_800_000_000.0


def stamp(t: float) -> str:
    return datetime.fromtimestamp(START + t, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def row(t, desired, ready, live=None, terminating=0):
    return {"t": t, "phase": "heavy", "replicas_desired": desired, "replicas_ready": ready,
            "pods_live": ready if live is None else live, "pods_terminating": terminating, "pods": {}}


def scale(t, action, frm, to, waiting=40, reason="waiting_above_target"):
    return {"time": stamp(t), "action": action, "reason": reason, "fromReplicas": frm, "toReplicas": to,
            "message": f"replicas {frm} -> {to}: waiting {waiting:g} on {frm} read pods (target 4/replica)",
            "signal": "WaitingRequests", "signalValue": waiting / frm, "target": 4, "metricReplicas": waiting / 4}


def result(decisions, rows, requests=(), events=None):
    return {
        "scenario": asdict(Scenario.quick()), "started_at": START, "wall_seconds": 1.0, "model": "fake",
        "phases": {"idle": [0, 10], "heavy": [10, 60], "light": [60, 100]},
        "timeline": rows, "decisions": decisions, "requests": list(requests), "operator_forbidden": [],
        "events": [{"reason": d["action"], "type": "Normal", "message": f"{d['reason']}: {d['message']}",
                    "time": d["time"]} for d in decisions] if events is None else events,
    }


def by_name(checks):
    return {c.name: c for c in checks}


def test_orderly_scale_up_and_down_pass():
    decisions = [scale(12, "ScaleUp", 1, 2, waiting=8), scale(20, "ScaleUp", 2, 3, waiting=12),
                 scale(70, "ScaleDown", 3, 1, waiting=0, reason="zero_traffic")]
    rows = [row(11, 1, 1), row(13, 2, 1, 2), row(17, 2, 2), row(21, 3, 2, 3), row(25, 3, 3),
            row(71, 1, 1, 1, 2), row(90, 1, 1)]
    checks = by_name(evaluate(result(decisions, rows))[1])
    for name in ("scaled_up_under_load", "no_runaway_scale_up", "back_to_min_replicas",
                 "decisions_are_events_and_history", "no_failed_requests_during_scale_down"):
        assert checks[name].ok, checks[name].detail


def test_a_preemption_scale_up_while_new_pods_load_or_one_past_the_formula_is_runaway():
    rows = [row(11, 1, 1), row(13, 2, 1, 2), row(15, 2, 1, 2), row(17, 3, 1, 3), row(30, 3, 3)]
    loading = [scale(12, "ScaleUp", 1, 2, waiting=8), scale(16, "ScaleUp", 2, 3, waiting=4, reason="preemptions")]
    detail = by_name(evaluate(result(loading, rows))[1])["no_runaway_scale_up"]
    assert not detail.ok and "were not all ready" in detail.detail
    # The waiting rule's proposal is absolute (the loading pod is in the 2 replicas): it may go on.
    absolute = [scale(12, "ScaleUp", 1, 2, waiting=8), scale(16, "ScaleUp", 2, 3, waiting=12)]
    assert by_name(evaluate(result(absolute, rows))[1])["no_runaway_scale_up"].ok

    past_formula = [scale(12, "ScaleUp", 1, 3, waiting=5)]  # ceil(5 / 4) = 2
    detail = by_name(evaluate(result(past_formula, [row(11, 1, 1), row(30, 3, 3)]))[1])["no_runaway_scale_up"]
    assert not detail.ok and "asks 2" in detail.detail


def test_a_failure_in_the_drain_and_an_unrecorded_decision_fail():
    decisions = [scale(12, "ScaleUp", 1, 2, waiting=8), scale(70, "ScaleDown", 2, 1, waiting=0)]
    failed = {"start": START + 69, "end": START + 72, "ok": False, "status": "503", "ttft": None, "endpoint": ""}
    events = result(decisions, [])["events"][:1]  # the ScaleDown never became an Event
    checks = by_name(evaluate(result(decisions, [row(11, 1, 1), row(20, 2, 2), row(90, 1, 1)],
                                     requests=[failed], events=events))[1])
    assert not checks["no_failed_requests_during_scale_down"].ok
    assert not checks["no_failed_requests"].ok and "503" in checks["no_failed_requests"].detail
    assert not checks["decisions_are_events_and_history"].ok


def test_ready_endpoints_skip_unready_and_terminating_pods():
    def pod(ip, ready=True, deleting=False):
        return {"metadata": {"deletionTimestamp": "x"} if deleting else {},
                "spec": {"containers": [{"ports": [{"name": "http", "containerPort": 8000}]}]},
                "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}

    pods = [pod("127.10.3.2"), pod("127.10.3.1"), pod("127.10.3.3", ready=False), pod("127.10.3.4", deleting=True)]
    assert ready_urls(pods, "http") == ["http://127.10.3.1:8000", "http://127.10.3.2:8000"]


def retune(t, readings, preemptions):
    return {"time": stamp(t), "action": "RetuneDown", "reason": "kv_pressure", "pod": "p", "fromMaxNumSeqs": 8,
            "toMaxNumSeqs": 6, "message": "KV usage above 0.95 or preempting for 3 samples: max_num_seqs 8 x 0.75 -> 6",
            "kvUsageReadings": readings, "preemptionsAtReadings": preemptions}


def pod_row(t, seqs, kv, preemptions):
    return dict(row(t, 1, 1), pods={"p": {"max_num_seqs": seqs, "kv_usage": kv, "preemptions_total": preemptions}})


def test_a_retune_counts_as_kv_pressure_when_usage_crossed_095_or_every_reading_preempted():
    """With recompute preemption usage drops at each eviction, so the readings may all sit under 0.95
    while every one of them saw preemptions, which need a full pool."""
    rows = [pod_row(t, 8, 0.8, t) for t in range(11, 30)] + [pod_row(t, 6, 0.5, 30) for t in range(31, 60)]
    for readings, preemptions, ok in [([0.951, 1.0, 0.902], [0, 0, 41], True),
                                      ([0.488, 0.854, 0.927], [1, 11, 8], True),
                                      ([0.488, 0.854, 0.927], [0, 2, 0], False)]:
        check = by_name(evaluate(result([retune(30, readings, preemptions)], rows))[1])["kv_retune_lowered_max_num_seqs"]
        assert check.ok == ok, (readings, check.detail)


def test_a_scale_up_record_without_its_numbers_is_runaway_evidence_missing():
    bare = {k: v for k, v in scale(12, "ScaleUp", 1, 2, waiting=8).items() if k != "metricReplicas"}
    check = by_name(evaluate(result([bare], [row(11, 1, 1), row(30, 2, 2)]))[1])["no_runaway_scale_up"]
    assert not check.ok and "without its numbers" in check.detail
