"""What the run must show, judged from the API's records and the engines' own metrics, and the
summary of the figures behind each judgement. The autoscaler's numbers are read from the fields
of its scalingHistory records (metricReplicas, kvUsageReadings, ...), never from its messages."""

from __future__ import annotations

import math
from dataclasses import dataclass

from e2e.wholeloop.timeline import epoch

ACTIONS = ("ScaleUp", "ScaleDown", "RetuneDown", "RetuneUp")
AFTER_RETUNE_SETTLE_SECONDS = 8  # running sequences above the new cap finish first
MIN_AFTER_WINDOW_SECONDS = 10


@dataclass
class Check:
    name: str
    ok: bool
    detail: str


def _rows(result: dict) -> list[dict]:
    return [r for r in result["timeline"] if "error" not in r]


def _t(result: dict, stamp: str) -> float:
    return epoch(stamp) - result["started_at"]


def _pod_series(rows: list[dict], pod: str, key: str) -> list[tuple[float, float]]:
    return [(r["t"], r["pods"][pod][key]) for r in rows
            if pod in r["pods"] and r["pods"][pod].get(key) is not None]


def _rate(points: list[tuple[float, float]], start: float, end: float) -> float | None:
    """Counter increase per minute between the first and last sample in [start, end]."""
    inside = [(t, v) for t, v in points if start <= t <= end]
    if len(inside) < 2 or inside[-1][0] - inside[0][0] < 5:
        return None
    return (inside[-1][1] - inside[0][1]) * 60 / (inside[-1][0] - inside[0][0])


def _replica_changes(rows: list[dict]) -> list[list]:
    out, last = [], None
    for row in rows:
        now = (row["replicas_desired"], row["replicas_ready"], row["pods_terminating"])
        if now != last:
            out.append([row["t"], *now])
            last = now
    return out


def evaluate(result: dict) -> tuple[dict, list[Check]]:
    """(the summary of the run's figures, each judgement) for one whole-loop run."""
    rows, decisions = _rows(result), result["decisions"]
    ups = [d for d in decisions if d["action"] == "ScaleUp"]
    downs = [d for d in decisions if d["action"] == "ScaleDown"]
    retune_checks, summary_retune = _retune_checks(result, rows, decisions)
    drain_checks, failed, failed_in_drain = _request_checks(result, downs)
    checks = [_scaled_up(result, rows, ups), _no_runaway(result, rows, ups, downs), *retune_checks,
              _back_to_min(result, rows, downs), *drain_checks, _decisions_recorded(result, decisions),
              Check("operator_least_privilege", not result["operator_forbidden"],
                    f"{len(result['operator_forbidden'])} forbidden API calls in the operator log "
                    "(it runs as the chart's ServiceAccount)"),
              Check("load_through_the_router", bool(result.get("load_via_router")),
                    result.get("load_address") or "no load address recorded")]
    return _summary(result, rows, decisions, summary_retune, failed, failed_in_drain), checks


def _scaled_up(result: dict, rows: list[dict], ups: list[dict]) -> Check:
    heavy_start, heavy_end = result["phases"]["heavy"]
    heavy_rows = [r for r in rows if heavy_start <= r["t"] <= heavy_end + 10]
    max_ready_heavy = max((r["replicas_ready"] for r in heavy_rows), default=0)
    return Check("scaled_up_under_load", max_ready_heavy >= 2,
                 f"max ready replicas while heavy: {max_ready_heavy}; scale-ups: "
                 + ", ".join(f"{d['fromReplicas']}->{d['toReplicas']} at t={_t(result, d['time']):.0f}s" for d in ups))


def _no_runaway(result: dict, rows: list[dict], ups: list[dict], downs: list[dict]) -> Check:
    """Each scale-up within what the signal asked for; none of the preemption rule's +1 (relative
    to the replicas, so it would compound) while the previous one's pods load. A waiting scale-up
    (absolute: total waiting / target, with the loading pods already in the replicas) may."""
    scenario, problems = result["scenario"], []
    for record in ups:
        if record.get("metricReplicas") is None:
            problems.append(f"ScaleUp without its numbers: {record['message']!r}")
            continue
        allowed = min(scenario["max_replicas"], max(math.ceil(record["metricReplicas"]), record["fromReplicas"] + 1
                                                    if record["reason"] == "preemptions" else 0))
        if record["toReplicas"] > max(allowed, record["fromReplicas"]):
            problems.append(f"{record['fromReplicas']}->{record['toReplicas']} but {record.get('signal')} "
                            f"{record.get('signalValue')} (target {record.get('target')}) asks {allowed}")
    ordered = sorted(ups + downs, key=lambda d: d["time"])
    for first, second in zip(ordered, ordered[1:], strict=False):
        if first["action"] != "ScaleUp" or second["action"] != "ScaleUp" or second["reason"] != "preemptions":
            continue
        t1, t2 = _t(result, first["time"]), _t(result, second["time"])
        if not any(t1 <= r["t"] <= t2 + 1.5 and r["replicas_ready"] >= first["toReplicas"] for r in rows):
            problems.append(f"scale-up to {second['toReplicas']} at t={t2:.0f}s while the {first['toReplicas']} "
                            f"asked for at t={t1:.0f}s were not all ready")
    over_max = [r["t"] for r in rows if (r["replicas_desired"] or 0) > scenario["max_replicas"]]
    if over_max:
        problems.append(f"replicas above maxReplicas at t={over_max[:3]}")
    return Check("no_runaway_scale_up", not problems,
                 "; ".join(problems) or f"{len(ups)} scale-ups, each within the formula, no "
                                        "preemption +1 while earlier new pods were loading")


def _retune_checks(result: dict, rows: list[dict], decisions: list[dict]) -> tuple[list[Check], dict]:
    """A replica under KV pressure got a lower max_num_seqs, and its preemption rate fell."""
    scenario = result["scenario"]
    retunes = [d for d in decisions if d["action"] == "RetuneDown" and d["reason"] == "kv_pressure"]
    summary = {"retuned_pod": None, "max_num_seqs_before": scenario["max_num_seqs"],
               "max_num_seqs_after": None, "preemptions_per_min_before": None,
               "preemptions_per_min_after": None, "kv_usage_max_before_retune": None}
    if not retunes:
        return [Check("kv_retune_lowered_max_num_seqs", False, "no RetuneDown (kv_pressure) decision"),
                Check("preemption_rate_fell_after_retune", False, "no retune")], summary
    heavy_end = result["phases"]["heavy"][1]
    pod = retunes[0]["pod"]
    pod_retunes = [d for d in retunes if d["pod"] == pod]
    t_first, t_last = _t(result, pod_retunes[0]["time"]), _t(result, pod_retunes[-1]["time"])
    seqs = _pod_series(rows, pod, "max_num_seqs")
    kv = [v for t, v in _pod_series(rows, pod, "kv_usage") if t_first - 6 <= t <= t_first + 1]
    before = [v for t, v in seqs if t < t_first - 1]
    after = [v for t, v in seqs if t > t_last + 1]
    counters = _pod_series(rows, pod, "preemptions_total")
    rate_before = _rate(counters, t_first - 20, t_first + 1)
    after_end = min(heavy_end, t_last + AFTER_RETUNE_SETTLE_SECONDS + 40)
    rate_after = _rate(counters, t_last + AFTER_RETUNE_SETTLE_SECONDS, after_end)
    summary.update(
        retuned_pod=pod, max_num_seqs_before=int(before[-1]) if before else scenario["max_num_seqs"],
        max_num_seqs_after=int(after[-1]) if after else None,
        preemptions_per_min_before=None if rate_before is None else round(rate_before, 1),
        preemptions_per_min_after=None if rate_after is None else round(rate_after, 1),
        kv_usage_max_before_retune=max(kv) if kv else None,
        retune_steps=[f"{d['fromMaxNumSeqs']}->{d['toMaxNumSeqs']} at t={_t(result, d['time']):.0f}s"
                      for d in pod_retunes])
    lowered = bool(after) and after[-1] < scenario["max_num_seqs"] and (not before or before[-1] == scenario["max_num_seqs"])
    # The operator's own readings (its evidence in the record) and ours, a second apart at most:
    # with recompute preemption usage dips at each eviction, so one of them may miss the peak.
    evidence = list(pod_retunes[0].get("kvUsageReadings") or [])
    summary["kv_usage_operator_readings"] = evidence
    # A recompute preemption happens only when the pool has no free block, so a sample that preempted
    # is one where usage reached 1.0 between readings (each eviction drops usage before the next).
    preempted = list(pod_retunes[0].get("preemptionsAtReadings") or [])
    full_between_readings = bool(evidence) and len(preempted) == len(evidence) and min(preempted) > 0
    pressured = max(kv + evidence, default=0) >= 0.95 or full_between_readings
    fell = (rate_before is not None and rate_after is not None and rate_after < rate_before
            and after_end - (t_last + AFTER_RETUNE_SETTLE_SECONDS) >= MIN_AFTER_WINDOW_SECONDS)
    return [Check("kv_retune_lowered_max_num_seqs", lowered and pressured,
                  f"pod {pod}: engine max_num_seqs {summary['max_num_seqs_before']} -> "
                  f"{summary['max_num_seqs_after']} ({', '.join(summary['retune_steps'])}); KV usage "
                  f"sampled before the first retune up to {summary['kv_usage_max_before_retune']}; the "
                  f"operator's readings {evidence}, preemptions at each {preempted}"),
            Check("preemption_rate_fell_after_retune", fell,
                  f"pod {pod}: {rate_before and round(rate_before, 1)} preemptions/min before the first "
                  f"retune, {rate_after and round(rate_after, 1)}/min from "
                  f"t={t_last + AFTER_RETUNE_SETTLE_SECONDS:.0f}s to t={after_end:.0f}s under the same load")], summary


def _back_to_min(result: dict, rows: list[dict], downs: list[dict]) -> Check:
    scenario, final = result["scenario"], rows[-1] if rows else {}
    at_min = (final.get("replicas_desired") == scenario["min_replicas"] == final.get("replicas_ready")
              == final.get("pods_live") and final.get("pods_terminating") == 0)
    return Check("back_to_min_replicas", at_min and bool(downs),
                 f"final: desired {final.get('replicas_desired')}, ready {final.get('replicas_ready')}, "
                 f"live pods {final.get('pods_live')}, terminating {final.get('pods_terminating')}; "
                 "scale-downs: " + ", ".join(f"{d['fromReplicas']}->{d['toReplicas']} at "
                                             f"t={_t(result, d['time']):.0f}s" for d in downs))


def _request_checks(result: dict, downs: list[dict]) -> tuple[list[Check], list[dict], list[dict]]:
    """No request failed during the scale-down drain (nor at all)."""
    requests = result["requests"]
    failed = [r for r in requests if not r["ok"]]
    drain_from = min((_t(result, d["time"]) for d in downs), default=None)
    in_drain = [r for r in requests if drain_from is not None and r["end"] - result["started_at"] >= drain_from - 1]
    failed_in_drain = [r for r in in_drain if not r["ok"]]
    statuses = sorted({r["status"] for r in failed})
    return [Check("no_failed_requests_during_scale_down", bool(downs) and not failed_in_drain,
                  f"{len(in_drain)} requests ended during/after the scale-down, {len(failed_in_drain)} failed"),
            Check("no_failed_requests", not failed,
                  f"{len(requests)} requests, {len(failed)} failed" + (f" ({', '.join(statuses)})" if failed else ""))
            ], failed, failed_in_drain


def _decisions_recorded(result: dict, decisions: list[dict]) -> Check:
    """Every decision is an Event and a scalingHistory record, with its numbers."""
    events = [e for e in result["events"] if e["reason"] in ACTIONS]
    unmatched_events = [e for e in events if not any(_same(e, d) for d in decisions)]
    unmatched_records = [d for d in decisions if not any(_same(e, d) for e in events)]
    numberless = [d for d in decisions if None in ((d.get("fromReplicas"), d.get("toReplicas"))
                                                   if d["action"].startswith("Scale")
                                                   else (d.get("fromMaxNumSeqs"), d.get("toMaxNumSeqs")))]
    return Check("decisions_are_events_and_history",
                 bool(decisions) and not (unmatched_events or unmatched_records or numberless),
                 f"{len(decisions)} records, {len(events)} Events; unmatched Events "
                 f"{[e['message'][:80] for e in unmatched_events]}, unmatched records "
                 f"{[d['message'][:80] for d in unmatched_records]}, without numbers {len(numberless)}")


def _summary(result: dict, rows: list[dict], decisions: list[dict], summary_retune: dict, failed: list[dict],
             failed_in_drain: list[dict]) -> dict:
    heavy_start, heavy_end = result["phases"]["heavy"]
    requests, final = result["requests"], rows[-1] if rows else {}
    heavy_ttft = [r["ttft"] for r in requests
                  if r["ttft"] is not None and heavy_start <= r["start"] - result["started_at"] <= heavy_end]
    return {
        "model": result["model"],
        "wall_seconds": result["wall_seconds"],
        "max_ready_replicas": max((r["replicas_ready"] for r in rows), default=0),
        "final_replicas": final.get("replicas_ready"),
        "failed_requests": len(failed),
        "failed_requests_during_scale_down": len(failed_in_drain),
        "requests": len(requests),
        "load_address": result.get("load_address"),
        **summary_retune,
        "heavy_ttft_p95_s": None if not heavy_ttft else round(sorted(heavy_ttft)[int(0.95 * (len(heavy_ttft) - 1))], 3),
        "decisions": [f"t={_t(result, d['time']):.0f}s {d['action']} "
                      + (f"{d['fromReplicas']}->{d['toReplicas']}" if d["action"].startswith("Scale")
                         else f"{d['pod']} {d['fromMaxNumSeqs']}->{d['toMaxNumSeqs']}") + f" ({d['reason']})"
                      for d in decisions],
        "replicas_over_time": _replica_changes(rows),  # [t, desired, ready, terminating] at each change
        "phases": result["phases"],
    }


def _same(event: dict, record: dict) -> bool:
    if event["reason"] != record["action"]:
        return False
    if record.get("pod") and f"pod {record['pod']}:" not in event["message"]:
        return False
    return record["message"][:300] in event["message"]
