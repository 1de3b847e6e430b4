"""Where the autoscaler's samples come from: each engine pod's own /metrics (the default, needs
nothing else), or a Prometheus server's HTTP API. Both return one PodSample per pod, with `error`
set instead of raising, so one unreadable pod (or a missing Prometheus) is reported, never fatal.

Metric names come from engine/metrics.py only: a renamed metric shows up as an error naming
the missing metric, not as a silent zero.

A pod's /metrics is the tenant's to write: each scrape is capped in bytes and bounded by one
total deadline (bounded_http.py), so a huge or trickled body costs one error, not the operator.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from iterserve.engine import metrics as names
from iterserve.operator.autoscaling.bounded_http import (
    METRICS_MAX_BYTES,
    BoundedReadError,
    bounded_request,
)
from iterserve.operator.autoscaling.policy import REQUIRED_SIGNALS, PodSample


@dataclass(frozen=True)
class PodEndpoint:
    name: str
    url: str  # the engine's base URL, e.g. http://10.1.2.3:8000


# PodSample field -> the engine metric, then the vLLM alias read when the first is absent
# (lets the autoscaler drive engines that only speak vLLM's names). max_num_seqs has no alias.
FIELDS: dict[str, tuple[str, ...]] = {
    "waiting": (names.WAITING_REQUESTS, names.VLLM_WAITING),
    "running": (names.RUNNING_SEQS, names.VLLM_RUNNING),
    "kv_usage": (names.KV_CACHE_USAGE, names.VLLM_KV_USAGE),
    "preemptions_total": (names.PREEMPTIONS_TOTAL, names.VLLM_PREEMPTIONS_TOTAL),
    "max_num_seqs": (names.MAX_NUM_SEQS,),
    # Optional: the average prompt (spec.disaggregation's DisaggregationIneffective condition).
    "prompt_tokens_total": (names.PROMPT_TOKENS_TOTAL,),
    "requests_total": (names.REQUESTS_TOTAL,),
    # Optional: SLO mode's workload (output lengths; with the two above, prompt lengths and arrivals).
    "generation_tokens_total": (names.GENERATION_TOKENS_TOTAL,),
    # Optional: the prefill pool's signals (spec.disaggregation.prefill.scalingSignal).
    "queued_prompt_tokens": (names.QUEUED_PROMPT_TOKENS,),
}
# The TTFT histogram, read as cumulative buckets (PodSample.ttft_buckets); vLLM's name as the alias.
TTFT_HISTOGRAMS = (names.TIME_TO_FIRST_TOKEN, names.VLLM_TIME_TO_FIRST_TOKEN)
ITL_HISTOGRAMS = (names.INTER_TOKEN_LATENCY, names.VLLM_INTER_TOKEN_LATENCY)  # SLO mode's measured ITL
HISTOGRAMS = {"ttft_buckets": TTFT_HISTOGRAMS, "itl_buckets": ITL_HISTOGRAMS}
REQUIRED = REQUIRED_SIGNALS


class MetricsFormatError(ValueError):
    pass


def parse_engine_metrics(text: str) -> dict[str, float | None]:
    """The autoscaler's signals from Prometheus text format (series of one name are summed)."""
    totals: dict[str, float] = {}
    buckets: dict[str, dict[float, float]] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
                if sample.name.endswith("_bucket") and "le" in sample.labels:
                    by_bound = buckets.setdefault(sample.name[: -len("_bucket")], {})
                    bound = float(sample.labels["le"])
                    by_bound[bound] = by_bound.get(bound, 0.0) + sample.value
    except ValueError as error:
        raise MetricsFormatError(f"unparsable /metrics: {error}") from None
    values: dict[str, float | None] = {}
    for field, candidates in FIELDS.items():
        values[field] = next((totals[n] for n in candidates if n in totals), None)
    for field, candidates in HISTOGRAMS.items():
        found = next((buckets[n] for n in candidates if n in buckets), None)
        values[field] = tuple(sorted(found.items())) if found else None
    missing = [FIELDS[f][0] for f in REQUIRED if values[f] is None]
    if missing:
        raise MetricsFormatError(f"metric {', '.join(missing)} not exported (renamed, or not an iterserve/vLLM engine?)")
    nans = [FIELDS[f][0] for f in REQUIRED if math.isnan(values[f])]
    if nans:
        raise MetricsFormatError(f"metric {', '.join(nans)} is NaN")
    return values


# A Prometheus answer grows with the number of pods and histogram buckets; the server is the
# operator admin's, so its cap is only there to keep a misbehaving one from OOM-killing us.
PROMETHEUS_MAX_BYTES = 32 * 1024 * 1024


def _describe(error: Exception) -> str:
    if isinstance(error, BoundedReadError):
        return str(error)
    if isinstance(error, httpx.TimeoutException):
        return f"timeout ({type(error).__name__})"
    if isinstance(error, httpx.HTTPStatusError):
        return f"HTTP {error.response.status_code}"
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


class ScrapeSource:
    """Reads every pod's /metrics directly and concurrently; `timeout` is each scrape's total
    deadline (connect, head and body together), `max_bytes` its body cap."""

    def __init__(self, timeout: float = 2.0, clock: Callable[[], float] = time.time,
                 max_bytes: int = METRICS_MAX_BYTES):
        self.timeout = timeout
        self.clock = clock
        self.max_bytes = max_bytes

    async def read(self, pods: Sequence[PodEndpoint]) -> list[PodSample]:
        async with httpx.AsyncClient(timeout=self.timeout) as client:
            return list(await asyncio.gather(*(self._read_one(client, pod) for pod in pods)))

    async def _read_one(self, client: httpx.AsyncClient, pod: PodEndpoint) -> PodSample:
        url = f"{pod.url.rstrip('/')}/metrics"
        try:
            answer = await bounded_request(client, "GET", url, max_bytes=self.max_bytes, deadline_s=self.timeout)
            if answer.status != 200:
                raise MetricsFormatError(f"HTTP {answer.status}")
            values = parse_engine_metrics(answer.text())
        except (BoundedReadError, MetricsFormatError) as error:
            return PodSample(pod.name, self.clock(), error=f"{pod.url}/metrics: {error}")
        return PodSample(pod.name, self.clock(), **values)


class PrometheusSource:
    """Reads the same signals from a Prometheus server with instant PromQL queries.

    `selector` narrows the series (e.g. `namespace="prod"`); `pod_label` is the label that
    carries the pod name (what Kubernetes service discovery relabels to, usually `pod`).
    """

    def __init__(self, url: str, selector: str = "", pod_label: str = "pod", timeout: float = 5.0,
                 clock: Callable[[], float] = time.time):
        self.url = url.rstrip("/")
        self.selector = selector
        self.pod_label = pod_label
        self.timeout = timeout
        self.clock = clock

    def _matchers(self, pods: Sequence[PodEndpoint]) -> str:
        alternatives = "|".join(_regex_escape(p.name) for p in pods)
        parts = [self.selector] if self.selector else []
        parts.append(f'{self.pod_label}=~"{alternatives}"')
        return ",".join(parts)

    def queries(self, pods: Sequence[PodEndpoint]) -> dict[str, str]:
        matchers = self._matchers(pods)
        out = {field: f"sum by ({self.pod_label}) ({candidates[0]}{{{matchers}}})"
               for field, candidates in FIELDS.items()}
        out["up"] = f"max by ({self.pod_label}) (up{{{matchers}}})"
        for field, candidates in HISTOGRAMS.items():
            out[field] = f"sum by ({self.pod_label}, le) ({candidates[0]}_bucket{{{matchers}}})"
        return out

    async def read(self, pods: Sequence[PodEndpoint]) -> list[PodSample]:
        if not pods:
            return []
        queries = self.queries(pods)
        try:
            async with httpx.AsyncClient(timeout=self.timeout) as client:
                results = await asyncio.gather(*(self._query(client, q, by_le=field in HISTOGRAMS)
                                                 for field, q in queries.items()))
        except (httpx.HTTPError, MetricsFormatError) as error:
            reason = f"Prometheus at {self.url} unreachable or failing: {_describe(error)}"
            now = self.clock()
            return [PodSample(p.name, now, error=reason) for p in pods]
        by_field = dict(zip(queries, results, strict=True))
        now = self.clock()
        return [self._sample(pod, by_field, now) for pod in pods]

    async def _query(self, client: httpx.AsyncClient, query: str, by_le: bool = False) -> dict:
        try:
            answer = await bounded_request(client, "GET", f"{self.url}/api/v1/query", params={"query": query},
                                           max_bytes=PROMETHEUS_MAX_BYTES, deadline_s=self.timeout)
        except BoundedReadError as error:
            raise MetricsFormatError(f"{self.url}/api/v1/query: {error}") from None
        try:
            body = json.loads(answer.body) if answer.content_type.startswith("application/json") else {}
        except ValueError:
            body = {}
        if answer.status != 200 or not isinstance(body, dict) or body.get("status") != "success":
            raise MetricsFormatError(f"query {query!r} failed: HTTP {answer.status} {body.get('error', '')}")
        if by_le:  # pod -> its (le, count) pairs, sorted
            by_pod: dict[str, dict[float, float]] = {}
            for item in body["data"]["result"]:
                by_pod.setdefault(item["metric"].get(self.pod_label, ""), {})[float(item["metric"]["le"])] = \
                    float(item["value"][1])
            return {pod: tuple(sorted(b.items())) for pod, b in by_pod.items()}
        return {item["metric"].get(self.pod_label, ""): float(item["value"][1]) for item in body["data"]["result"]}

    def _sample(self, pod: PodEndpoint, by_field: dict[str, dict[str, float]], now: float) -> PodSample:
        up = by_field["up"].get(pod.name)
        if up is not None and up < 1:
            return PodSample(pod.name, now, error="Prometheus cannot scrape this pod (up == 0)")
        values = {field: by_field[field].get(pod.name) for field in (*FIELDS, *HISTOGRAMS)}
        missing = [FIELDS[f][0] for f in REQUIRED if values[f] is None]
        if missing:
            return PodSample(pod.name, now, error=f"Prometheus has no series {', '.join(missing)} for "
                                                  f"{self.pod_label}={pod.name}")
        nans = [FIELDS[f][0] for f in REQUIRED if math.isnan(values[f])]
        if nans:
            return PodSample(pod.name, now, error=f"{', '.join(nans)} is NaN in Prometheus")
        return PodSample(pod.name, now, **values)


def _regex_escape(value: str) -> str:
    """Pod names are DNS labels; escape the regex characters that may still appear."""
    return "".join("\\\\" + c if c in ".+*?()[]{}|^$\\" else c for c in value)
