"""The autoscaler's decision function, case by case, including every failure from REFERENCE.md's
list that a decision function can cause (runaway scale-up while loading, one bad scrape,
NaN/missing at zero traffic, warm-up samples, preemption thrash, the operator fighting an
external autoscaler). The replica table runs for both pools: the decode pool on waiting
requests, the prefill pool on queued prompt tokens (the same load, in its units), except the
cases about sequences a decode pod holds (preemptions, running sequences)."""

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
    KvRetuneSettings,
    PodSample,
    PodState,
    RatePolicy,
    Recommendation,
    ScaleEvent,
    Settings,
    State,
    decide,
    preemption_rate_per_minute,
)
from iterserve.operator.autoscaling.settings import (
    DECODE,
    PREFILL,
    QUEUED_PROMPT_TOKENS,
    PrefillSettings,
)

NOW = 10_000.0
NAN = float("nan")

# Windows off unless a case is about them, so each case shows one rule.
FAST = Settings(min_replicas=1, max_replicas=8, target_waiting_per_replica=10,
                scale_down=DirectionRules(0, (RatePolicy("Percent", 100, 15),)),
                warmup_seconds=30, cold_start_seconds=600, spec_max_num_seqs=16)


def ready(name: str, age: float = 3600) -> PodState:
    return PodState(name, created_at=NOW - age - 60, ready_at=NOW - age)


def loading(name: str, age: float = 30) -> PodState:
    return PodState(name, created_at=NOW - age)


def sample(pod: str, at: float = NOW, waiting=0.0, running=0.0, kv=0.1, preemptions=0.0, seqs=16.0,
           error=None) -> PodSample:
    if error:
        return PodSample(pod, at, error=error)
    return PodSample(pod, at, waiting, running, kv, preemptions, seqs)


def steady(pod: str, preemptions_per_minute: float = 0.0, **values) -> list[PodSample]:
    """Five samples 15 s apart ending now, the preemption counter rising at the given rate."""
    return [sample(pod, NOW - 15 * (4 - i), preemptions=100 + preemptions_per_minute * 15 * i / 60, **values)
            for i in range(5)]


def history(*series: list[PodSample]) -> dict[str, list[PodSample]]:
    out: dict[str, list[PodSample]] = {}
    for samples in series:
        for s in samples:
            out.setdefault(s.pod, []).append(s)
    return out


# Each case: id, settings, state, samples, expected desired replicas, expected reason.
CASES = [
    ("waiting above target scales up by the HPA formula",
     FAST, State(2, (ready("a"), ready("b"))),
     history(steady("a", waiting=30), steady("b", waiting=20)), 5, "waiting_above_target"),
    ("within the 10% tolerance nothing changes",
     FAST, State(2, (ready("a"), ready("b"))),
     history(steady("a", waiting=11), steady("b", waiting=10)), 2, "within_tolerance"),
    ("runaway while loading: pods not ready yet count as capacity coming",
     FAST, State(4, (ready("a"), ready("b"), loading("c"), loading("d"))),
     history(steady("a", waiting=20), steady("b", waiting=20)), 4, "within_tolerance"),
    ("runaway while loading: pods asked for but not created yet count too",
     FAST, State(4, (ready("a"), ready("b")), last_scale_up_at=NOW - 5),
     history(steady("a", waiting=20), steady("b", waiting=20)), 4, "within_tolerance"),
    ("while pods load, a queue that needs more than the replicas asked for still scales up (absolute)",
     FAST, State(3, (ready("a"), ready("b"), loading("c"))),
     history(steady("a", waiting=30), steady("b", waiting=30)), 6, "waiting_above_target"),
    ("while pods load, the preemption rule's +1 (relative) waits for them",
     FAST, State(3, (ready("a"), ready("b"), loading("c"))),
     history(steady("a", 12, waiting=5, running=16), steady("b", 12, waiting=5, running=16)), 3, "pending_replicas"),
    ("a pod stuck loading past the cold-start timeout stops counting",
     FAST, State(3, (ready("a"), ready("b"), loading("c", age=700))),
     history(steady("a", waiting=30), steady("b", waiting=30)), 6, "waiting_above_target"),
    ("one bad scrape: the other pods still drive the decision",
     FAST, State(3, (ready("a"), ready("b"), ready("c"))),
     history(steady("a", waiting=30), steady("b", waiting=30), [sample("c", error="timeout after 2 s")]),
     6, "waiting_above_target"),
    ("no pod readable: hold",
     FAST, State(3, (ready("a"), ready("b"), ready("c"))),
     history([sample("a", error="connection refused")], [sample("b", error="timeout")],
             [sample("c", error="HTTP 500")]), 3, "metrics_unavailable"),
    ("NaN at zero traffic is not zero: hold",
     FAST, State(3, (ready("a"), ready("b"), ready("c"))),
     history(steady("a", waiting=NAN), steady("b", waiting=NAN), steady("c", waiting=NAN)),
     3, "metrics_unavailable"),
    ("a metric missing is not zero: hold",
     FAST, State(2, (ready("a"), ready("b"))),
     history([PodSample("a", NOW, None, 0, 0, 0, 16)], [PodSample("b", NOW, 0, 0, None, 0, 16)]),
     2, "metrics_unavailable"),
    ("zero traffic that the metrics show scales down to minReplicas",
     FAST, State(3, (ready("a"), ready("b"), ready("c"))),
     history(steady("a"), steady("b"), steady("c")), 1, "zero_traffic"),
    ("zero traffic, one pod unreadable: it is assumed at target, not at zero",
     replace(FAST, min_replicas=0), State(3, (ready("a"), ready("b"), ready("c"))),
     history(steady("a"), steady("b"), [sample("c", error="timeout")]), 1, "waiting_below_target"),
    ("warm-up: a cold pod's spike is ignored",
     FAST, State(2, (ready("a"), ready("b", age=10))),
     history(steady("a", waiting=10), [sample("b", waiting=500)]), 2, "unmeasured_pods_assumed_at_target"),
    ("warm-up: a cold pod's zeros do not scale down",
     replace(FAST, min_replicas=0), State(2, (ready("a"), ready("b", age=10))),
     history(steady("a"), [sample("b")]), 2, "scale_down_blocked_warming"),
    ("a pod still loading blocks scale-down",
     FAST, State(3, (ready("a"), ready("b"), loading("c"))),
     history(steady("a"), steady("b")), 3, "scale_down_blocked_warming"),
    ("all ready pods warming: hold",
     FAST, State(2, (ready("a", age=5), ready("b", age=5))),
     history([sample("a", waiting=99)], [sample("b", waiting=99)]), 2, "metrics_unavailable"),
    ("preemptions above threshold add a replica even with short queues",
     FAST, State(2, (ready("a"), ready("b"))),
     history(steady("a", preemptions_per_minute=4, waiting=5, running=16),
             steady("b", preemptions_per_minute=2, waiting=5, running=16)), 3, "preemptions"),
    ("past preemptions add no replica once traffic is zero",
     FAST, State(2, (ready("a"), ready("b"))),
     history(steady("a", preemptions_per_minute=4), steady("b")), 2, "scale_down_blocked_preemptions"),
    ("preemptions block scale-down",
     FAST, State(3, (ready("a"), ready("b"), ready("c"))),
     history(steady("a", preemptions_per_minute=0.5), steady("b"), steady("c")), 3,
     "scale_down_blocked_preemptions"),
    ("a replica's queue above target blocks scale-down",
     FAST, State(4, (ready("a"), ready("b"), ready("c"), ready("d"))),
     history(steady("a", waiting=12), steady("b"), steady("c"), steady("d")), 4, "scale_down_blocked_queue"),
    ("running sequences keep their replicas even with an empty queue",
     FAST, State(3, (ready("a"), ready("b"), ready("c"))),
     history(steady("a", running=15), steady("b", running=15), steady("c", running=15)), 3,
     "running_sequences"),
    ("a KV pool that fills before max_num_seqs keeps its replicas (no 3 -> 1 -> 3 flap)",
     FAST, State(3, (ready("a"), ready("b"), ready("c"))),
     history(steady("a", running=4, kv=0.98), steady("b", running=4, kv=0.98), steady("c", running=4, kv=0.98)),
     3, "running_sequences"),
    ("maxReplicas bounds the proposal",
     replace(FAST, max_replicas=4), State(2, (ready("a"), ready("b"))),
     history(steady("a", waiting=100), steady("b", waiting=100)), 4, "waiting_above_target"),
    ("at maxReplicas: no change, limited",
     replace(FAST, max_replicas=2), State(2, (ready("a"), ready("b"))),
     history(steady("a", waiting=100), steady("b", waiting=100)), 2, "at_replica_bounds"),
    ("below minReplicas with no metrics: still brought up to min",
     replace(FAST, min_replicas=2), State(1, (loading("a"),)), {}, 2, "below_min_replicas"),
    ("scale-up rate policy: 1 pod per minute",
     replace(FAST, scale_up=DirectionRules(0, (RatePolicy("Pods", 1, 60),))),
     State(2, (ready("a"), ready("b"))),
     history(steady("a", waiting=50), steady("b", waiting=50)), 3, "waiting_above_target"),
    ("scale-down rate policy: the period's budget already spent",
     replace(FAST, scale_down=DirectionRules(0, (RatePolicy("Pods", 1, 60),))),
     State(3, (ready("a"), ready("b"), ready("c")), scale_events=(ScaleEvent(NOW - 30, 4, 3),)),
     history(steady("a"), steady("b"), steady("c")), 3, "rate_limited"),
    ("scale-up Disabled",
     replace(FAST, scale_up=DirectionRules(0, FAST.scale_up.policies, "Disabled")),
     State(2, (ready("a"), ready("b"))),
     history(steady("a", waiting=50), steady("b", waiting=50)), 2, "rate_limited"),
    ("scale-down stabilization: the highest proposal in the window wins",
     replace(FAST, scale_down=DirectionRules(300, FAST.scale_down.policies)),
     State(4, tuple(ready(n) for n in "abcd"), recommendations=(Recommendation(NOW - 100, 4),)),
     history(*(steady(n) for n in "abcd")), 4, "stabilization_window"),
    ("scale-down stabilization: proposals older than the window no longer count",
     replace(FAST, scale_down=DirectionRules(300, FAST.scale_down.policies)),
     State(4, tuple(ready(n) for n in "abcd"), recommendations=(Recommendation(NOW - 400, 4),)),
     history(*(steady(n) for n in "abcd")), 1, "zero_traffic"),
    ("scale-up stabilization: the lowest proposal in the window wins",
     replace(FAST, scale_up=DirectionRules(60, FAST.scale_up.policies)),
     State(2, (ready("a"), ready("b")), recommendations=(Recommendation(NOW - 30, 3),)),
     history(steady("a", waiting=30), steady("b", waiting=30)), 3, "waiting_above_target"),
    ("External mode: the operator never proposes a replica change",
     replace(FAST, mode="External"), State(2, (ready("a"), ready("b"))),
     history(steady("a", waiting=100), steady("b", waiting=100)), 2, "external_mode"),
    ("External mode, even below minReplicas",
     replace(FAST, mode="External", min_replicas=3), State(1, (ready("a"),)),
     history(steady("a", waiting=100)), 1, "external_mode"),
    ("Off: nothing",
     replace(FAST, mode="Off"), State(2, (ready("a"), ready("b"))),
     history(steady("a", waiting=100), steady("b", waiting=100)), 2, "autoscaling_off"),
]


# Cases about the sequences a decode pod holds: a prefill pod hands each prompt on after one pass.
SEQUENCE_CASES = {
    "preemptions above threshold add a replica even with short queues",
    "past preemptions add no replica once traffic is zero",
    "preemptions block scale-down",
    "running sequences keep their replicas even with an empty queue",
    "a KV pool that fills before max_num_seqs keeps its replicas (no 3 -> 1 -> 3 flap)",
    "while pods load, the preemption rule's +1 (relative) waits for them",
}
TOKENS_PER_REQUEST = 100  # the prefill pool's load: each waiting request stands for this many queued tokens
PREFILL_REASONS = {"waiting_above_target": "queued_prompt_tokens_above_target",
                   "waiting_below_target": "queued_prompt_tokens_below_target",
                   "zero_traffic": "queued_prompt_tokens_below_target"}  # an idle prefill pod holds nothing


def as_prefill_pool(settings: Settings, history: dict) -> tuple[Settings, dict]:
    """The same case for the prefill pool: its bounds and target the decode pool's (in tokens),
    each pod's waiting requests read as queued prompt tokens."""
    pool = PrefillSettings(settings.min_replicas, settings.max_replicas, QUEUED_PROMPT_TOKENS,
                           settings.target_waiting_per_replica * TOKENS_PER_REQUEST)
    tokens = {pod: [s if s.waiting is None else replace(s, queued_prompt_tokens=s.waiting * TOKENS_PER_REQUEST)
                    for s in samples] for pod, samples in history.items()}
    return replace(settings, prefill=pool), tokens


POOL_CASES = [(DECODE, *c) for c in CASES] + [(PREFILL, *c) for c in CASES if c[0] not in SEQUENCE_CASES]


@pytest.mark.parametrize("pool,settings,state,samples,desired,reason", [(c[0], *c[2:]) for c in POOL_CASES],
                         ids=[f"{c[0]}: {c[1]}" for c in POOL_CASES])
def test_replica_decision(pool, settings, state, samples, desired, reason):
    if pool == PREFILL:
        settings, samples = as_prefill_pool(settings, samples)
        reason = PREFILL_REASONS.get(reason, reason)
    decision = decide(settings, state, samples, NOW, pool)
    assert (decision.desired_replicas, decision.reason, decision.pool) == (desired, reason, pool), decision.message
    assert decision.direction == ("up" if desired > state.replicas else "down" if desired < state.replicas else "none")


def test_the_message_carries_the_numbers():
    decision = decide(FAST, State(2, (ready("a"), ready("b"))),
                      history(steady("a", waiting=30), steady("b", waiting=20)), NOW)
    assert "waiting 50" in decision.message and "target 10" in decision.message
    assert "2 -> 5" in decision.message
    assert decision.total_waiting == 50


def test_unreadable_pods_are_named_in_the_metrics_status():
    partial = decide(FAST, State(2, (ready("a"), ready("b"))),
                     history(steady("a"), [sample("b", error="timeout after 2 s")]), NOW)
    assert partial.metrics.available and partial.metrics.reason == "PartialMetrics"
    assert "b: timeout after 2 s" in partial.metrics.message
    none = decide(FAST, State(1, (ready("a"),)), history([sample("a", error="connection refused")]), NOW)
    assert not none.metrics.available and none.metrics.reason == "NoPodReadable"
    assert "a: connection refused" in none.metrics.message


def test_a_stale_sample_is_not_used():
    old = [sample("a", at=NOW - 120, waiting=0)]
    decision = decide(replace(FAST, min_replicas=0), State(2, (ready("a"), ready("b"))),
                      history(old, steady("b", waiting=0)), NOW)
    assert decision.desired_replicas == 1  # not 0: the unread pod is assumed at target
    assert decision.pods[0].state == "stale"


def test_scaling_limited_is_reported_with_the_numbers():
    decision = decide(replace(FAST, max_replicas=3), State(2, (ready("a"), ready("b"))),
                      history(steady("a", waiting=100), steady("b", waiting=100)), NOW)
    assert decision.scaling_limited and "wanted 20" in decision.limited_message


# ------------------------------------------------------------------ multi-tick: no runaway


def _loading_run(waiting_total, preemptions_per_minute: float = 0.0, ticks: int = 12):
    """Ticks every 15 s; new pods take 90 s to load; `waiting_total(tick)` spread over the ready pods."""
    settings = replace(FAST, max_replicas=16, warmup_seconds=0)
    memory = fresh_memory(2, 0)
    replicas, created = 2, {"p0": -1000.0, "p1": -1000.0}
    load_seconds = 90
    trajectory = []
    for tick in range(12):
        now = 15.0 * tick
        pods = [PodInfo(n, c, c + (0 if c < 0 else load_seconds) if now - c >= load_seconds or c < 0 else None)
                for n, c in created.items()]
        ready_pods = [p for p in pods if p.ready_at is not None]
        waiting_each = waiting_total(tick) / len(ready_pods)
        samples = [PodSample(p.name, now, waiting_each, 16, 0.5, preemptions_per_minute * now / 60, 16)
                   for p in ready_pods]
        memory = record_samples(memory, samples, [p.name for p in pods], settings, now)
        decision = decide(settings, state_for(memory, replicas, pods), memory.history, now)
        memory = record_decision(memory, decision, settings, now, True, decision.seqs_changes)
        for i in range(replicas, decision.desired_replicas):
            created[f"p{i}"] = now
        replicas = decision.desired_replicas
        trajectory.append((now, len(ready_pods), replicas, decision.reason))
    return trajectory


def test_no_runaway_scale_up_while_new_pods_load():
    """The same queue read again while new pods load asks for no more (2 -> 6, not 6 -> 18 ->
    ...): the loading pods are in the replicas the absolute proposal is compared with."""
    trajectory = _loading_run(lambda tick: 60)
    assert [t[2] for t in trajectory] == [6] * 12, trajectory
    assert all(t[3] == "within_tolerance" for t in trajectory[1:]), trajectory


def test_a_growing_queue_is_followed_while_pods_load_never_beyond_it():
    """Demand grows while capacity loads: replicas follow total waiting / target (HPA's absolute
    proposal), each step no higher than the queue asks for at that tick."""
    trajectory = _loading_run(lambda tick: 40 + 20 * tick)
    assert trajectory[0][2] == 4 and trajectory[1][2] == 6 and trajectory[5][2] == 14, trajectory
    assert all(t[2] <= max(16, -(-(40 + 20 * i) // 10)) for i, t in enumerate(trajectory)), trajectory
    assert all(t[2] <= -(-(40 + 20 * i) // 10) for i, t in enumerate(trajectory) if t[2] > 2), trajectory


def test_preemptions_add_one_replica_then_wait_for_it_to_load():
    """The preemption rule's +1 is relative: repeated every tick while the new pod loads it would
    compound, so it waits for the pod (90 s = 6 ticks) before adding another."""
    trajectory = _loading_run(lambda tick: 4, preemptions_per_minute=30)
    first = next(i for i, t in enumerate(trajectory) if t[3] == "preemptions")  # a rate needs two readings
    assert trajectory[first][2] == 3, trajectory
    assert all(t[2:] == (3, "pending_replicas") for t in trajectory[first + 1:first + 6]), trajectory
    assert trajectory[first + 6][2:] == (4, "preemptions"), trajectory


# -------------------------------------------------------------------------------- KV retune


def kv_series(pod: str, usages: list[float], start: float, step: float = 15, preemptions=None, seqs=16):
    preemptions = preemptions or [0] * len(usages)
    return [sample(pod, start + step * i, running=seqs, kv=u, preemptions=p, seqs=seqs)
            for i, (u, p) in enumerate(zip(usages, preemptions, strict=True))]


def test_kv_pressure_for_n_samples_lowers_max_num_seqs_multiplicatively():
    samples = kv_series("a", [0.97, 0.99, 0.96], NOW - 30)
    decision = decide(FAST, State(1, (ready("a"),)), history(samples), NOW)
    (change,) = decision.seqs_changes
    assert (change.pod, change.from_max_num_seqs, change.to_max_num_seqs, change.reason) == ("a", 16, 12, "kv_pressure")
    assert "KV usage 0.970, 0.990, 0.960 above 0.95" in change.message


def test_preemptions_in_each_interval_count_as_pressure_even_when_usage_reads_lower():
    """Recompute preemption frees blocks each time it evicts, so a thrashing pool may read 0.8."""
    samples = kv_series("a", [0.97, 0.81, 0.99, 0.66], NOW - 45, preemptions=[10, 14, 14, 19])
    (change,) = decide(FAST, State(1, (ready("a"),)), history(samples), NOW).seqs_changes
    assert change.to_max_num_seqs == 12 and "+4 preemptions" in change.message and "+5 preemptions" in change.message


@pytest.mark.parametrize("usages,preemptions", [
    ([0.97, 0.99], None), ([0.97, 0.90, 0.99], None), ([0.95, 0.95, 0.95], None),
    ([0.97, 0.80, 0.99], [3, 3, 3]), ([0.5, 0.5, 0.5], [0, 1, 1]),
], ids=["too few samples", "not consecutive", "at, not above, the threshold",
        "usage dips with no preemption", "one preemption, not sustained"])
def test_no_retune_without_sustained_pressure(usages, preemptions):
    samples = kv_series("a", usages, NOW - 15 * (len(usages) - 1), preemptions=preemptions)
    assert decide(FAST, State(1, (ready("a"),)), history(samples), NOW).seqs_changes == ()


def test_a_failed_scrape_breaks_the_run_of_pressure_samples():
    samples = kv_series("a", [0.99, 0.99], NOW - 45) + [sample("a", NOW - 15, error="timeout"),
                                                         *kv_series("a", [0.99], NOW)]
    assert decide(FAST, State(1, (ready("a"),)), history(samples), NOW).seqs_changes == ()


def test_retune_respects_the_floor_and_waits_for_new_samples_after_a_change():
    settings = replace(FAST, kv_retune=KvRetuneSettings(floor=10))
    samples = kv_series("a", [0.99] * 6, NOW - 75, seqs=12)
    pod = replace(ready("a"), max_num_seqs=12, max_num_seqs_changed_at=NOW - 100)
    (change,) = decide(settings, State(1, (pod,)), history(samples), NOW).seqs_changes
    assert change.to_max_num_seqs == 10  # 12 x 0.75 = 9, floor 10
    just_changed = replace(pod, max_num_seqs_changed_at=NOW - 20)  # only 2 samples since
    assert decide(settings, State(1, (just_changed,)), history(samples), NOW).seqs_changes == ()
    at_floor = kv_series("a", [0.99] * 6, NOW - 75, seqs=10)
    assert decide(settings, State(1, (pod,)), history(at_floor), NOW).seqs_changes == ()


def test_samples_before_the_engine_drained_to_the_new_cap_are_no_evidence():
    """After 16 -> 12, the 16 running sequences keep thrashing until they drain below 12."""
    pod = replace(ready("a"), max_num_seqs=12, max_num_seqs_changed_at=NOW - 50)
    draining = [sample("a", NOW - 45, running=16, kv=0.99, preemptions=10, seqs=12),
                sample("a", NOW - 30, running=14, kv=0.99, preemptions=15, seqs=12),
                sample("a", NOW - 15, running=12, kv=0.99, preemptions=18, seqs=12),
                sample("a", NOW, running=12, kv=0.99, preemptions=18, seqs=12)]
    assert decide(FAST, State(1, (pod,)), history(draining), NOW).seqs_changes == ()
    still = draining + [sample("a", NOW + 15, running=12, kv=0.99, preemptions=18, seqs=12)]
    (change,) = decide(FAST, State(1, (pod,)), history(still), NOW + 15).seqs_changes
    assert (change.from_max_num_seqs, change.to_max_num_seqs) == (12, 9)


def test_warm_up_samples_do_not_trigger_a_retune():
    pod = ready("a", age=40)  # warm-up ended 10 s ago
    samples = kv_series("a", [0.99, 0.99, 0.99], NOW - 30)
    assert decide(FAST, State(1, (pod,)), history(samples), NOW).seqs_changes == ()


def test_recovery_raises_additively_after_a_quiet_window_up_to_the_spec_value():
    settings = replace(FAST, kv_retune=KvRetuneSettings(recovery_window_seconds=120, recovery_step=4))
    pod = replace(ready("a"), max_num_seqs=9, max_num_seqs_changed_at=NOW - 600)
    quiet = kv_series("a", [0.5] * 10, NOW - 135, seqs=9, preemptions=[7] * 10)
    (change,) = decide(settings, State(1, (pod,)), history(quiet), NOW).seqs_changes
    assert (change.from_max_num_seqs, change.to_max_num_seqs, change.reason) == (9, 13, "kv_recovered")
    near_spec = kv_series("a", [0.5] * 10, NOW - 135, seqs=14, preemptions=[7] * 10)
    (change,) = decide(settings, State(1, (pod,)), history(near_spec), NOW).seqs_changes
    assert change.to_max_num_seqs == 16


@pytest.mark.parametrize("what", ["usage above recovery", "preemptions", "window not over since the change"])
def test_no_recovery_unless_quiet_for_the_whole_window(what):
    settings = replace(FAST, kv_retune=KvRetuneSettings(recovery_window_seconds=120))
    pod = replace(ready("a"), max_num_seqs=9, max_num_seqs_changed_at=NOW - 600)
    usages, preemptions = [0.5] * 10, [7] * 10
    if what == "usage above recovery":
        usages[6] = 0.85
    elif what == "preemptions":
        preemptions[-1] = 8
    else:
        pod = replace(pod, max_num_seqs_changed_at=NOW - 60)
    samples = kv_series("a", usages, NOW - 135, seqs=9, preemptions=preemptions)
    assert decide(settings, State(1, (pod,)), history(samples), NOW).seqs_changes == ()


def test_no_retune_in_external_mode_or_when_disabled():
    samples = kv_series("a", [0.99, 0.99, 0.99], NOW - 30)
    assert decide(FAST, State(1, (ready("a"),)), history(samples), NOW).seqs_changes
    external = decide(replace(FAST, mode="External"), State(1, (ready("a"),)), history(samples), NOW)
    assert external.seqs_changes == () and external.desired_replicas == 1
    assert external.metrics.available
    disabled = replace(FAST, kv_retune=KvRetuneSettings(enabled=False))
    assert decide(disabled, State(1, (ready("a"),)), history(samples), NOW).seqs_changes == ()


def test_a_pod_above_a_lowered_spec_value_is_brought_down():
    samples = kv_series("a", [0.2], NOW, seqs=32)
    (change,) = decide(FAST, State(1, (ready("a"),)), history(samples), NOW).seqs_changes
    assert (change.to_max_num_seqs, change.reason) == (16, "spec_lowered")


# ------------------------------------------------------------------------- preemption rate


@pytest.mark.parametrize("points,expected", [
    ([(0, 5), (60, 8)], 3.0),
    ([(0, 5), (30, 6), (60, 8)], 3.0),
    ([(0, 5), (30, 9), (60, 2)], 6.0),  # counter reset: 4 before it, 2 after
    ([(-60, 0), (0, 10), (60, 12)], 2.0),  # the base is the last sample before the window
    ([(60, 8)], None),
    ([], None),
])
def test_preemption_rate_per_minute(points, expected):
    samples = [PodSample("a", at, 0, 0, 0, value, 16) for at, value in points]
    assert preemption_rate_per_minute(samples, 60, 60) == expected


def test_memory_forgets_pods_that_are_gone_and_old_samples():
    memory = fresh_memory(2, 0)
    memory = record_samples(memory, [sample("a", at=0), sample("b", at=0)], ["a", "b"], FAST, 0)
    later = FAST.memory_seconds + 10
    memory = record_samples(memory, [sample("a", at=later)], ["a"], FAST, later)
    assert list(memory.history) == ["a"] and len(memory.history["a"]) == 1

