"""Condition transitions, the status the reconcile writes from its Deployments (the decode pool at the
top level, each extra pool in its own object), and the scaling history."""

from datetime import UTC, datetime, timedelta

import pytest

from iterserve.operator import status as s
from iterserve.operator.autoscaling.policy import PodSample, PodState, State, decide
from iterserve.operator.autoscaling.report import AutoscalerTick, PoolTick, Record
from iterserve.operator.autoscaling.settings import PREFILL, settings_from_spec
from iterserve.operator.service_status import Observed, service_status
from iterserve.operator.validation import parse_spec

T0 = datetime(2025, 1, 1, tzinfo=UTC)
T1 = T0 + timedelta(minutes=5)
SPEC = parse_spec({"model": {"uri": "m"}, "replicas": 2})


def deployment(replicas=2, ready=2, updated=2, generation=1, observed=1, conditions=()):
    return {"metadata": {"generation": generation},
            "status": {"replicas": replicas, "readyReplicas": ready, "updatedReplicas": updated,
                       "observedGeneration": observed, "conditions": list(conditions)}}


def conditions_of(status):
    return {c["type"]: c for c in status["conditions"]}


def test_transition_time_moves_only_when_status_changes():
    first = s.set_condition([], "Ready", s.FALSE, "ReplicasNotReady", "0/2", T0)
    same = s.set_condition(first, "Ready", s.FALSE, "ReplicasNotReady", "1/2", T1)
    assert same[0]["lastTransitionTime"] == "2025-01-01T00:00:00Z" and same[0]["message"] == "1/2"
    flipped = s.set_condition(same, "Ready", s.TRUE, "AllReplicasReady", "2/2", T1)
    assert flipped[0]["lastTransitionTime"] == "2025-01-01T00:05:00Z"
    assert len(flipped) == 1


def test_ready_stable_service():
    status = s.reconciled_status(None, SPEC, "llm", 3, deployment(), 64, T0,
                                 routing=(s.FALSE, "ServiceSelectsEngines", "mode None"))
    c = conditions_of(status)
    assert c["Ready"]["status"] == "True" and c["Progressing"]["status"] == "False"
    assert c["Degraded"]["status"] == "False" and c["InvalidSpec"]["status"] == "False"
    assert c["MetricsAvailable"]["status"] == "Unknown" and c["ScalingLimited"]["status"] == "Unknown"
    assert [x["type"] for x in status["conditions"]] == [t for t in s._ORDER if t != "DisaggregationIneffective"]
    assert status["observedGeneration"] == 3 and status["replicas"] == 2 and status["readyReplicas"] == 2
    assert status["selector"] == "app.kubernetes.io/name=iterserve-engine,app.kubernetes.io/instance=llm"
    assert status["effectiveMaxNumSeqs"] == 64 and status["desiredReplicas"] == 2


def test_rolling_out_is_progressing_and_not_ready():
    status = s.reconciled_status(None, SPEC, "llm", 1, deployment(ready=1, updated=1, generation=2, observed=1), 64, T0)
    c = conditions_of(status)
    assert c["Ready"]["status"] == "False" and "1/2" in c["Ready"]["message"]
    assert c["Progressing"]["status"] == "True" and c["Progressing"]["reason"] == "RollingOut"


def test_deadline_exceeded_is_degraded():
    stuck = {"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded",
             "message": "ReplicaSet llm-abc has timed out progressing."}
    c = conditions_of(s.reconciled_status(None, SPEC, "llm", 1, deployment(ready=0, conditions=[stuck]), 64, T0))
    assert c["Degraded"]["status"] == "True" and c["Degraded"]["reason"] == "ProgressDeadlineExceeded"


def test_scaled_to_zero():
    spec = parse_spec({"model": {"uri": "m"}, "replicas": 0})
    c = conditions_of(s.reconciled_status(None, spec, "llm", 1, deployment(0, 0, 0), 64, T0))
    assert c["Ready"]["reason"] == "ScaledToZero"


def test_autoscaler_conditions_are_left_alone():
    previous = {"conditions": [{"type": "MetricsAvailable", "status": "False", "reason": "NoPodReadable",
                                "message": "0 of 2 pods", "lastTransitionTime": "2024-12-31T00:00:00Z"}]}
    c = conditions_of(s.reconciled_status(previous, SPEC, "llm", 1, deployment(), 64, T0))
    assert c["MetricsAvailable"]["reason"] == "NoPodReadable"


def test_invalid_then_fixed():
    bad = s.invalid_status(None, 4, "spec.engine.extraArgs[0]", "--port is set by the operator", T0)
    c = conditions_of(bad)
    assert c["InvalidSpec"]["status"] == "True" and "spec.engine.extraArgs[0]" in c["InvalidSpec"]["message"]
    assert c["Degraded"]["status"] == "True"
    fixed = conditions_of(s.reconciled_status(bad, SPEC, "llm", 5, deployment(), 64, T1))
    assert fixed["InvalidSpec"]["status"] == "False" and fixed["InvalidSpec"]["lastTransitionTime"] == "2025-01-01T00:05:00Z"
    assert fixed["Degraded"]["status"] == "False"


def test_second_reconcile_writes_nothing():
    first = s.reconciled_status(None, SPEC, "llm", 1, deployment(), 64, T0)
    again = s.reconciled_status(first, SPEC, "llm", 1, deployment(), 64, T1)
    assert s.changed_fields(first, again) == {}


def test_history_is_bounded_newest_last():
    history = []
    for i in range(25):
        history = s.append_history(history, {"time": "t", "action": "ScaleUp", "reason": str(i)})
    assert len(history) == 10 and history[-1]["reason"] == "24" and history[0]["reason"] == "15"


# ------------------------------------------------------------------ the whole status, per pool

DISAGGREGATED = {"model": {"uri": "m"}, "replicas": 2, "routing": {"mode": "Router"},
                 "disaggregation": {"enabled": True, "prefill": {"replicas": 2}}}
BUILTIN = {**DISAGGREGATED, "autoscaling": {}}
PREFILL_DEPLOYMENT = {"status": {"replicas": 2, "readyReplicas": 1}}
RECORDED = {"replicas": 2, "readyReplicas": 2, "desiredReplicas": 4, "reason": "queued_prompt_tokens_above_target"}
ROUTING = (s.FALSE, "RouterServing", "router ready")

# id, spec, previous status, the prefill Deployment, expected fields (None: written as null),
# fields that must stay absent.
STATUS_CASES = [
    ("aggregated: no pool object, no deprecated copies",
     SPEC, {}, None, {}, ("prefill", "prefillReplicas", "prefillReadyReplicas")),
    ("disaggregated: status.prefill counts from its Deployment; the deprecated copies equal them",
     DISAGGREGATED, {}, PREFILL_DEPLOYMENT,
     {"prefill": {"replicas": 2, "readyReplicas": 1, "desiredReplicas": 2}, "prefillReplicas": 2,
      "prefillReadyReplicas": 1}, ()),
    ("Builtin: the prefill pool's desiredReplicas and reason the autoscaler recorded stand",
     BUILTIN, {"prefill": RECORDED}, PREFILL_DEPLOYMENT,
     {"prefill": {**RECORDED, "replicas": 2, "readyReplicas": 1}}, ()),
    ("autoscaling off: the prefill pool's desiredReplicas follows its spec",
     DISAGGREGATED, {"prefill": RECORDED}, PREFILL_DEPLOYMENT,
     {"prefill": {**RECORDED, "replicas": 2, "readyReplicas": 1, "desiredReplicas": 2}}, ()),
    ("disaggregation turned off: status.prefill and its deprecated copies are cleared",
     SPEC, {"prefill": RECORDED, "prefillReplicas": 2, "prefillReadyReplicas": 2}, None,
     {"prefill": None, "prefillReplicas": None, "prefillReadyReplicas": None}, ()),
]


@pytest.mark.parametrize("spec,previous,prefill,expected,absent", [c[1:] for c in STATUS_CASES],
                         ids=[c[0] for c in STATUS_CASES])
def test_the_status_of_each_pool(spec, previous, prefill, expected, absent):
    seen = Observed(parse_spec(spec), "llm", 1, deployment(), 64, T0, ROUTING, prefill=prefill)
    status = service_status(previous, seen)
    assert {k: status.get(k, "absent") for k in expected} == expected
    assert [k for k in absent if k in status] == []
    assert status["replicas"] == 2 and status["readyReplicas"] == 2  # the decode pool stays at the top level
    merged = {**previous, **status}
    assert s.changed_fields(merged, service_status(merged, seen)) == {}  # a second pass writes nothing


def test_disaggregation_ineffective_is_unknown_until_prompts_are_seen_and_false_once_off():
    on = service_status({}, Observed(parse_spec(DISAGGREGATED), "llm", 1, deployment(), 64, T0, ROUTING,
                                     prefill=PREFILL_DEPLOYMENT))
    assert conditions_of(on)["DisaggregationIneffective"]["reason"] == "NoTraffic"
    off = service_status(on, Observed(SPEC, "llm", 2, deployment(), 64, T1, ROUTING))
    assert (conditions_of(off)["DisaggregationIneffective"]["status"],
            conditions_of(off)["DisaggregationIneffective"]["reason"]) == ("False", "Disabled")
    never = service_status({}, Observed(SPEC, "llm", 1, deployment(), 64, T0, ROUTING))
    assert "DisaggregationIneffective" not in conditions_of(never)


def test_a_tick_puts_each_extra_pools_scaling_in_its_own_object_and_every_pool_in_the_history():
    settings = settings_from_spec(parse_spec(BUILTIN))
    pods = (PodState("p", 0, 1),)
    queued = {"p": [PodSample("p", 100, 0, 1, 0.1, 0, 8, queued_prompt_tokens=9000)]}
    prefill = decide(settings, State(2, pods), queued, 100, PREFILL)
    decode = decide(settings, State(2, pods), {"p": [PodSample("p", 100, 0, 0, 0.1, 0, 8)]}, 100)
    tick = AutoscalerTick(settings, decode, Record(), T1, None,
                          extra_pools=(PoolTick(prefill, Record(replicas_applied=True)),))
    status = service_status({}, Observed(parse_spec(BUILTIN), "llm", 1, deployment(), 64, T1, ROUTING,
                                         prefill=PREFILL_DEPLOYMENT, tick=tick))
    assert status["prefill"]["desiredReplicas"] == prefill.desired_replicas > 2
    assert status["prefill"]["signal"] == "QueuedPromptTokens" and status["prefill"]["signalValue"] == 9000
    assert status["prefill"]["lastScaleTime"] == "2025-01-01T00:05:00Z"
    assert status["prefillReplicas"] == 2  # the deprecated copy follows status.prefill, not the tick
    [record] = status["scalingHistory"]
    assert (record["pool"], record["action"]) == ("prefill", "ScaleUp")
    assert record["metricReplicas"] == 9000 / settings.pool(PREFILL).target  # the HPA ratio, unrounded
