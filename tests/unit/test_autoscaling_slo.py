"""SLO mode and scale to zero in the autoscaler's decision (policy.decide): replicas planned by the
simulator's replica model on the measured workload, the hysteresis band, the fallback to the
queue signal when the prediction is off, samples from warming pods left out, the ITL target's
max_num_seqs cap; and the idle timer to zero, the router's held requests back from zero."""

from __future__ import annotations

from dataclasses import replace

import pytest

from iterserve.operator.autoscaling.policy import PodSample, PodState, State, decide
from iterserve.operator.autoscaling.report import slo_status
from iterserve.operator.autoscaling.settings import DirectionRules, RatePolicy, settings_from_spec
from iterserve.operator.models import AutoscalingSpec, InferenceServiceSpec
from iterserve.replica_model.plan import Workload, plan, predict

NOW = 10_000.0
INF = float("inf")
PROMPT, OUTPUT = 64, 32


def spec(slo: dict | None = None, **autoscaling) -> InferenceServiceSpec:
    return InferenceServiceSpec.model_validate({
        "model": {"uri": "x"},
        "engine": {"maxNumSeqs": 8, "maxModelLen": 512, "kvCacheMemory": "29MiB",
                   "extraArgs": ["--fake-model", "--max-waiting-requests", "1000"]},
        "autoscaling": {"minReplicas": 1, "maxReplicas": 8, "warmupSeconds": 30, "intervalSeconds": 15,
                        **({"slo": {"stepProfile": "fake-model", "window": 120, **slo}} if slo else {}),
                        **autoscaling}})


def settings_for(s: InferenceServiceSpec):
    # Windows off, so each case shows one rule.
    return replace(settings_from_spec(s), scale_down=DirectionRules(0, (RatePolicy("Percent", 100, 15),)))


def ready(name: str, age: float = 3600) -> PodState:
    return PodState(name, created_at=NOW - age - 60, ready_at=NOW - age)


def served(pod: str, rate: float, ttft_p95: float, itl_p95: float, start: float = NOW - 150, every: float = 15,
           waiting: float = 0.0, running: float = 0.0) -> list[PodSample]:
    """A pod's readings from `start` to now: `rate` requests per second finished, each of PROMPT
    and OUTPUT tokens, TTFT and ITL histograms whose p95 is the given value."""
    out, at = [], start
    while at <= NOW + 1e-9:
        count = rate * (at - start) + 1000
        gaps = count * (OUTPUT - 1)
        out.append(PodSample(pod, at, waiting, running, 0.1, 0.0, 8.0, prompt_tokens_total=count * PROMPT,
                             requests_total=count, generation_tokens_total=count * OUTPUT,
                             ttft_buckets=((ttft_p95 / 0.95, count), (INF, count)),
                             itl_buckets=((itl_p95 / 0.95, gaps), (INF, gaps))))
        at += every
    return out


def run(settings, replicas: int, pods: dict[str, list[PodSample]], states=None, held=None):
    states = states or [ready(name) for name in pods]
    return decide(settings, State(replicas, tuple(states), held_requests=held), pods, NOW)


def predicted(s: InferenceServiceSpec, rate: float, replicas: int, seqs: int = 8):
    slo = settings_from_spec(s).slo
    return predict(slo.engine, slo.server, slo.profile, Workload(rate, PROMPT, OUTPUT), replicas, seqs)


def test_a_predicted_ttft_miss_adds_the_replicas_the_replica_model_says_meet_it():
    s = spec({"ttftP95Ms": 45})
    one = predicted(s, 10, 1)
    assert one.ttft_p95_s > 0.045  # one replica misses the target at 10 req/s
    pods = {"a": served("a", 10, one.ttft_p95_s, one.itl_p95_s)}
    d = run(settings_for(s), 1, pods)
    assert d.reason == "slo_predicted_miss" and d.desired_replicas > 1 and d.signal == "SLO"
    assert predicted(s, 10, d.desired_replicas).ttft_p95_s <= 0.045
    assert predicted(s, 10, d.desired_replicas - 1).ttft_p95_s > 0.045  # the fewest that meet it
    assert d.slo.measured_ttft_p95_s == pytest.approx(one.ttft_p95_s, rel=0.01)
    assert d.slo.workload.arrival_rate == pytest.approx(10, rel=0.01)
    assert d.slo.workload.prompt_tokens == PROMPT and d.slo.workload.output_tokens == OUTPUT
    assert "predicted at" in d.message and not d.slo.fallback


def test_light_load_at_many_replicas_goes_down_to_the_fewest_meeting_the_target_with_headroom():
    s = spec({"ttftP95Ms": 500})
    pods = {name: served(name, 0.25, 0.03, 0.0025, running=1) for name in "abcd"}
    d = run(settings_for(s), 4, pods)
    assert d.reason == "slo_met_with_fewer" and d.desired_replicas == 1
    assert d.slo.predicted.ttft_p95_s <= 0.5 * 0.8


def test_the_hysteresis_band_stops_two_one_flapping():
    rate = 10.0
    s0 = spec({"ttftP95Ms": 1000})
    one, two = predicted(s0, rate, 1), predicted(s0, rate, 2)
    # A target one replica meets, but not with 20% headroom: 1 stays 1 and 2 stays 2.
    target_ms = one.ttft_p95_s * 1000 * 1.1
    assert two.ttft_p95_s < one.ttft_p95_s
    s = spec({"ttftP95Ms": target_ms, "hysteresis": 0.2})
    at_one = run(settings_for(s), 1, {"a": served("a", rate, one.ttft_p95_s, one.itl_p95_s)})
    at_two = run(settings_for(s), 2, {n: served(n, rate / 2, two.ttft_p95_s, two.itl_p95_s) for n in "ab"})
    assert (at_one.desired_replicas, at_one.reason) == (1, "within_slo_band")
    assert (at_two.desired_replicas, at_two.reason) == (2, "within_slo_band")
    # Without the band, 2 would drop to 1.
    bare = spec({"ttftP95Ms": target_ms, "hysteresis": 0})
    assert run(settings_for(bare), 2, {n: served(n, rate / 2, two.ttft_p95_s, two.itl_p95_s)
                                       for n in "ab"}).desired_replicas == 1


def test_a_prediction_far_from_the_measurement_falls_back_to_the_queue_signal_and_says_so():
    s = spec({"ttftP95Ms": 500, "maxPredictionError": 0.5})
    # Measured p95 TTFT 3 s where the model predicts tens of ms: the model is wrong for this pool.
    pods = {"a": served("a", 2, 3.0, 0.003, waiting=35)}
    d = run(settings_for(s), 1, pods)
    assert d.slo.fallback and d.slo.prediction_error > 0.5
    assert d.reason == "waiting_above_target" and d.desired_replicas == 4  # 35 waiting / 10 per replica
    assert "waiting-requests signal" in d.message and d.signal == "SLO"
    # status.slo shows what it compared: the prediction at the current replica, beside the measurement
    status = slo_status(d.slo)
    assert status["fallback"] and status["measuredTtftP95"] == pytest.approx(3.0, rel=0.2)
    assert status["predictedTtftP95"] is not None and status["predictedTtftP95"] < 0.5


def test_samples_from_a_pod_still_warming_are_left_out_of_the_measurement_and_the_workload():
    s = spec({"ttftP95Ms": 500})
    warm = served("a", 1, 0.03, 0.0025)
    cold = served("b", 50, 30.0, 1.0, start=NOW - 20, every=5)  # ready 20 s ago: warming for 30 s
    d = run(settings_for(s), 2, {"a": warm, "b": cold}, states=[ready("a"), ready("b", age=20)])
    assert d.slo.measured_ttft_p95_s == pytest.approx(0.03, rel=0.01)
    assert d.slo.workload.arrival_rate == pytest.approx(1, rel=0.01)
    assert {p.pod: p.state for p in d.pods} == {"a": "measured", "b": "warming"}


def test_an_itl_target_that_binds_caps_every_pods_max_num_seqs():
    rate = 20.0
    s0 = spec({"itlP95Ms": 1000})
    full, half = predicted(s0, rate, 1, 8), predicted(s0, rate, 1, 4)
    assert half.itl_p95_s < full.itl_p95_s
    target_ms = (full.itl_p95_s + half.itl_p95_s) / 2 * 1000
    s = spec({"itlP95Ms": target_ms}, maxReplicas=1)
    d = run(settings_for(s), 1, {"a": served("a", rate, full.ttft_p95_s, full.itl_p95_s)})
    assert d.slo.max_num_seqs == 4 and [(c.pod, c.to_max_num_seqs, c.reason) for c in d.seqs_changes] == [
        ("a", 4, "itl_target")]
    # A target the spec's max_num_seqs meets changes nothing.
    loose = spec({"itlP95Ms": full.itl_p95_s * 2000}, maxReplicas=1)
    d = run(settings_for(loose), 1, {"a": served("a", rate, full.ttft_p95_s, full.itl_p95_s)})
    assert d.slo.max_num_seqs is None and d.seqs_changes == ()


def test_the_plan_is_the_smallest_count_and_says_when_none_meets_the_targets():
    s = settings_from_spec(spec({"ttftP95Ms": 1})).slo
    result = plan(s.engine, s.server, s.profile, Workload(10, PROMPT, OUTPUT), 1, 3, 0.001, None)
    assert not result.met and result.replicas == 3


def test_the_slo_spec_needs_a_target_and_names_the_fields():
    with pytest.raises(ValueError, match="ttftP95Ms, itlP95Ms or both"):
        AutoscalingSpec.model_validate({"slo": {"window": 60}})
    with pytest.raises(ValueError, match="stepProfile|step_profile"):
        AutoscalingSpec.model_validate({"slo": {"ttftP95Ms": 100, "stepProfile": "/etc/passwd"}})
    with pytest.raises(ValueError, match="scaleToZeroAfterSeconds needs spec.autoscaling.minReplicas 0"):
        AutoscalingSpec.model_validate({"minReplicas": 1, "scaleToZeroAfterSeconds": 60})


# ------------------------------------------------------------------------------ scale to zero

def idle(pod: str, start: float = NOW - 400, requests_until: float | None = None) -> list[PodSample]:
    """Readings every 15 s; the request counter rises until `requests_until`, then stays."""
    out, at = [], start
    while at <= NOW + 1e-9:
        count = 100 + (min(at, requests_until) - start if requests_until else 0)
        out.append(PodSample(pod, at, 0.0, 0.0, 0.0, 0.0, 8.0, requests_total=count))
        at += 15
    return out


ZERO = spec(minReplicas=0, scaleToZeroAfterSeconds=300)


def test_an_idle_pool_goes_to_zero_after_the_timer_and_not_before():
    settings = settings_for(ZERO)
    gone = run(settings, 1, {"a": idle("a", requests_until=NOW - 310)})
    assert (gone.desired_replicas, gone.reason) == (0, "idle_scale_to_zero")
    recent = run(settings, 1, {"a": idle("a", requests_until=NOW - 200)})
    assert recent.desired_replicas == 1 and recent.reason != "idle_scale_to_zero"  # waiting 0 alone keeps one
    held = run(settings, 1, {"a": idle("a", requests_until=NOW - 310)}, held=2)
    assert held.desired_replicas == 1


def test_at_zero_held_requests_bring_one_replica_and_none_keeps_zero():
    settings = settings_for(ZERO)
    up = run(settings, 0, {}, held=3)
    assert (up.desired_replicas, up.reason, up.held_requests) == (1, "held_requests", 3)
    stay = run(settings, 0, {}, held=0)
    assert (stay.desired_replicas, stay.reason) == (0, "scaled_to_zero")


def test_held_requests_count_as_waiting_above_zero():
    settings = settings_for(ZERO)
    d = run(settings, 1, {"a": idle("a", requests_until=NOW)}, held=25)
    assert d.desired_replicas == 3 and "held at the router" in d.message


def test_status_carries_the_predicted_and_measured_p95s_in_the_crd_shape():
    from datetime import UTC, datetime

    from iterserve.operator.autoscaling.report import Record, status_patch
    from iterserve.operator.models import InferenceServiceStatus

    s = spec({"ttftP95Ms": 45})
    one = predicted(s, 10, 1)
    settings = settings_for(s)
    d = run(settings, 1, {"a": served("a", 10, one.ttft_p95_s, one.itl_p95_s)}, held=0)
    patch = status_patch(None, settings, d, Record(), 8, datetime.fromtimestamp(NOW, UTC))
    status = InferenceServiceStatus.model_validate(patch)
    assert status.slo.measured_ttft_p95 == pytest.approx(one.ttft_p95_s, rel=0.01)
    assert status.slo.predicted_ttft_p95 <= 0.045 and status.slo.arrival_rate == pytest.approx(10, rel=0.01)
    assert status.held_requests == 0 and not status.slo.fallback


def test_a_pool_that_may_be_at_zero_gets_a_router_that_holds_requests():
    from iterserve.operator.resources import Owner
    from iterserve.operator.routing import router_args

    owner = Owner("llm", "ns", "uid")
    args = router_args(owner, ZERO)
    assert args[args.index("--hold-timeout") + 1] == "300"
    assert "--hold-timeout" not in router_args(owner, spec())
