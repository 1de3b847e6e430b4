"""The autoscaler's edges: parsing engine metrics (renames and NaN are errors, never zeros),
scraping over real HTTP with one pod failing each way, the operator's own metrics, the status
patch and Events a decision produces."""

from __future__ import annotations

import asyncio
import threading
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from iterserve.engine import metrics as names
from iterserve.operator.autoscaling.engine_admin import EngineAdmin, SeqsOutcome, apply_seqs_changes
from iterserve.operator.autoscaling.loop import engine_pods
from iterserve.operator.autoscaling.metrics_source import (
    MetricsFormatError,
    PodEndpoint,
    ScrapeSource,
    parse_engine_metrics,
)
from iterserve.operator.autoscaling.policy import (
    PodSample,
    PodState,
    SeqsChange,
    Settings,
    State,
    decide,
)
from iterserve.operator.autoscaling.report import (
    Record,
    config_max_num_seqs,
    events_for,
    status_patch,
)
from iterserve.operator.metrics import OperatorMetrics
from iterserve.operator.models import ScalingRecord

ENGINE_TEXT = f"""# TYPE {names.WAITING_REQUESTS} gauge
{names.WAITING_REQUESTS}{{model_name="m"}} 7.0
# TYPE {names.RUNNING_SEQS} gauge
{names.RUNNING_SEQS}{{model_name="m"}} 16.0
# TYPE {names.KV_CACHE_USAGE} gauge
{names.KV_CACHE_USAGE}{{model_name="m"}} 0.97
# TYPE {names.MAX_NUM_SEQS} gauge
{names.MAX_NUM_SEQS}{{model_name="m"}} 16.0
# TYPE {names.PREEMPTIONS_TOTAL.removesuffix("_total")} counter
{names.PREEMPTIONS_TOTAL}{{model_name="m"}} 42.0
"""

VLLM_TEXT = f"""{names.VLLM_WAITING}{{model_name="m"}} 3
{names.VLLM_RUNNING}{{model_name="m"}} 5
{names.VLLM_KV_USAGE}{{model_name="m"}} 0.5
{names.VLLM_PREEMPTIONS_TOTAL}{{model_name="m"}} 2
"""


def test_parse_engine_metrics_reads_the_names_from_engine_metrics():
    assert parse_engine_metrics(ENGINE_TEXT) == {
        "waiting": 7.0, "running": 16.0, "kv_usage": 0.97, "preemptions_total": 42.0, "max_num_seqs": 16.0,
        "prompt_tokens_total": None, "requests_total": None,  # optional: only the average prompt reads them
        "queued_prompt_tokens": None, "ttft_buckets": None,  # optional: only the prefill pool reads them
        "generation_tokens_total": None, "itl_buckets": None}  # optional: only SLO mode reads them


def test_parse_falls_back_to_the_vllm_names():
    assert parse_engine_metrics(VLLM_TEXT) == {
        "waiting": 3.0, "running": 5.0, "kv_usage": 0.5, "preemptions_total": 2.0, "max_num_seqs": None,
        "prompt_tokens_total": None, "requests_total": None, "queued_prompt_tokens": None, "ttft_buckets": None,
        "generation_tokens_total": None, "itl_buckets": None}


def test_parse_reads_the_prefill_signals_queued_prompt_tokens_and_ttft_buckets_summed_over_series():
    text = ENGINE_TEXT + f"""# TYPE {names.QUEUED_PROMPT_TOKENS} gauge
{names.QUEUED_PROMPT_TOKENS}{{model_name="m"}} 4096.0
# TYPE {names.TIME_TO_FIRST_TOKEN} histogram
{names.TIME_TO_FIRST_TOKEN}_bucket{{le="0.5",model_name="m"}} 3.0
{names.TIME_TO_FIRST_TOKEN}_bucket{{le="1.0",model_name="m"}} 5.0
{names.TIME_TO_FIRST_TOKEN}_bucket{{le="+Inf",model_name="m"}} 6.0
{names.TIME_TO_FIRST_TOKEN}_bucket{{le="0.5",model_name="other"}} 1.0
{names.TIME_TO_FIRST_TOKEN}_bucket{{le="1.0",model_name="other"}} 1.0
{names.TIME_TO_FIRST_TOKEN}_bucket{{le="+Inf",model_name="other"}} 1.0
{names.TIME_TO_FIRST_TOKEN}_count{{model_name="m"}} 6.0
{names.TIME_TO_FIRST_TOKEN}_sum{{model_name="m"}} 4.0
"""
    values = parse_engine_metrics(text)
    assert values["queued_prompt_tokens"] == 4096
    assert values["ttft_buckets"] == ((0.5, 4.0), (1.0, 6.0), (float("inf"), 7.0))


@pytest.mark.parametrize("text,message", [
    (ENGINE_TEXT.replace(names.WAITING_REQUESTS, "llm_scheduler_queue_depth"),
     f"metric {names.WAITING_REQUESTS} not exported"),
    (ENGINE_TEXT.replace("0.97", "NaN"), f"metric {names.KV_CACHE_USAGE} is NaN"),
    ("this is { not prometheus", "unparsable /metrics"),
], ids=["a renamed metric", "NaN", "garbage"])
def test_parse_errors_name_the_problem(text, message):
    with pytest.raises(MetricsFormatError, match=message.replace("{", r"\{")):
        parse_engine_metrics(text)


class _Engines(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802
        if self.path.startswith("/good"):
            body, status = ENGINE_TEXT.encode(), 200
        elif self.path.startswith("/broken"):
            body, status = b"boom", 500
        elif self.path.startswith("/slow"):
            threading.Event().wait(3)
            body, status = ENGINE_TEXT.encode(), 200
        else:
            body, status = b"nope", 404
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def engines():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Engines)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_scrape_reads_every_pod_and_reports_each_failure_without_blocking_the_others(engines):
    from tests.server_fixture import free_port

    pods = [PodEndpoint("good", f"{engines}/good"), PodEndpoint("broken", f"{engines}/broken"),
            PodEndpoint("slow", f"{engines}/slow"), PodEndpoint("gone", f"http://127.0.0.1:{free_port()}")]
    samples = asyncio.run(ScrapeSource(timeout=0.5).read(pods))
    by = {s.pod: s for s in samples}
    assert by["good"].ok and by["good"].waiting == 7 and by["good"].preemptions_total == 42
    assert "HTTP 500" in by["broken"].error
    assert "timeout" in by["slow"].error
    assert "ConnectError" in by["gone"].error
    # ... and the policy still decides from the one good pod.
    now = max(s.at for s in samples)
    state = State(4, tuple(PodState(p.name, 0, 1) for p in pods))
    decision = decide(Settings(warmup_seconds=0, target_waiting_per_replica=2), state, {s.pod: [s] for s in samples}, now)
    assert decision.metrics.reason == "PartialMetrics" and decision.total_waiting == 7


def test_engine_admin_reports_an_unreachable_engine_per_pod():
    from tests.server_fixture import free_port

    change = SeqsChange("a", 16, 12, "kv_pressure", "")
    outcome = asyncio.run(apply_seqs_changes(EngineAdmin("t"), [change, SeqsChange("b", 8, 6, "kv_pressure", "")],
                                             {"a": f"http://127.0.0.1:{free_port()}"}))
    assert outcome.applied == ()
    assert [(c.pod, "ConnectError" in e or e) for c, e in outcome.failed] == [("a", True), ("b", "pod has no address")]


def _pod(name, ready=True, ip="127.10.0.7", deleting=False):
    meta = {"name": name, "creationTimestamp": "2026-01-01T00:00:00Z"}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:05:00Z"
    conditions = [{"type": "Ready", "status": "True" if ready else "False", "lastTransitionTime": "2026-01-01T00:01:00Z"}]
    return {"metadata": meta, "status": {"podIP": ip, "conditions": conditions, "phase": "Running"}}


def test_engine_pods_skips_terminating_pods_and_reads_readiness_times():
    infos, urls = engine_pods([_pod("a"), _pod("b", ready=False, ip=None), _pod("c", deleting=True)], 8000)
    assert [(i.name, i.ready_at is not None) for i in infos] == [("a", True), ("b", False)]
    assert infos[0].ready_at - infos[0].created_at == 60
    assert urls == {"a": "http://127.10.0.7:8000"}


def _decision():
    samples = {n: [PodSample(n, 100, 30, 16, 0.99, 5, 16)] for n in ("a", "b")}
    state = State(2, (PodState("a", 0, 1), PodState("b", 0, 1)))
    return decide(Settings(warmup_seconds=0, max_replicas=3), state, samples, 100)


def test_operator_metrics_export_the_names_from_engine_metrics():
    registry = CollectorRegistry()
    metrics = OperatorMetrics(registry)
    decision = _decision()
    metrics.record("ns", "svc", Settings(max_replicas=3), decision, 2, {"a": 12, "b": 16})
    metrics.record("ns", "svc", Settings(max_replicas=3), decision, 0, {"a": 12})  # b is gone
    text = generate_latest(registry).decode()
    assert f'{names.AUTOSCALER_DESIRED_REPLICAS}{{inferenceservice="svc",namespace="ns"}} 3.0' in text
    assert f'{names.AUTOSCALER_MAX_REPLICAS}{{inferenceservice="svc",namespace="ns"}} 3.0' in text
    assert (f'{names.AUTOSCALER_DECISIONS_TOTAL}{{direction="up",inferenceservice="svc",namespace="ns",'
            f'reason="waiting_above_target"}} 2.0') in text
    assert f'{names.METRICS_SCRAPE_ERRORS_TOTAL}{{inferenceservice="svc",namespace="ns"}} 2.0' in text
    assert f'{names.EFFECTIVE_MAX_NUM_SEQS}{{inferenceservice="svc",namespace="ns",pod="a"}} 12.0' in text
    assert 'pod="b"' not in text


def test_status_patch_and_events_carry_the_numbers():
    decision = _decision()
    change = SeqsChange("a", 16, 12, "kv_pressure", "KV usage 0.99 ...", (0.99, 0.97, 0.985), (0.0, 2.0, 0.0))
    record = Record(replicas_applied=True, seqs=SeqsOutcome((change,), ((SeqsChange("b", 16, 12, "kv_pressure", ""), "HTTP 401"),)))
    now = datetime(2026, 1, 1, tzinfo=UTC)
    patch = status_patch({"scalingHistory": [{"action": "ScaleUp"}] * 10}, Settings(max_replicas=3), decision,
                         record, 12, now)
    assert patch["desiredReplicas"] == 3 and patch["effectiveMaxNumSeqs"] == 12
    assert len(patch["scalingHistory"]) == 10  # bounded, newest last
    scale, retune = patch["scalingHistory"][-2:]
    assert (scale["fromReplicas"], scale["toReplicas"], scale["reason"]) == (2, 3, "waiting_above_target")
    assert (retune["pod"], retune["fromMaxNumSeqs"], retune["toMaxNumSeqs"]) == ("a", 16, 12)
    # The numbers behind each record as fields, for tools (the whole-loop checks): 60 waiting / 10 = 6.
    assert (scale["signal"], scale["signalValue"], scale["target"], scale["metricReplicas"]) == (
        "WaitingRequests", 30, 10, 6)
    assert retune["kvUsageReadings"] == [0.99, 0.97, 0.985] and retune["preemptionsAtReadings"] == [0, 2, 0]
    assert ScalingRecord.model_validate(scale).metric_replicas == 6  # the CRD's schema keeps them
    assert ScalingRecord.model_validate(retune).preemptions_at_readings == [0, 2, 0]
    assert patch["waitingRequests"] == 60 and patch["kvCacheUsage"] == 0.99
    conditions = {c["type"]: c for c in patch["conditions"]}
    assert conditions["MetricsAvailable"]["status"] == "True"
    assert (conditions["ScalingLimited"]["status"], conditions["ScalingLimited"]["reason"]) == ("True", "TooManyReplicas")
    events = events_for(decision, record)
    assert [(e.type, e.reason) for e in events] == [("Normal", "ScaleUp"), ("Normal", "RetuneDown"), ("Warning", "RetuneFailed")]
    assert "2 -> 3" in events[0].message and "HTTP 401" in events[2].message
    assert config_max_num_seqs(decision, [change], 16) == 12


def test_external_mode_status_leaves_desired_replicas_alone():
    decision = decide(Settings(mode="External"), State(1, (PodState("a", 0, 1),)),
                      {"a": [PodSample("a", 100, 50, 4, 0.5, 0, 4)]}, 100)
    patch = status_patch({}, Settings(mode="External"), decision, Record(), 4, datetime(2026, 1, 1, tzinfo=UTC))
    assert "desiredReplicas" not in patch and "scalingHistory" not in patch
    assert events_for(decision, Record()) == []


def _owned(kind: str, name: str, uid: str, owner_uid: str | None, **meta) -> dict:
    refs = [{"kind": kind, "uid": owner_uid, "controller": True}] if owner_uid else []
    return {"metadata": {"name": name, "uid": uid, "ownerReferences": refs,
                         "creationTimestamp": "2026-01-01T00:00:00Z", **meta}}


def test_only_pods_of_the_current_replica_set_are_trusted():
    from iterserve.operator.autoscaling.loop import trusted_pods

    revision = {"annotations": {"deployment.kubernetes.io/revision": "2"}}
    deployment = _owned("InferenceService", "llm", "dep", "isvc", **revision)
    current = _owned("Deployment", "llm-new", "rs2", "dep", labels={"pod-template-hash": "new"}, **revision)
    old = _owned("Deployment", "llm-old", "rs1", "dep", labels={"pod-template-hash": "old"},
                 annotations={"deployment.kubernetes.io/revision": "1"})
    foreign = _owned("Deployment", "other", "rs9", "someone-elses", labels={"pod-template-hash": "new"}, **revision)
    pods = [_owned("ReplicaSet", "own", "p1", "rs2", labels={"pod-template-hash": "new"}),
            _owned("ReplicaSet", "leaving", "p2", "rs1", labels={"pod-template-hash": "old"}),
            _owned("ReplicaSet", "hash-mismatch", "p3", "rs2", labels={"pod-template-hash": "forged"}),
            _owned("ReplicaSet", "foreign", "p4", "rs9", labels={"pod-template-hash": "new"}),
            _owned("Pod", "hand-made", "p5", None, labels={"pod-template-hash": "new"})]
    trusted, strangers = trusted_pods(pods, deployment, [current, old, foreign])
    assert [p["metadata"]["name"] for p in trusted] == ["own"]
    assert strangers == ["hash-mismatch", "foreign", "hand-made"]  # an older revision's pods are not strangers
    assert trusted_pods(pods, None, [current]) == ([], [])


def test_the_hook_splits_a_disaggregated_services_pods_by_role_and_trusts_each_pool_through_its_deployment():
    """Decode readings come from the engine Deployment's pods, prefill readings from NAME-prefill's;
    a pod labelled prefill that neither Deployment owns is a stranger, read by no pool."""
    import logging

    from iterserve.operator.autoscaling.hook import AutoscalerHook
    from iterserve.operator.handlers import TickContext
    from iterserve.operator.validation import parse_spec

    body = {"metadata": {"name": "llm", "namespace": "ns", "uid": "isvc"}}
    revision = {"annotations": {"deployment.kubernetes.io/revision": "1"}}

    def pod(name: str, owner: str | None, hash_: str, role: str) -> dict:
        return _owned("ReplicaSet", name, f"uid-{name}", owner,
                      labels={"pod-template-hash": hash_, "iterserve.dev/role": role})

    objects = {"llm": {**_owned("InferenceService", "llm", "dep-d", "isvc", **revision), "kind": "Deployment"},
               "llm-prefill": {**_owned("InferenceService", "llm-prefill", "dep-p", "isvc", **revision),
                               "kind": "Deployment"}}
    for obj in objects.values():
        obj["metadata"]["ownerReferences"][0]["kind"] = "InferenceService"
    replica_sets = [_owned("Deployment", "rs-d", "rs-d", "dep-d", labels={"pod-template-hash": "d"}, **revision),
                    _owned("Deployment", "rs-p", "rs-p", "dep-p", labels={"pod-template-hash": "p"}, **revision)]
    pods = [pod("decode-1", "rs-d", "d", "decode"), pod("prefill-1", "rs-p", "p", "prefill"),
            pod("look-alike", None, "p", "prefill")]

    class Kube:
        def list_pods(self, namespace, selector):
            return pods

        def list_replica_sets(self, namespace, selector):
            return replica_sets

        def get(self, kind, namespace, name):
            return objects.get(name) if kind == "Deployment" else None

    class Ticks:
        metrics = None
        seen: dict = {}

        def due(self, *args):
            return True

        async def tick(self, **kwargs):
            self.seen.update(kwargs)
            return "tick"

    class Reconciler:
        def reconcile(self, namespace, name, tick=None):
            Ticks.seen["recorded"] = tick

    spec = parse_spec({"model": {"uri": "m"}, "autoscaling": {},
                       "disaggregation": {"enabled": True, "prefill": {"replicas": 2}}})
    hook = AutoscalerHook(autoscaler=Ticks())
    hook(TickContext("ns", "llm", body, spec, Reconciler(), Kube(), logging.getLogger("t")))
    names = lambda listed: [p["metadata"]["name"] for p in listed]  # noqa: E731
    pools = Ticks.seen["pools"]
    assert names(pools["decode"].pods) == ["decode-1"]
    assert names(pools["prefill"].pods) == ["prefill-1"]
    assert pools["prefill"].replicas == 2 and Ticks.seen["recorded"] == "tick"
    assert hook._strangers[("ns", "llm")] == ["look-alike"]
