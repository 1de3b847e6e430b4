"""The run itself: apply the InferenceService, wait for its first replica and its router, then drive
load through the Service's ready endpoints (the router pod: spec.routing.mode Router) in phases (idle -> heavy -> light, until the scale-down has settled),
sampling the timeline every second. Returns everything the checks and the plot need."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from dataclasses import asdict
from pathlib import Path

from e2e.wholeloop import disaggregated
from e2e.wholeloop.checks import AFTER_RETUNE_SETTLE_SECONDS, MIN_AFTER_WINDOW_SECONDS
from e2e.wholeloop.endpoints import ReadyEndpoints
from e2e.wholeloop.go_on import go_on, ready_at_least
from e2e.wholeloop.scenario import NAME, Scenario, inference_service
from e2e.wholeloop.stack import Stack, wait_for
from e2e.wholeloop.timeline import RequestLog, Sampler, epoch
from iterserve.engine import metrics as names
from iterserve.engine.loadgen import LoadSpec, run_load
from iterserve.operator.models import GROUP, PLURAL, READY, VERSION
from iterserve.operator.routing import router_labels

LIGHT_CHUNK_SECONDS = 5


def run(cluster, workdir: Path, scenario: Scenario | disaggregated.DisaggregatedScenario, log=print) -> dict:
    """`scenario`: the aggregated loop (Scenario) or the disaggregated one (e2e/wholeloop/disaggregated.py)."""
    from kubernetes import client

    started = time.monotonic()
    address: list[str] = []
    split = getattr(scenario, "disaggregated", False)
    router_pd: dict = {}
    with Stack(cluster, workdir, log) as stack:
        custom = client.CustomObjectsApi(stack.api)
        custom.create_namespaced_custom_object(GROUP, VERSION, stack.namespace, PLURAL,
                                               disaggregated.inference_service(scenario) if split
                                               else inference_service(scenario))
        endpoints = ReadyEndpoints(stack.api, stack.namespace, NAME).start()
        requests = RequestLog()
        sampler = Sampler(stack.api, stack.namespace, NAME, requests).start()
        try:
            def serving() -> bool:  # the InferenceService Ready (engines and router) and its Service on the router
                body = custom.get_namespaced_custom_object(GROUP, VERSION, stack.namespace, PLURAL, NAME)
                ready = any(c["type"] == READY and c["status"] == "True"
                            for c in (body.get("status") or {}).get("conditions") or [])
                if not (ready and endpoints() and endpoints.selector == router_labels(NAME)):
                    return False
                try:  # and the router has seen an engine (it watches the pods itself)
                    with urllib.request.urlopen(f"{endpoints()[0]}/metrics", timeout=2) as response:
                        text = response.read().decode()
                except OSError:
                    return False
                if not split:
                    return f"{names.ROUTER_ENDPOINT_IN_FLIGHT}{{" in text
                # Disaggregated: a ready prefill pod too, and the router knows it.
                prefill = ((body.get("status") or {}).get("prefill") or {}).get("readyReplicas") or 0
                return prefill >= 1 and text.count(f"{names.ROUTER_ENDPOINT_IN_FLIGHT}{{") >= 2

            wait_for(serving,
                     scenario.ready_timeout_seconds,
                     what=f"Ready and the Service on a ready router pod (pod logs in {workdir / 'pods'}, operator log "
                          f"{stack.operator.log_path})")
            address = endpoints()
            log(f"first replica and the router ready after {time.monotonic() - started:.1f} s; driving load "
                f"through Service {NAME} -> router {', '.join(address)}")
            drive = disaggregated.drive if split else _drive
            phases = asyncio.run(drive(scenario, endpoints, requests, sampler, log))
            router_pd = _router_pd(address[0]) if address else {}
        finally:
            timeline = sampler.stop()
            endpoints.stop()
        events = json.loads(client.CoreV1Api(stack.api).list_namespaced_event(
            stack.namespace, field_selector=f"involvedObject.name={NAME}", _preload_content=False).data)["items"]
        forbidden = stack.operator.forbidden_lines()
        namespace = stack.namespace
    return {
        "scenario": asdict(scenario),
        "model": (f"{scenario.served_model} (the embedded model on CPU, one torch thread per engine)"
                  if scenario.real_model else "fake (--fake-model: real scheduler and KV pool, modelled step time)"),
        "namespace": namespace,
        "started_at": timeline.started,
        "wall_seconds": round(time.monotonic() - started, 1),
        "phases": phases,
        "timeline": timeline.rows,
        "decisions": sorted(timeline.decisions.values(), key=lambda r: r["time"]),
        "events": [{"reason": e["reason"], "type": e["type"], "message": e["message"],
                    "time": e.get("lastTimestamp") or e.get("eventTime")} for e in events],
        "requests": [asdict(r) for r in requests.snapshot()],
        "load_address": f"Service {NAME} -> router pod {', '.join(address)} (spec.routing.mode Router)",
        "load_via_router": bool(address),
        "operator_forbidden": forbidden,
        **router_pd,
    }


def _router_pd(router: str) -> dict:
    """The router's P/D decisions and fallbacks by reason (all zero or absent without disaggregation)."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(f"{router}/metrics", timeout=5) as response:
            text = response.read().decode()
    except OSError as error:
        return {"router_pd_decisions": {"error": str(error)}}
    out: dict[str, dict[str, float]] = {"router_pd_decisions": {}, "router_pd_fallbacks": {}}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = {names.ROUTER_PD_DECISIONS_TOTAL: "router_pd_decisions",
                   names.ROUTER_PD_FALLBACKS_TOTAL: "router_pd_fallbacks"}.get(sample.name)
            if key and "reason" in sample.labels:
                out[key][sample.labels["reason"]] = out[key].get(sample.labels["reason"], 0) + sample.value
    return out


async def _drive(scenario: Scenario, endpoints, requests: RequestLog, sampler: Sampler, log) -> dict:
    model = scenario.served_model
    origin = sampler.timeline.started
    phases = {}

    def spec(rate: float, seconds: float, max_tokens: int, seed: int) -> LoadSpec:
        return LoadSpec(url="http://127.0.0.1:9", rate=rate, requests=None, duration=seconds,
                        prompt_len=scenario.prompt_tokens, max_tokens=max_tokens, model=model, seed=seed,
                        timeout=300, endpoints=endpoints, on_result=requests.on_result)

    phases["idle"] = [round(time.time() - origin, 2), None]
    await asyncio.sleep(scenario.idle_seconds)
    requests.phase = "heavy"
    phases["idle"][1] = phases.setdefault("heavy", [round(time.time() - origin, 2), None])[0]
    log(f"heavy: {scenario.heavy_rate:g} req/s for {scenario.heavy_seconds:g} s")
    heavy = asyncio.create_task(run_load(spec(scenario.heavy_rate, scenario.heavy_seconds, scenario.output_tokens,
                                              scenario.seed)))
    await asyncio.sleep(scenario.heavy_seconds)
    more: list[asyncio.Task] = []
    scaled = ready_at_least(sampler, "replicas_ready", 2, phases["heavy"][0])
    went_on = await go_on(lambda: scaled() and _retune_window_covered(sampler),
                          lambda seconds, chunk: spec(scenario.heavy_rate, seconds, scenario.output_tokens,
                                                      scenario.seed + 100 + chunk),
                          scenario.answer_wait_seconds, more)
    if went_on > 0.05:
        log(f"heavy: went on {went_on:.1f} s more, until a second replica was Ready and the retuned pod had "
            f"{MIN_AFTER_WINDOW_SECONDS} s of load after its last retune"
            + ("" if scaled() and _retune_window_covered(sampler) else " (it never did)"))
    requests.phase = "light"
    phases["heavy"][1] = round(time.time() - origin, 2)
    phases["light"] = [phases["heavy"][1], None]
    log(f"light: {scenario.light_rate:g} req/s until back at {scenario.min_replicas} replica(s) "
        f"for {scenario.settle_seconds:g} s")
    deadline = time.monotonic() + scenario.light_max_seconds
    settled_since, chunk = None, 0
    while time.monotonic() < deadline:
        chunk += 1
        await run_load(spec(scenario.light_rate, LIGHT_CHUNK_SECONDS, scenario.light_max_tokens,
                            scenario.seed + chunk))
        row = sampler.latest or {}
        at_min = (row.get("replicas_desired") == scenario.min_replicas and row.get("pods_live") == scenario.min_replicas
                  and row.get("replicas_ready") == scenario.min_replicas and row.get("pods_terminating") == 0)
        settled_since = (settled_since or time.monotonic()) if at_min else None
        if settled_since is not None and time.monotonic() - settled_since >= scenario.settle_seconds:
            break
    await asyncio.gather(heavy, *more)
    phases["light"][1] = round(time.time() - origin, 2)
    return phases


def _retune_window_covered(sampler: Sampler) -> bool:
    """The first pod retuned for KV pressure has had its settling time and a whole measured
    window of load since its last retune (what checks.py's preemption-rate check reads)."""
    retunes = sorted((d for d in list(sampler.timeline.decisions.values())
                      if d["action"] == "RetuneDown" and d["reason"] == "kv_pressure"), key=lambda d: d["time"])
    if not retunes:
        return False
    last = max(epoch(d["time"]) for d in retunes if d["pod"] == retunes[0]["pod"])
    # +2 s: a decision reaches the timeline up to a sampling interval after its (whole-second) stamp.
    return time.time() >= last + AFTER_RETUNE_SETTLE_SECONDS + MIN_AFTER_WINDOW_SECONDS + 2
