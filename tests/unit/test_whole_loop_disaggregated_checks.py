"""The disaggregated whole loop's checks (e2e/wholeloop/disaggregated.py) on made-up timelines:
each pool must scale on its own load phase and hold on the other's, and both must come back."""

from __future__ import annotations

import time
from dataclasses import asdict

from e2e.wholeloop.disaggregated import DisaggregatedScenario, evaluate

START = time.time() - 1000


def _stamp(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(START + t))


def _result(prefill_up_at: float = 20, decode_up_at: float = 60, extra: list | None = None) -> dict:
    rows = []
    for t in range(150):
        prefill = 3 if prefill_up_at <= t < 100 else 1
        decode = 3 if decode_up_at <= t < 120 else 1
        rows.append({"t": float(t), "replicas_desired": decode, "replicas_ready": decode, "pods_live": decode,
                     "pods_terminating": 0, "waiting_total": 0, "request_rate": 1.0, "ttft_p95_s": 0.5, "pods": {},
                     "prefill_desired": prefill, "prefill_ready": prefill, "prefill_live": prefill,
                     "prefill_terminating": 0, "prefill_queued_prompt_tokens": 0, "prefill_signal_value": 0})
    decisions = [
        {"time": _stamp(prefill_up_at), "action": "ScaleUp", "reason": "queued_prompt_tokens_above_target",
         "message": "replicas 1 -> 3: prefill pool", "fromReplicas": 1, "toReplicas": 3, "pool": "prefill"},
        {"time": _stamp(decode_up_at), "action": "ScaleUp", "reason": "waiting_above_target",
         "message": "replicas 1 -> 3: waiting", "fromReplicas": 1, "toReplicas": 3, "pool": "decode"},
        {"time": _stamp(100), "action": "ScaleDown", "reason": "queued_prompt_tokens_below_target",
         "message": "replicas 3 -> 1: prefill pool", "fromReplicas": 3, "toReplicas": 1, "pool": "prefill"},
        {"time": _stamp(120), "action": "ScaleDown", "reason": "zero_traffic",
         "message": "replicas 3 -> 1: idle", "fromReplicas": 3, "toReplicas": 1, "pool": "decode"},
        *(extra or [])]
    events = [{"reason": d["action"], "type": "Normal", "message": f"{d['pool']} pool: {d['reason']}: {d['message']}",
               "time": d["time"]} for d in decisions]
    return {"scenario": asdict(DisaggregatedScenario.quick()), "model": "fake", "started_at": START,
            "wall_seconds": 150, "phases": {"idle": [0, 5], "long": [5, 45], "short": [45, 90], "light": [90, 149]},
            "timeline": rows, "decisions": decisions, "events": events,
            "requests": [{"start": START + 10, "end": START + 12, "ok": True, "status": "200", "ttft": 1.0,
                          "endpoint": "x"}],
            "load_via_router": True, "load_address": "router", "operator_forbidden": [],
            "router_pd_decisions": {"remote": 5}}


def _failed(result: dict) -> set[str]:
    return {c.name for c in evaluate(result)[1] if not c.ok}


def test_each_pool_scaling_on_its_own_phase_passes_every_check():
    assert _failed(_result()) == set()


def test_a_decode_scale_up_under_long_prompts_fails_the_decode_hold_check():
    assert "decode_pool_held_under_long_prompts" in _failed(_result(decode_up_at=30))


def test_a_prefill_scale_up_under_short_prompts_fails_the_prefill_hold_check():
    late = {"time": _stamp(70), "action": "ScaleUp", "reason": "queued_prompt_tokens_above_target",
            "message": "replicas 3 -> 4: prefill pool", "fromReplicas": 3, "toReplicas": 4, "pool": "prefill"}
    assert "prefill_pool_held_under_short_prompts" in _failed(_result(extra=[late]))


def test_a_failed_request_or_no_remote_prefill_fails():
    result = _result()
    result["requests"].append({"start": START + 50, "end": START + 51, "ok": False, "status": "503", "ttft": None,
                               "endpoint": "x"})
    result["router_pd_decisions"] = {"below_threshold": 9}
    assert {"no_failed_requests", "long_prompts_prefilled_remotely"} <= _failed(result)
