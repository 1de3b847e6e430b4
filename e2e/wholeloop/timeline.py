"""A row every second of what the run looks like from outside: replicas asked for and ready (from
the API), each engine pod's queue, running sequences, KV usage, preemptions per minute and
max_num_seqs (from its own /metrics), and the clients' request rate and p95 TTFT (from loadgen's
results). The operator's scalingHistory entries are collected as they appear, so none is lost to
the status' ten-entry limit."""

from __future__ import annotations

import json
import math
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from datetime import datetime

import httpx

from iterserve.operator.autoscaling.metrics_source import MetricsFormatError, parse_engine_metrics
from iterserve.operator.models import GROUP, PLURAL, VERSION
from iterserve.operator.resources import ENGINE_PORT, PREFILL, ROLE_LABEL, selector_string

PREEMPTION_WINDOW_SECONDS = 20
CLIENT_WINDOW_SECONDS = 5


def epoch(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


@dataclass
class Request:
    """One finished loadgen request, on the wall clock."""

    start: float
    end: float
    ok: bool
    status: str
    ttft: float | None
    endpoint: str


class RequestLog:
    def __init__(self):
        self.requests: list[Request] = []
        self.phase = "idle"
        self._lock = threading.Lock()

    def on_result(self, result) -> None:
        end = time.time()
        ttft = result.first_token - result.start if result.ok and result.first_token is not None else None
        request = Request(end - (result.end - result.start), end, result.ok, str(result.status), ttft,
                          result.endpoint)
        with self._lock:
            self.requests.append(request)

    def snapshot(self) -> list[Request]:
        with self._lock:
            return list(self.requests)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]


@dataclass
class Timeline:
    started: float
    rows: list[dict] = field(default_factory=list)
    decisions: dict[tuple, dict] = field(default_factory=dict)


class Sampler:
    def __init__(self, api_client, namespace: str, name: str, requests: RequestLog, interval: float = 1.0):
        from kubernetes import client

        self.custom, self.core = client.CustomObjectsApi(api_client), client.CoreV1Api(api_client)
        self.namespace, self.name, self.requests, self.interval = namespace, name, requests, interval
        self.timeline = Timeline(time.time())
        self._counters: dict[str, deque] = {}
        self._http = httpx.Client(timeout=1.0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="timeline", daemon=True)

    def start(self) -> Sampler:
        self._thread.start()
        return self

    def stop(self) -> Timeline:
        self._stop.set()
        self._thread.join(10)
        self._http.close()
        return self.timeline

    @property
    def latest(self) -> dict | None:
        return self.timeline.rows[-1] if self.timeline.rows else None

    def _loop(self) -> None:
        next_at = time.time()
        while not self._stop.is_set():
            began = time.time()
            try:
                self.timeline.rows.append(self._row())
            except Exception as error:  # noqa: BLE001 - a missed second is a gap, not the end of the run
                self.timeline.rows.append({"t": round(time.time() - self.timeline.started, 2), "error": str(error)})
            # A row that took longer than the interval (a loaded machine) leaves a gap rather than a
            # burst of catch-up rows a fraction of a second apart.
            next_at = max(next_at + self.interval, began + self.interval)
            self._stop.wait(max(0.0, next_at - time.time()))

    def _row(self) -> dict:
        now = time.time()
        service = self.custom.get_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, self.name)
        status = service.get("status") or {}
        for record in status.get("scalingHistory") or []:
            key = (record["time"], record["action"], record.get("pod"), record.get("fromReplicas"),
                   record.get("toReplicas"), record.get("fromMaxNumSeqs"), record.get("toMaxNumSeqs"),
                   record.get("pool"))
            self.timeline.decisions.setdefault(key, record)
        pods = json.loads(self.core.list_namespaced_pod(
            self.namespace, label_selector=selector_string(self.name), _preload_content=False).data)["items"]
        # Disaggregation: the decode pool (the engine Deployment) is what replicas_* count; the
        # prefill pool's pods (role label prefill) are counted under prefill_*.
        counts = {"decode": [0, 0, 0], "prefill": [0, 0, 0]}  # ready, live, terminating
        per_pod = {}
        for pod in pods:
            meta, pod_status = pod["metadata"], pod.get("status") or {}
            is_ready = any(c["type"] == "Ready" and c["status"] == "True" for c in pod_status.get("conditions") or [])
            role = (meta.get("labels") or {}).get(ROLE_LABEL)
            pool = counts["prefill" if role == PREFILL else "decode"]
            if meta.get("deletionTimestamp"):
                pool[2] += 1
            else:
                pool[1] += 1
                pool[0] += is_ready
            entry = {"ready": is_ready, "terminating": bool(meta.get("deletionTimestamp"))}
            if role:
                entry["role"] = role
            if pod_status.get("podIP"):
                entry.update(self._scrape(meta["name"], pod_status["podIP"], now))
            per_pod[meta["name"]] = entry
        recent = [r for r in self.requests.snapshot() if r.end > now - CLIENT_WINDOW_SECONDS]
        ttfts = [r.ttft for r in recent if r.ttft is not None]
        measured = [p for p in per_pod.values() if p.get("waiting") is not None and not p["terminating"]
                    and p.get("role") != PREFILL]
        ready, live, terminating = counts["decode"]
        row = {
            "t": round(now - self.timeline.started, 2),
            "phase": self.requests.phase,
            "replicas_desired": service["spec"].get("replicas"),
            "replicas_ready": ready,
            "pods_live": live,
            "pods_terminating": terminating,
            "effective_max_num_seqs": status.get("effectiveMaxNumSeqs"),
            "waiting_total": sum(p["waiting"] for p in measured) if measured else None,
            "running_total": sum(p["running"] for p in measured) if measured else None,
            "request_rate": round(len([r for r in recent if r.ok]) / CLIENT_WINDOW_SECONDS, 3),
            "failed_in_window": len([r for r in recent if not r.ok]),
            "ttft_p95_s": percentile(ttfts, 0.95),
            "pods": per_pod,
        }
        disaggregation = service["spec"].get("disaggregation") or {}
        if disaggregation.get("enabled"):
            prefill_measured = [p for p in per_pod.values() if p.get("role") == PREFILL and not p["terminating"]
                                and p.get("queued_prompt_tokens") is not None]
            scaling = status.get("prefill") or {}
            row.update({
                "prefill_desired": (disaggregation.get("prefill") or {}).get("replicas", 1),
                "prefill_ready": counts["prefill"][0],
                "prefill_live": counts["prefill"][1],
                "prefill_terminating": counts["prefill"][2],
                "prefill_queued_prompt_tokens": (sum(p["queued_prompt_tokens"] for p in prefill_measured)
                                                 if prefill_measured else None),
                "prefill_signal_value": scaling.get("signalValue"),
                "decode_queued_prompt_tokens": (sum(p.get("queued_prompt_tokens") or 0 for p in measured)
                                                if measured else None),
            })
        return row

    def _scrape(self, pod: str, ip: str, now: float) -> dict:
        try:
            values = parse_engine_metrics(self._http.get(f"http://{ip}:{ENGINE_PORT}/metrics").text)
        except (httpx.HTTPError, MetricsFormatError) as error:
            return {"scrape_error": type(error).__name__}
        history = self._counters.setdefault(pod, deque())
        history.append((now, values["preemptions_total"]))
        while history and history[0][0] < now - PREEMPTION_WINDOW_SECONDS:
            history.popleft()
        span = history[-1][0] - history[0][0]
        rate = (history[-1][1] - history[0][1]) * 60 / span if span >= 5 else None
        return {
            "waiting": values["waiting"], "running": values["running"],
            "kv_usage": round(values["kv_usage"], 4), "preemptions_total": values["preemptions_total"],
            "preemptions_per_min": None if rate is None else round(rate, 2),
            "max_num_seqs": values["max_num_seqs"],
            "queued_prompt_tokens": values.get("queued_prompt_tokens"),
        }
