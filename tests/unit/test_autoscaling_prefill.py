"""The prefill pool's own decision (spec.disaggregation.prefill): queued prompt tokens
per replica or windowed p95 TTFT against the target, through the decode pool's tolerance,
stabilization, pending-capacity, rate-policy and bounds rules; and the TTFT quantile it reads
from histogram bucket deltas between scrapes."""

from __future__ import annotations

from dataclasses import replace

import pytest

from iterserve.operator.autoscaling.memory import (
    PodInfo,
    fresh_memory,
    record_decision,
    record_samples,
    state_for,
)
from iterserve.operator.autoscaling.policy import (
    DirectionRules,
    PodSample,
    PodState,
    RatePolicy,
    Recommendation,
    ScaleEvent,
    State,
    decide,
    histogram_quantile,
    windowed_ttft_quantile,
)
from iterserve.operator.autoscaling.report import Record, events_for
from iterserve.operator.autoscaling.settings import (
    PREFILL,
    PrefillSettings,
    Settings,
    settings_from_spec,
)
from iterserve.operator.models import InferenceServiceSpec

NOW = 10_000.0
INF = float("inf")
QUEUED = PrefillSettings(min_replicas=1, max_replicas=6, signal="QueuedPromptTokens", target_queued_prompt_tokens=1000)
TTFT = PrefillSettings(min_replicas=1, max_replicas=6, signal="TTFT", target_ttft_seconds=2.0)
# Windows off unless a case is about them, so each case shows one rule.
FAST = Settings(min_replicas=1, max_replicas=2, target_waiting_per_replica=10,
                scale_down=DirectionRules(0, (RatePolicy("Percent", 100, 15),)),
                warmup_seconds=30, cold_start_seconds=600, prefill=QUEUED)


def ready(name: str) -> PodState:
    return PodState(name, created_at=NOW - 3660, ready_at=NOW - 3600)


def sample(pod: str, at: float = NOW, queued: float | None = 0.0, buckets=None) -> PodSample:
    return PodSample(pod, at, waiting=0.0, running=1.0, kv_usage=0.1, preemptions_total=0.0, max_num_seqs=8.0,
                     queued_prompt_tokens=queued, ttft_buckets=buckets)


def queued(per_pod: dict[str, float], replicas: int | None = None, settings: Settings = FAST, **state):
    pods = tuple(ready(p) for p in per_pod)
    history = {p: [sample(p, NOW - 15), sample(p, queued=q)] for p, q in per_pod.items()}
    return decide(settings, State(replicas if replicas is not None else len(pods), pods, **state),
                  history, NOW, PREFILL)


# -- queued prompt tokens --------------------------------------------------------------------------
def test_queued_prompt_tokens_above_target_scale_the_prefill_pool_up_to_the_hpa_ratio():
    decision = queued({"p0": 2500, "p1": 1600})  # 4100 tokens / 1000 per replica -> 5
    assert (decision.current_replicas, decision.desired_replicas, decision.direction) == (2, 5, "up")
    assert decision.reason == "queued_prompt_tokens_above_target" and decision.pool == "prefill"
    assert decision.signal == "QueuedPromptTokens" and decision.signal_value == 2050 and decision.signal_target == 1000
    assert "4100" in decision.message
    applied = events_for(decision, Record(replicas_applied=True), name_pool=True)
    assert [e.reason for e in applied] == ["ScaleUp"] and applied[0].message.startswith("prefill pool: ")


def test_the_prefill_pool_has_its_own_bounds_not_the_decode_pools():
    # spec.autoscaling.maxReplicas is 2 (the decode pool's); the prefill pool's max is 6.
    unlimited = replace(FAST, scale_up=DirectionRules(0, ()))
    limited = queued({"p0": 9000}, settings=unlimited)
    assert limited.desired_replicas == 6
    assert limited.scaling_limited and limited.limited_reason == "TooManyReplicas"
    low = replace(FAST, min_replicas=3, prefill=replace(QUEUED, min_replicas=2))
    assert queued({"p0": 0, "p1": 0}, settings=low).desired_replicas == 2  # not 3: the decode pool's min


def test_a_queue_under_target_scales_down_and_one_within_tolerance_holds():
    down = queued({"p0": 100, "p1": 0, "p2": 50})
    assert (down.desired_replicas, down.direction, down.reason) == (1, "down", "queued_prompt_tokens_below_target")
    hold = queued({"p0": 1050, "p1": 1000})  # 2050 / 1000 = 2.05: within 10% of 2
    assert hold.desired_replicas == 2 and hold.reason == "within_tolerance"
    exactly = queued({"p0": 1000})  # at target is not above it
    assert exactly.desired_replicas == 1


def test_scale_down_waits_while_one_pod_is_above_target_or_one_is_loading():
    blocked = queued({"p0": 1500, "p1": 0, "p2": 0})  # 1500 total would be 2 replicas, but p0 is over
    assert blocked.desired_replicas == 3 and blocked.reason == "scale_down_blocked_queue"
    pods = (ready("p0"), ready("p1"), PodState("p2", created_at=NOW - 20))
    history = {"p0": [sample("p0")], "p1": [sample("p1")]}
    warming = decide(FAST, State(3, pods), history, NOW, PREFILL)
    assert warming.desired_replicas == 3 and warming.reason == "scale_down_blocked_warming"


def test_scale_down_stabilization_keeps_the_highest_recent_proposal():
    slow = replace(FAST, scale_down=DirectionRules(60, (RatePolicy("Percent", 100, 15),)))
    recent = (Recommendation(NOW - 30, 3),)
    held = queued({"p0": 0, "p1": 0, "p2": 0}, settings=slow, recommendations=recent)
    assert held.desired_replicas == 3 and held.reason == "stabilization_window"
    old = (Recommendation(NOW - 90, 3),)
    assert queued({"p0": 0, "p1": 0, "p2": 0}, settings=slow, recommendations=old).desired_replicas == 1


def test_scale_up_rate_policy_and_pending_pods_limit_the_prefill_pool_too():
    one_per_minute = replace(FAST, scale_up=DirectionRules(0, (RatePolicy("Pods", 1, 60),)))
    limited = queued({"p0": 5000}, settings=one_per_minute)
    assert limited.desired_replicas == 2 and limited.limited_reason == "ScaleUpLimit"
    spent = queued({"p0": 5000}, settings=one_per_minute, scale_events=(ScaleEvent(NOW - 30, 0, 1),))
    assert spent.desired_replicas == 1 and spent.reason == "rate_limited"
    # While a pod loads, the absolute proposal (queued tokens / target) still scales up past it...
    pods = (ready("p0"), PodState("p1", created_at=NOW - 20))
    absolute = decide(FAST, State(2, pods), {"p0": [sample("p0", queued=5000)]}, NOW, PREFILL)
    assert absolute.desired_replicas == 5 and absolute.reason == "queued_prompt_tokens_above_target"
    # ...the TTFT rule's (relative: replicas x p95 / target) waits for it.
    slow = cumulative([0, 0, 0, 10, 0, 0])
    history = {"p0": [sample("p0", NOW - 30, buckets=cumulative([0] * 6)), sample("p0", buckets=slow)]}
    pending = decide(FAST_TTFT, State(2, pods), history, NOW, PREFILL)
    assert pending.desired_replicas == 2 and pending.reason == "pending_replicas"


def test_a_pod_without_the_queued_tokens_gauge_is_unreadable_and_never_read_as_zero():
    pods = (ready("p0"),)
    decision = decide(FAST, State(3, pods), {"p0": [sample("p0", queued=None)]}, NOW, PREFILL)
    assert decision.desired_replicas == 3 and decision.reason == "metrics_unavailable"
    assert "iterserve_scheduler_queued_prompt_tokens" in decision.metrics.message


def test_off_and_external_modes_leave_the_prefill_pool_to_the_spec():
    for mode, reason in (("Off", "autoscaling_off"), ("External", "external_mode")):
        decision = queued({"p0": 9000}, settings=replace(FAST, mode=mode))
        assert decision.desired_replicas == 1 and decision.reason == reason


# -- TTFT ------------------------------------------------------------------------------------------
BOUNDS = (0.5, 1.0, 2.5, 5.0, 10.0, INF)


def cumulative(counts: list[int]) -> tuple[tuple[float, float], ...]:
    total, out = 0, []
    for bound, count in zip(BOUNDS, counts, strict=True):
        total += count
        out.append((bound, float(total)))
    return tuple(out)


def test_histogram_quantile_interpolates_inside_the_bucket_like_prometheus():
    buckets = cumulative([10, 10, 0, 0, 0, 0])
    assert histogram_quantile(0.5, buckets) == 0.5
    assert histogram_quantile(0.75, buckets) == pytest.approx(0.75)
    assert histogram_quantile(0.95, cumulative([0, 0, 0, 0, 0, 4])) == 10.0  # +Inf: the highest finite bound
    assert histogram_quantile(0.95, cumulative([0] * 6)) is None


def test_the_ttft_quantile_is_over_the_window_only_and_survives_a_counter_reset():
    old_slow = cumulative([0, 0, 0, 0, 100, 0])  # 100 slow first tokens before the window
    now_fast = cumulative([20, 0, 0, 0, 100, 0])  # then 20 fast ones inside it
    history = [sample("p0", NOW - 120, buckets=old_slow), sample("p0", NOW - 70, buckets=old_slow),
               sample("p0", NOW, buckets=now_fast)]
    p95, count = windowed_ttft_quantile(0.95, [history], NOW, 60)
    assert count == 20 and p95 <= 0.5
    restarted = [sample("p0", NOW - 70, buckets=old_slow), sample("p0", NOW, buckets=cumulative([0, 0, 0, 3, 0, 0]))]
    p95, count = windowed_ttft_quantile(0.95, [restarted], NOW, 60)
    assert count == 3 and 2.5 < p95 <= 5.0


FAST_TTFT = replace(FAST, prefill=TTFT)


def ttft(p95_bucket_counts: list[int], replicas: int = 2, settings: Settings = FAST_TTFT):
    pods = tuple(ready(f"p{i}") for i in range(replicas))
    history = {p.name: [sample(p.name, NOW - 30, buckets=cumulative([0] * 6)),
                        sample(p.name, NOW, buckets=cumulative(p95_bucket_counts))] for p in pods}
    return decide(settings, State(replicas, pods), history, NOW, PREFILL)


def test_a_p95_ttft_above_target_scales_up_by_the_ratio_and_below_scales_down():
    slow = ttft([0, 0, 0, 10, 0, 0])  # every first token in 2.5..5 s: p95 ~4.9 s, target 2 s
    assert slow.signal == "TTFT" and 4.5 < slow.signal_value <= 5.0
    assert (slow.desired_replicas, slow.reason) == (5, "ttft_above_target")  # ceil(2 x 4.9 / 2)
    fast = ttft([10, 0, 0, 0, 0, 0])  # p95 under 0.5 s: ceil(2 x 0.49 / 2) = 1
    assert (fast.desired_replicas, fast.reason) == (1, "ttft_below_target")
    idle = ttft([0] * 6)  # no first token in the window: nothing to keep fast
    assert idle.desired_replicas == 1 and idle.signal_value is None


def test_the_memory_keeps_the_prefill_pools_proposals_for_its_own_stabilization():
    settings = replace(FAST, scale_down=DirectionRules(60, (RatePolicy("Percent", 100, 15),)))
    infos = [PodInfo(f"p{i}", NOW - 3660, NOW - 3600) for i in range(3)]
    memory = fresh_memory(3, NOW - 100)
    memory = record_samples(memory, [sample(f"p{i}", NOW - 15, queued=3000) for i in range(3)],
                            [p.name for p in infos], settings, NOW - 15)
    up = decide(settings, state_for(memory, 3, infos), memory.history, NOW - 15, PREFILL)
    memory = record_decision(memory, up, settings, NOW - 15, up.replicas_changed, ())
    memory = record_samples(memory, [sample(f"p{i}", NOW, queued=0) for i in range(3)],
                            [p.name for p in infos], settings, NOW)
    down = decide(settings, state_for(memory, 3, infos), memory.history, NOW, PREFILL)
    assert down.desired_replicas == 3 and down.reason == "stabilization_window"


def test_settings_from_spec_carry_the_prefill_pool_only_with_disaggregation_on():
    base = {"model": {"uri": "smollm2-135m"}, "autoscaling": {}}
    assert settings_from_spec(InferenceServiceSpec.model_validate(base)).prefill is None
    spec = InferenceServiceSpec.model_validate({**base, "disaggregation": {"enabled": True, "prefill": {
        "minReplicas": 2, "maxReplicas": 5, "scalingSignal": "TTFT", "targetTtftSeconds": 1.5}}})
    settings = settings_from_spec(spec)
    assert settings.prefill == PrefillSettings(2, 5, "TTFT", 2048, 1.5)
    assert (settings.pool(PREFILL).min_replicas, settings.pool(PREFILL).max_replicas) == (2, 5)
    assert (settings.min_replicas, settings.max_replicas) == (1, 4)


def test_the_default_prefill_target_is_reachable_under_the_routers_default_queue_bound():
    # The router queues at most max_prefill_queue prompts (each over threshold_tokens) on a prefill
    # replica; a default target above what such a full queue holds would never scale the pool.
    from iterserve.router.disagg import PdPolicy
    router = PdPolicy()
    target = InferenceServiceSpec.model_validate(
        {"model": {"uri": "smollm2-135m"}, "disaggregation": {"enabled": True}}).disaggregation.prefill
    full_queue_of_short_long_prompts = router.max_prefill_queue * (router.threshold_tokens + 1)
    assert target.target_queued_prompt_tokens < full_queue_of_short_long_prompts
