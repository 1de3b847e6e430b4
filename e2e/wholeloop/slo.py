"""SLO mode against the queue policy, and scale to zero, in the local cluster with the embedded model.

Two runs share the whole loop's machinery (stack.py: control plane, the chart's RBAC, the operator
as a process, the local pod runtime; timeline.py: a row a second; loadgen streaming through the
router's Service, TTFT measured by the client):

  run_policy   one InferenceService (the embedded SmolLM2-135M, Router mode) under a load step:
               light -> step -> light, Poisson arrivals, fixed prompt and output lengths. Run once
               with spec.autoscaling.slo (ttftP95Ms) and once with the waiting-requests signal
               (targetWaitingPerReplica), same load and seed: summarize() gives per-phase p95 TTFT,
               target attainment, replica-seconds and scale events for each.
  run_zero     an InferenceService with minReplicas 0: served once, idle until it is at zero, then a
               burst of concurrent streaming requests at zero. Each request's first-token latency,
               and the cold start's parts from the API's timestamps (decision, pod created,
               scheduled, container started, Ready), the engine's own log lines (model loading,
               model ready) and its TTFT histogram.

Used by bench/cluster/slo_whole_loop.py (the measured run) and tests/e2e/test_slo_whole_loop.py
(short versions that check behaviour, not timing).
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
import urllib.request
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime
from pathlib import Path

from e2e.wholeloop.endpoints import ReadyEndpoints
from e2e.wholeloop.scenario import NAME
from e2e.wholeloop.stack import Stack, wait_for
from e2e.wholeloop.timeline import RequestLog, Sampler, epoch, percentile
from iterserve.devcluster.podrunner import local_runtime_scheduling
from iterserve.engine import metrics as names
from iterserve.engine.config import DEFAULT_MODEL
from iterserve.engine.loadgen import LoadSpec, run_load
from iterserve.operator.models import GROUP, PLURAL, READY, VERSION
from iterserve.operator.resources import ENGINE_PORT, selector_string
from iterserve.operator.routing import router_labels

STEP_PROFILE = "smollm2-135m-cpu"  # the shipped profile of the embedded model on one CPU thread
PHASES = ("before", "step", "after")
CHUNK_SECONDS = 5.0
WORKLOAD_WAIT_SECONDS = 60.0


@dataclass(frozen=True)
class Load:
    """The client's load: `light_rate` before and after a step to `step_rate`, Poisson arrivals."""

    prompt_tokens: int = 12
    output_tokens: int = 32
    light_rate: float = 0.5  # requests/s
    step_rate: float = 3.0
    before_seconds: float = 30
    step_seconds: float = 90
    after_seconds: float = 60
    seed: int = 0
    stop_step_on_scale_up: bool = False  # the test's short form: end the step at the first scale-up
    # SLO mode reads a workload only once a warm pod's readings cover half its window; on a slow
    # machine the pod can still be short of that when `before_seconds` ends, and the step's first
    # decision is then the waiting-requests fallback. True: the light phase goes on until
    # status.slo carries an arrival rate, at most WORKLOAD_WAIT_SECONDS more.
    before_until_workload: bool = False


@dataclass(frozen=True)
class Policy:
    name: str  # "slo" | "queue"
    ttft_target_ms: float  # what the run is judged against (both policies)
    slo: bool  # True: spec.autoscaling.slo.ttftP95Ms; False: targetWaitingPerReplica
    target_waiting_per_replica: float = 10
    slo_window_seconds: int = 20
    max_replicas: int = 3
    scale_down_window_seconds: int = 20
    max_num_seqs: int = 8


@dataclass(frozen=True)
class Engine:
    kv_cache_memory: str = "24MiB"  # 546 tokens of SmolLM2-135M's float32 KV: never the limit here
    max_model_len: int = 128
    startup_seconds: int = 180
    ready_timeout_seconds: float = 300


def inference_service(autoscaling: dict, engine: Engine, max_num_seqs: int, replicas: int = 1) -> dict:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "InferenceService",
        "metadata": {"name": NAME},
        "spec": {
            "model": {"uri": "smollm2-135m"},
            "engine": {
                "maxNumSeqs": max_num_seqs,
                "maxModelLen": engine.max_model_len,
                "kvCacheMemory": engine.kv_cache_memory,
                "drainSeconds": 60,
                "startupSeconds": engine.startup_seconds,
                "extraArgs": ["--max-waiting-requests", "1000"],
                "resources": {"limits": {"nvidia.com/gpu": 1}},
            },
            "replicas": replicas,
            "autoscaling": autoscaling,
            "scheduling": local_runtime_scheduling(),
            "routing": {"mode": "Router", "maxQueue": 1000, "queueTimeoutSeconds": 120},
            "podTemplatePatch": {"spec": {"containers": [{
                "name": "engine",
                "startupProbe": {"periodSeconds": 1, "failureThreshold": engine.startup_seconds},
                "readinessProbe": {"periodSeconds": 1},
            }]}},
        },
    }


def policy_autoscaling(policy: Policy) -> dict:
    autoscaling = {
        "mode": "Builtin", "minReplicas": 1, "maxReplicas": policy.max_replicas,
        "intervalSeconds": 1, "warmupSeconds": 5, "coldStartSeconds": 240,
        "targetWaitingPerReplica": policy.target_waiting_per_replica,
        "scaleDown": {"stabilizationWindowSeconds": policy.scale_down_window_seconds},
    }
    if policy.slo:
        autoscaling["slo"] = {"ttftP95Ms": policy.ttft_target_ms, "window": policy.slo_window_seconds,
                              "stepProfile": STEP_PROFILE}
    return autoscaling


class SloSampler(Sampler):
    """The whole loop's row, plus status.slo and status.heldRequests."""

    def _row(self) -> dict:
        row = super()._row()
        status = self.custom.get_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL,
                                                          self.name).get("status") or {}
        row["slo"] = status.get("slo")
        row["held_requests"] = status.get("heldRequests")
        return row


def _serving(custom, namespace: str, endpoints: ReadyEndpoints) -> bool:
    """The InferenceService Ready, its Service on a ready router pod, and the router has seen an engine."""
    body = custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, NAME)
    ready = any(c["type"] == READY and c["status"] == "True" for c in (body.get("status") or {}).get("conditions") or [])
    if not (ready and endpoints() and endpoints.selector == router_labels(NAME)):
        return False
    try:
        with urllib.request.urlopen(f"{endpoints()[0]}/metrics", timeout=2) as response:
            return f"{names.ROUTER_ENDPOINT_IN_FLIGHT}{{" in response.read().decode()
    except OSError:
        return False


def _events(api, namespace: str) -> list[dict]:
    from kubernetes import client

    items = json.loads(client.CoreV1Api(api).list_namespaced_event(
        namespace, field_selector=f"involvedObject.name={NAME}", _preload_content=False).data)["items"]
    return [{"reason": e["reason"], "type": e["type"], "message": e["message"],
             "time": e.get("lastTimestamp") or e.get("eventTime")} for e in items]


def run_policy(cluster, workdir: Path, policy: Policy, load: Load, engine: Engine = Engine(), log=print) -> dict:
    """One policy under the load step; everything summarize() needs."""
    from kubernetes import client

    started = time.monotonic()
    with Stack(cluster, workdir, log) as stack:
        custom = client.CustomObjectsApi(stack.api)
        custom.create_namespaced_custom_object(
            GROUP, VERSION, stack.namespace, PLURAL,
            inference_service(policy_autoscaling(policy), engine, policy.max_num_seqs))
        endpoints = ReadyEndpoints(stack.api, stack.namespace, NAME).start()
        requests = RequestLog()
        sampler = SloSampler(stack.api, stack.namespace, NAME, requests).start()
        try:
            wait_for(lambda: _serving(custom, stack.namespace, endpoints), engine.ready_timeout_seconds,
                     what=f"Ready and the router serving (pod logs in {workdir / 'pods'}, operator log "
                          f"{stack.operator.log_path})")
            ready_after = time.monotonic() - started
            log(f"{policy.name}: first replica and router ready after {ready_after:.1f} s")
            phases = asyncio.run(_drive(load, endpoints, requests, sampler, log))
        finally:
            timeline = sampler.stop()
            endpoints.stop()
        events = _events(stack.api, stack.namespace)
        forbidden = stack.operator.forbidden_lines()
    return {
        "policy": asdict(policy), "load": asdict(load), "engine": asdict(engine),
        "started_at": timeline.started, "ready_after_s": round(ready_after, 1),
        "wall_seconds": round(time.monotonic() - started, 1), "phases": phases,
        "timeline": timeline.rows,
        "decisions": sorted(timeline.decisions.values(), key=lambda r: r["time"]),
        "events": events, "requests": [asdict(r) for r in requests.snapshot()],
        "operator_forbidden": forbidden,
    }


async def _drive(load: Load, endpoints, requests: RequestLog, sampler: Sampler, log) -> dict:
    """light -> step -> light; phases as [start, end] epoch seconds (a request belongs to the phase
    it was sent in). Each phase's Poisson arrivals are sent in CHUNK_SECONDS pieces, each its own
    loadgen run (seeded in turn), so the short form can end the step at the first scale-up without
    cutting a request short."""
    rates = {"before": (load.light_rate, load.before_seconds), "step": (load.step_rate, load.step_seconds),
             "after": (load.light_rate, load.after_seconds)}
    phases, tasks, chunk = {}, [], 0
    for phase in PHASES:
        rate, seconds = rates[phase]
        if seconds <= 0:
            continue
        requests.phase = phase
        began = time.time()
        log(f"  {phase}: {rate:g} req/s for {seconds:g} s")
        while (left := began + seconds - time.time()) > 0.05 or (
                phase == "before" and load.before_until_workload and not _workload_read(sampler)
                and (left := began + seconds + WORKLOAD_WAIT_SECONDS - time.time()) > 0.05):
            if phase == "step" and load.stop_step_on_scale_up and _scaled_up(sampler):
                log(f"  step: the first scale-up is recorded after {time.time() - began:.1f} s; ending the step")
                break
            piece = min(CHUNK_SECONDS, left)
            chunk += 1
            spec = LoadSpec(url="http://127.0.0.1:9", rate=rate, requests=None, duration=piece,
                            prompt_len=load.prompt_tokens, max_tokens=load.output_tokens, model=DEFAULT_MODEL,
                            seed=load.seed * 1000 + chunk, timeout=300, endpoints=endpoints,
                            on_result=requests.on_result)
            tasks.append(asyncio.create_task(run_load(spec)))
            await asyncio.sleep(piece)
        if phase == "before" and time.time() - began > seconds + 1:
            log(f"  before: SLO mode read a workload after {time.time() - began:.1f} s")
        phases[phase] = [began, time.time()]
    await asyncio.gather(*tasks)
    phases["end"] = time.time()
    return phases


def _workload_read(sampler: Sampler) -> bool:
    latest = sampler.latest
    return bool(latest and (latest.get("slo") or {}).get("arrivalRate") is not None)


def _scaled_up(sampler: Sampler) -> bool:
    return any(d["action"] == "ScaleUp" for d in list(sampler.timeline.decisions.values()))


def _integrate(rows: list[dict], key: str, start: float, end: float) -> float:
    """Sum of value x seconds over [start, end] (row times relative to the timeline's start), each
    row's value held until the next row."""
    total = 0.0
    for row, following in zip(rows, rows[1:], strict=False):
        a, b = max(row["t"], start), min(following["t"], end)
        if b > a and row.get(key) is not None:
            total += row[key] * (b - a)
    return total


def summarize(result: dict) -> dict:
    """Per phase: requests, failed, client p50/p95 TTFT, the share of requests whose TTFT met the
    target (a failed request misses); over the load's phases (the same seconds for every policy):
    replica-seconds (pods alive, loading ones included, and ready ones), and pods alive until the
    last request was answered; scale events and, in SLO mode, the status.slo readings."""
    policy, origin = result["policy"], result["started_at"]
    target = policy["ttft_target_ms"] / 1000
    requests = result["requests"]
    phases = {p: v for p, v in result["phases"].items() if p in PHASES}
    out: dict = {"policy": policy["name"], "ttft_target_s": target, "phases": {}}
    everything = []
    for phase, (a, b) in phases.items():
        inside = [r for r in requests if a <= r["start"] < b]
        everything += inside
        out["phases"][phase] = _phase_figures(inside, target)
        out["phases"][phase]["seconds"] = round(b - a, 1)
    out["all"] = _phase_figures(everything, target)
    rows = [r for r in result["timeline"] if "error" not in r]
    first = min(a for a, _ in phases.values()) - origin
    sent = max(b for _, b in phases.values()) - origin  # the load's phases: the same for every policy
    last = result["phases"]["end"] - origin  # the last request answered
    out["load_seconds"] = round(sent - first, 1)
    out["replica_seconds"] = round(_integrate(rows, "pods_live", first, sent), 1)
    out["ready_replica_seconds"] = round(_integrate(rows, "replicas_ready", first, sent), 1)
    out["seconds_to_last_answer"] = round(last - first, 1)
    out["replica_seconds_to_last_answer"] = round(_integrate(rows, "pods_live", first, last), 1)
    out["max_replicas"] = max((r["replicas_desired"] or 0 for r in rows), default=None)
    step_start = phases["step"][0] - origin if "step" in phases else first
    out["scale_events"] = [
        {"t_from_step_s": round(epoch(d["time"]) - origin - step_start, 1), "from": d.get("fromReplicas"),
         "to": d.get("toReplicas"), "reason": d["reason"], "signal": d.get("signal")}
        for d in result["decisions"] if d["action"] in ("ScaleUp", "ScaleDown")]
    slo_rows = [(r["t"], r["slo"]) for r in rows if r.get("slo")]
    if slo_rows:
        out["slo_status"] = {
            "readings": len(slo_rows),
            "with_predicted": sum(1 for _, s in slo_rows if s.get("predictedTtftP95") is not None),
            "with_measured": sum(1 for _, s in slo_rows if s.get("measuredTtftP95") is not None),
            "fallback_readings": sum(1 for _, s in slo_rows if s.get("fallback")),
            "last": slo_rows[-1][1],
        }
    out["failed"] = sum(1 for r in requests if not r["ok"])
    out["operator_forbidden"] = len(result.get("operator_forbidden") or [])
    return out


def _phase_figures(requests: list[dict], target: float) -> dict:
    ttfts = [r["ttft"] for r in requests if r["ok"] and r["ttft"] is not None]
    errors: dict[str, int] = {}
    for r in requests:
        if not r["ok"]:
            errors[str(r.get("status"))] = errors.get(str(r.get("status")), 0) + 1
    met = sum(1 for r in requests if r["ok"] and r["ttft"] is not None and r["ttft"] <= target)
    return {
        "requests": len(requests), "failed": sum(1 for r in requests if not r["ok"]), "failed_by_status": errors,
        "ttft_p50_s": _round(percentile(ttfts, 0.5)), "ttft_p95_s": _round(percentile(ttfts, 0.95)),
        "attainment": round(met / len(requests), 3) if requests else None,
        "p95_met": (percentile(ttfts, 0.95) or math.inf) <= target if ttfts else None,
    }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


# Scale to zero -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class ZeroRun:
    burst: int = 8  # concurrent streaming requests arriving at zero
    prompt_tokens: int = 12
    output_tokens: int = 16
    idle_seconds: int = 5  # scaleToZeroAfterSeconds
    engine: Engine = field(default_factory=Engine)


LOG_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \w+ iterserve\.server: (.*)$")


def _log_times(path: Path) -> dict:
    """Epoch seconds of the engine's own start-up lines (logging's local-time asctime, ms)."""
    found = {}
    if not path.exists():
        return found
    for line in path.read_text(errors="replace").splitlines():
        match = LOG_LINE.match(line)
        if not match:
            continue
        stamp, message = match.groups()
        at = datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()
        if message.startswith("loading model") and "loading_model" not in found:
            found["loading_model"] = at
        elif " ready in " in message and "model_ready" not in found:
            found["model_ready"] = at
            seconds = re.search(r"ready in ([\d.]+) s", message)
            found["load_seconds_logged"] = float(seconds.group(1)) if seconds else None
    return found


def _engine_pods(core, namespace: str) -> list[dict]:
    return json.loads(core.list_namespaced_pod(namespace, label_selector=selector_string(NAME),
                                               _preload_content=False).data)["items"]


def _ttft_histogram(ip: str) -> dict | None:
    """The engine's own TTFT histogram (sum, count): arrival at the engine -> first token."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(f"http://{ip}:{ENGINE_PORT}/metrics", timeout=5) as response:
            text = response.read().decode()
    except OSError:
        return None
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == f"{names.TIME_TO_FIRST_TOKEN}_sum":
                out["sum_s"] = out.get("sum_s", 0) + sample.value
            elif sample.name == f"{names.TIME_TO_FIRST_TOKEN}_count":
                out["count"] = out.get("count", 0) + sample.value
    return out or None


def run_zero(cluster, workdir: Path, zero: ZeroRun = ZeroRun(), log=print) -> dict:
    """Served, idle to zero, then a burst at zero: each request's first-token latency and the cold
    start's parts."""
    from kubernetes import client

    autoscaling = {"mode": "Builtin", "minReplicas": 0, "maxReplicas": 1, "scaleToZeroAfterSeconds": zero.idle_seconds,
                   "intervalSeconds": 1, "warmupSeconds": 0}
    started = time.monotonic()
    with Stack(cluster, workdir, log) as stack:
        custom, core = client.CustomObjectsApi(stack.api), client.CoreV1Api(stack.api)
        custom.create_namespaced_custom_object(GROUP, VERSION, stack.namespace, PLURAL,
                                               inference_service(autoscaling, zero.engine, max(8, zero.burst)))
        endpoints = ReadyEndpoints(stack.api, stack.namespace, NAME).start()
        try:
            wait_for(lambda: _serving(custom, stack.namespace, endpoints), zero.engine.ready_timeout_seconds,
                     what=f"Ready and the router serving (pod logs in {workdir / 'pods'})")
            log(f"zero: first replica and router ready after {time.monotonic() - started:.1f} s; one request")
            warm = asyncio.run(run_load(_burst_spec(zero, endpoints, 1)))
            first_pods = {p["metadata"]["uid"] for p in _engine_pods(core, stack.namespace)}

            def at_zero() -> bool:
                body = custom.get_namespaced_custom_object(GROUP, VERSION, stack.namespace, PLURAL, NAME)
                return body["spec"]["replicas"] == 0 and not _engine_pods(core, stack.namespace)

            idle_from = time.monotonic()
            wait_for(at_zero, 120 + zero.idle_seconds, 0.5,
                     what=f"spec.replicas 0 and no engine pod (operator log {stack.operator.log_path})")
            to_zero_s = time.monotonic() - idle_from
            log(f"zero: at zero {to_zero_s:.1f} s after the last request; a burst of {zero.burst} streams")
            sent_at = time.time()
            burst = []
            report = asyncio.run(run_load(replace(_burst_spec(zero, endpoints, zero.burst),
                                                  on_result=lambda r: burst.append(r))))
            pods = [p for p in _engine_pods(core, stack.namespace) if p["metadata"]["uid"] not in first_pods]
            pod = pods[0] if pods else None
            histogram = _ttft_histogram(pod["status"]["podIP"]) if pod and pod["status"].get("podIP") else None
            body = custom.get_namespaced_custom_object(GROUP, VERSION, stack.namespace, PLURAL, NAME)
        finally:
            endpoints.stop()
        events = _events(stack.api, stack.namespace)
        history = (body.get("status") or {}).get("scalingHistory") or []
        log_path = (workdir / "pods" / f"{stack.namespace}_{pod['metadata']['name']}_engine.log") if pod else None
    results = [{"ok": r.ok, "status": str(r.status), "ttft_s": round(r.first_token - r.start, 3)
                if r.ok and r.first_token is not None else None, "e2e_s": round(r.end - r.start, 3),
                "output_tokens": r.output_tokens} for r in burst]
    # perf_counter -> epoch: the burst's own clock started at sent_at (all sent at once)
    first_token_at = sent_at + min((r["ttft_s"] for r in results if r["ttft_s"] is not None), default=math.nan)
    return {
        "zero": asdict(zero), "wall_seconds": round(time.monotonic() - started, 1),
        "warm_request_ok": warm["completed"] == 1 if "completed" in warm else None,
        "to_zero_after_idle_s": round(to_zero_s, 1),
        "burst": results, "loadgen": report,
        "cold_start": _cold_start(sent_at, first_token_at, history, pod, log_path, histogram),
        "scaling_history": history, "events": events,
    }


def _burst_spec(zero: ZeroRun, endpoints, count: int) -> LoadSpec:
    return LoadSpec(url="http://127.0.0.1:9", rate=math.inf, requests=count, prompt_len=zero.prompt_tokens,
                    max_tokens=zero.output_tokens, model=DEFAULT_MODEL, seed=count, timeout=300,
                    endpoints=endpoints)


def _cold_start(sent_at: float, first_token_at: float, history: list[dict], pod: dict | None,
                log_path: Path | None, histogram: dict | None) -> dict:
    """Seconds since the burst was sent, for each mark the API, the engine's log and the client give
    (API timestamps have one-second resolution; the log's, milliseconds)."""
    marks: dict[str, float | None] = {}
    up = [h for h in history if h.get("reason") == "held_requests"]
    marks["decision_held_requests"] = epoch(up[-1]["time"]) if up else None
    if pod is not None:
        meta, status = pod["metadata"], pod.get("status") or {}
        marks["pod_created"] = epoch(meta["creationTimestamp"])
        conditions = {c["type"]: c.get("lastTransitionTime") for c in status.get("conditions") or []}
        marks["pod_scheduled"] = epoch(conditions["PodScheduled"]) if conditions.get("PodScheduled") else None
        containers = [c for c in status.get("containerStatuses") or [] if c.get("name") == "engine"]
        running = (containers[0].get("state") or {}).get("running") if containers else None
        marks["container_started"] = epoch(running["startedAt"]) if running and running.get("startedAt") else None
        marks["pod_ready"] = epoch(conditions["Ready"]) if conditions.get("Ready") else None
    logged = _log_times(log_path) if log_path else {}
    marks["engine_loading_model_log"] = logged.get("loading_model")
    marks["engine_model_ready_log"] = logged.get("model_ready")
    marks["first_token_client"] = first_token_at
    relative = {k: (None if v is None or math.isnan(v) else round(v - sent_at, 2)) for k, v in marks.items()}

    def span(a: str, b: str) -> float | None:
        return None if relative.get(a) is None or relative.get(b) is None else round(relative[b] - relative[a], 2)

    parts = {
        "request_to_decision_s": relative.get("decision_held_requests"),
        "decision_to_pod_created_s": span("decision_held_requests", "pod_created"),
        "pod_created_to_scheduled_s": span("pod_created", "pod_scheduled"),
        "scheduled_to_container_started_s": span("pod_scheduled", "container_started"),
        "process_start_to_loading_log_s": span("container_started", "engine_loading_model_log"),
        "model_load_s": logged.get("load_seconds_logged"),
        "model_ready_to_pod_ready_s": span("engine_model_ready_log", "pod_ready"),
        "pod_ready_to_first_token_s": span("pod_ready", "first_token_client"),
    }
    if histogram and histogram.get("count"):
        parts["engine_ttft_mean_s"] = round(histogram["sum_s"] / histogram["count"], 3)
        parts["engine_ttft_count"] = int(histogram["count"])
    return {"marks_s": relative, "parts_s": parts, "end_to_end_first_token_s": relative.get("first_token_client")}
