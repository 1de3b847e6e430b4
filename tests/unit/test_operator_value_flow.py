"""One writer per value: the autoscaler's tick writes only engines (admin API) and spec.replicas;
the reconcile alone writes the ConfigMap and status, recording the tick it is handed."""

from __future__ import annotations

import asyncio
import copy
from datetime import UTC, datetime

from iterserve.operator.autoscaling import policy
from iterserve.operator.autoscaling.engine_admin import SeqsOutcome
from iterserve.operator.autoscaling.loop import Autoscaler, PoolPods
from iterserve.operator.autoscaling.report import AutoscalerTick, Record
from iterserve.operator.autoscaling.settings import DECODE, PREFILL
from iterserve.operator.reconcile import Reconciler


class MemoryKube:
    """The Kube methods the reconcile and the autoscaler call, on dicts, recording every write."""

    def __init__(self, spec: dict, status: dict | None = None):
        self.objects: dict[tuple[str, str], dict] = {}
        self.body = {"apiVersion": "iterserve.dev/v1alpha1", "kind": "InferenceService",
                     "metadata": {"namespace": "ns", "name": "llm", "uid": "u1", "generation": 1,
                                  "resourceVersion": "1"},
                     "spec": spec, "status": status or {}}
        self.writes: list[tuple[str, str]] = []
        self.events: list[str] = []
        self.version = 1
        self.served = False  # whether the API server serves InferencePools

    def _bump(self, obj: dict) -> dict:
        self.version += 1
        obj["metadata"]["resourceVersion"] = str(self.version)
        return obj

    def get_inference_service(self, namespace, name):
        return copy.deepcopy(self.body)

    def patch_status(self, namespace, name, status, resource_version):
        self.writes.append(("status", ",".join(sorted(status))))
        self.body["status"] = {**self.body["status"], **status}
        return copy.deepcopy(self._bump(self.body))

    def scale_inference_service(self, namespace, name, replicas):
        self.writes.append(("spec.replicas", str(replicas)))
        self.body["spec"]["replicas"] = replicas
        return copy.deepcopy(self._bump(self.body))

    def scale_prefill_pool(self, namespace, name, replicas):
        self.writes.append(("spec.disaggregation.prefill.replicas", str(replicas)))
        self.body["spec"]["disaggregation"]["prefill"]["replicas"] = replicas
        return copy.deepcopy(self._bump(self.body))

    def get(self, kind, namespace, name):
        found = self.objects.get((kind, name))
        return copy.deepcopy(found) if found else None

    def apply(self, manifest, dry_run=False):
        if dry_run:
            return manifest
        self.writes.append((manifest["kind"], manifest["metadata"]["name"]))
        obj = self._bump(copy.deepcopy(manifest))
        if manifest["kind"] == "Deployment":
            obj["status"] = {"replicas": 1, "readyReplicas": 1, "updatedReplicas": 1, "observedGeneration": 1}
            obj["metadata"]["generation"] = 1
        self.objects[(manifest["kind"], manifest["metadata"]["name"])] = obj
        return copy.deepcopy(obj)

    def delete(self, obj):
        self.writes.append(("delete " + obj["kind"], obj["metadata"]["name"]))
        del self.objects[(obj["kind"], obj["metadata"]["name"])]

    def api_resource_served(self, group, version, plural):
        return self.served

    def create_secret(self, manifest):
        self.writes.append(("Secret", manifest["metadata"]["name"]))
        self.objects[("Secret", manifest["metadata"]["name"])] = self._bump(copy.deepcopy(manifest))
        return manifest

    def post_event(self, owner, type_, reason, message):
        self.events.append(reason)


SPEC = {"model": {"uri": "m"}, "engine": {"maxNumSeqs": 16}, "replicas": 1,
        "autoscaling": {"mode": "Builtin", "minReplicas": 1, "maxReplicas": 3}}


def _tick(settings: policy.Settings) -> AutoscalerTick:
    samples = {"llm-a": [policy.PodSample("llm-a", 100, 30, 16, 0.99, 5, 16)]}
    decision = policy.decide(settings, policy.State(1, (policy.PodState("llm-a", 0, 1),)), samples, 100)
    change = policy.SeqsChange("llm-a", 16, 12, "kv_pressure", "KV usage 0.99")
    record = Record(replicas_applied=True, seqs=SeqsOutcome((change,), ()))
    return AutoscalerTick(settings, decision, record, datetime(2026, 1, 1, tzinfo=UTC), 12)


def test_the_reconcile_records_a_tick_in_status_configmap_and_events():
    kube = MemoryKube(copy.deepcopy(SPEC))
    reconciler = Reconciler(kube)
    reconciler.reconcile("ns", "llm")
    reconciler.reconcile("ns", "llm")  # the router is ready now: the Service moves to it
    assert kube.objects[("ConfigMap", "llm-engine")]["data"] == {"max_num_seqs": "16"}
    kube.writes.clear()

    reconciler.reconcile("ns", "llm", tick=_tick(policy.Settings(warmup_seconds=0, max_replicas=3, spec_max_num_seqs=16)))
    assert kube.objects[("ConfigMap", "llm-engine")]["data"] == {"max_num_seqs": "12"}
    status = kube.body["status"]
    assert status["effectiveMaxNumSeqs"] == 12 and status["desiredReplicas"] == 3
    assert [h["action"] for h in status["scalingHistory"]] == ["ScaleUp", "RetuneDown"]
    assert [w for w, _ in kube.writes] == ["ConfigMap", "status"]  # one status write, with the tick in it
    assert kube.events[-2:] == ["ScaleUp", "RetuneDown"]

    kube.writes.clear()  # later reconciles keep the recorded value and write nothing
    reconciler.reconcile("ns", "llm")
    assert kube.writes == [] and kube.objects[("ConfigMap", "llm-engine")]["data"] == {"max_num_seqs": "12"}


def test_the_autoscaler_tick_writes_only_spec_replicas():
    kube = MemoryKube(copy.deepcopy(SPEC))
    from iterserve.operator.validation import parse_spec

    spec = parse_spec({**SPEC, "autoscaling": {**SPEC["autoscaling"], "minReplicas": 2}})
    tick = asyncio.run(Autoscaler().tick(namespace="ns", name="llm", spec=spec, pools={DECODE: PoolPods(1, [])},
                                         port=8000, admin_token=None, kube=kube))
    assert tick.decision.desired_replicas == 2 and tick.record.replicas_applied
    assert kube.writes == [("spec.replicas", "2")] and kube.events == []
    assert tick.max_num_seqs is None  # nothing read: the reconcile keeps what it recorded


DISAGGREGATED = {**SPEC, "autoscaling": {**SPEC["autoscaling"], "warmupSeconds": 0},
                 "disaggregation": {"enabled": True, "prefill": {
                     "replicas": 1, "minReplicas": 1, "maxReplicas": 4, "targetQueuedPromptTokens": 1000}}}


def _pod(name: str, ip: str) -> dict:
    return {"metadata": {"name": name, "creationTimestamp": "2026-01-01T00:00:00Z"},
            "status": {"podIP": ip, "phase": "Running",
                       "conditions": [{"type": "Ready", "status": "True", "lastTransitionTime": "2026-01-01T00:01:00Z"}]}}


class _Readings:
    """A metrics source with fixed readings: decode pod llm-d idle, prefill pod llm-prefill-p behind."""

    def __init__(self, clock):
        self.clock = clock
        self.read_pods: list[str] = []

    async def read(self, pods):
        self.read_pods = [p.name for p in pods]
        values = {"llm-d": dict(waiting=0.0, running=1.0, queued_prompt_tokens=0.0),
                  "llm-prefill-p": dict(waiting=2.0, running=1.0, queued_prompt_tokens=3500.0)}
        return [policy.PodSample(p.name, self.clock(), kv_usage=0.1, preemptions_total=0.0, max_num_seqs=16.0,
                                 **values[p.name]) for p in pods]


def test_a_disaggregated_tick_decides_each_pool_on_its_own_pods_and_scales_the_prefill_pool_through_its_spec():
    from iterserve.operator.validation import parse_spec

    kube = MemoryKube(copy.deepcopy(DISAGGREGATED))
    reconciler = Reconciler(kube)
    reconciler.reconcile("ns", "llm")
    reconciler.reconcile("ns", "llm")
    assert kube.objects[("Deployment", "llm-prefill")]["spec"]["replicas"] == 1
    kube.writes.clear()
    now = datetime(2026, 1, 1, 0, 10, tzinfo=UTC).timestamp()
    autoscaler = Autoscaler(clock=lambda: now)
    readings = _Readings(autoscaler.clock)
    autoscaler.source_for = lambda spec, namespace: readings
    pools = {DECODE: PoolPods(1, [_pod("llm-d", "10.0.0.1")]), PREFILL: PoolPods(1, [_pod("llm-prefill-p", "10.0.0.2")])}
    tick = asyncio.run(autoscaler.tick(namespace="ns", name="llm", spec=parse_spec(DISAGGREGATED), pools=pools,
                                       port=8000, admin_token=None, kube=kube))
    assert readings.read_pods == ["llm-d", "llm-prefill-p"]  # one read for both pools
    # The decode pool read only its own pod (the prefill pod's 2 waiting would not scale it).
    assert [p.pod for p in tick.decision.pods] == ["llm-d"] and tick.decision.desired_replicas == 1
    prefill = tick.pool(PREFILL).decision
    assert prefill.desired_replicas == 4 and prefill.signal_value == 3500
    assert kube.writes == [("spec.disaggregation.prefill.replicas", "4")]
    assert sorted(autoscaler._memories) == [("ns", "llm", "decode"), ("ns", "llm", "prefill")]  # one per pool

    reconciler.reconcile("ns", "llm", tick=tick)
    assert kube.objects[("Deployment", "llm-prefill")]["spec"]["replicas"] == 4  # the reconcile follows the spec
    assert kube.objects[("Deployment", "llm")]["spec"]["replicas"] == 1
    prefill = kube.body["status"]["prefill"]
    assert prefill["desiredReplicas"] == 4 and prefill["signal"] == "QueuedPromptTokens"
    assert prefill["signalValue"] == 3500 and prefill["target"] == 1000 and prefill["lastScaleTime"]
    assert prefill["reason"] == "queued_prompt_tokens_above_target"
    assert [(h["action"], h.get("pool"), h["toReplicas"]) for h in kube.body["status"]["scalingHistory"]] == [
        ("ScaleUp", "prefill", 4)]
    assert "ScaleUp" in kube.events
    autoscaler.forget("ns", "llm")
    assert autoscaler._memories == {}


def test_with_autoscaling_off_the_prefill_pool_follows_its_spec_replicas():
    spec = {**DISAGGREGATED, "disaggregation": {"enabled": True, "prefill": {"replicas": 3}}}
    spec.pop("autoscaling")
    kube = MemoryKube(spec)
    Reconciler(kube).reconcile("ns", "llm")
    assert kube.objects[("Deployment", "llm-prefill")]["spec"]["replicas"] == 3
    assert kube.body["status"]["prefill"]["desiredReplicas"] == 3
