"""The Prometheus collectors behind GET /metrics. Names come from iterserve.engine.metrics only.

Scheduler state (queue depths, KV usage, the effective max_num_seqs, preemptions) is read from
the engine at scrape time, so a gauge is never stale and never missing: an idle or still-loading
server reports zeros, not NaN. Latencies and token counts are observed once per engine step on
the engine thread. Every series carries `model_name`, and each name has exactly one series (per
label set), which is what KEDA and the Gateway API Inference Extension's endpoint picker need.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from iterserve.engine import metrics as names
from iterserve.engine.llm_engine import EngineStats
from iterserve.engine.outputs import RequestOutput

# `_created` series double the output and no consumer of these metrics reads them.
disable_created_metrics()

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
REQUEST_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 60.0, 120.0, 300.0)
FINISH_REASONS = ("stop", "length", "abort", "error")
KV_TRANSFER_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
KV_TRANSFER_BYTES_BUCKETS = tuple(float(2**k) for k in range(16, 34, 2))  # 64 KiB .. 8 GiB
THROUGHPUT_WINDOW_S = 10.0


class TokenRate:
    """Generated tokens per second over a sliding window; written by the engine thread."""

    def __init__(self, window_s: float = THROUGHPUT_WINDOW_S, clock: Callable[[], float] = time.monotonic):
        self.window_s = window_s
        self.clock = clock
        self._events: deque[tuple[float, int]] = deque()
        self._lock = threading.Lock()

    def add(self, num_tokens: int) -> None:
        with self._lock:
            self._events.append((self.clock(), num_tokens))

    def per_second(self) -> float:
        cutoff = self.clock() - self.window_s
        with self._lock:
            while self._events and self._events[0][0] < cutoff:
                self._events.popleft()
            return sum(n for _, n in self._events) / self.window_s


class _Histograms:
    """A histogram under its own name and, optionally, under its vLLM alias."""

    def __init__(self, registry, model_name: str, name: str, alias: str | None, doc: str, buckets):
        self.children = [
            Histogram(metric, doc, [names.MODEL_LABEL], buckets=buckets, registry=registry).labels(model_name)
            for metric in (name, alias) if metric
        ]

    def observe(self, value: float) -> None:
        for child in self.children:
            child.observe(value)


class ServerMetrics:
    def __init__(self, model_name: str, stats: Callable[[], EngineStats | None], vllm_names: bool = True):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.throughput = TokenRate()
        alias = (lambda name: name) if vllm_names else (lambda name: None)
        h = self.registry
        self.ttft = _Histograms(h, model_name, names.TIME_TO_FIRST_TOKEN, alias(names.VLLM_TIME_TO_FIRST_TOKEN),
                                "Time from arrival to the first generated token.", TTFT_BUCKETS)
        self.itl = _Histograms(h, model_name, names.INTER_TOKEN_LATENCY, alias(names.VLLM_INTER_TOKEN_LATENCY),
                               "Time between consecutive generated tokens of a request.", ITL_BUCKETS)
        self.e2e = _Histograms(h, model_name, names.E2E_REQUEST_LATENCY, alias(names.VLLM_E2E_REQUEST_LATENCY),
                               "Time from arrival to the last token.", REQUEST_BUCKETS)
        self.queue_time = _Histograms(h, model_name, names.REQUEST_QUEUE_TIME, None,
                                      "Time from arrival to first scheduling.", REQUEST_BUCKETS)
        labels = [names.MODEL_LABEL]
        self.prompt_tokens = Counter(names.PROMPT_TOKENS_TOTAL, "Prompt tokens processed.", labels,
                                     registry=h).labels(model_name)
        self.generation_tokens = Counter(names.GENERATION_TOKENS_TOTAL, "Tokens generated.", labels,
                                         registry=h).labels(model_name)
        requests = Counter(names.REQUESTS_TOTAL, "Finished requests by reason.", [names.MODEL_LABEL, "finished_reason"],
                           registry=h)
        self.requests = {reason: requests.labels(model_name, reason) for reason in FINISH_REASONS}
        self.request_failures = Counter(names.REQUEST_FAILURES_TOTAL,
                                        "Requests finished with an error of their own; the engine carried on.",
                                        labels, registry=h).labels(model_name)
        self.engine_failures = Counter(names.ENGINE_FAILURES_TOTAL,
                                       "Times the engine loop died (GET /health then answers 503).", labels,
                                       registry=h).labels(model_name)
        self.kv_transfer_seconds = Histogram(
            names.KV_TRANSFER_SECONDS, "Decode role: time to pull one request's prompt KV from a prefill engine.",
            labels, buckets=KV_TRANSFER_SECONDS_BUCKETS, registry=h).labels(model_name)
        self.kv_transfer_bytes = Histogram(
            names.KV_TRANSFER_BYTES, "Decode role: bytes received per KV pull (frames included).", labels,
            buckets=KV_TRANSFER_BYTES_BUCKETS, registry=h).labels(model_name)
        self.registry.register(_SchedulerCollector(model_name, stats, self.throughput, vllm_names))
        self._last_token_time: dict[str, float] = {}

    def observe_step(self, outputs: list[RequestOutput]) -> None:
        """Called on the engine thread with each step's outputs."""
        generated = 0
        for out in outputs:
            m = out.metrics
            num_new = len(out.outputs[0].new_token_ids)
            if num_new:
                generated += num_new
                previous = self._last_token_time.get(out.request_id)
                if previous is None:
                    self.ttft.observe(m.first_token_time - m.arrival_time)
                    if m.first_scheduled_time is not None:
                        self.queue_time.observe(m.first_scheduled_time - m.arrival_time)
                    self.prompt_tokens.inc(len(out.prompt_token_ids))
                else:
                    self.itl.observe(m.last_token_time - previous)
                self._last_token_time[out.request_id] = m.last_token_time
            if out.finished:
                self._last_token_time.pop(out.request_id, None)
                reason = out.outputs[0].finish_reason or "abort"
                self.requests.get(reason, self.requests["abort"]).inc()
                if out.error is not None:
                    self.request_failures.inc()
                if m.finished_time is not None:
                    self.e2e.observe(m.finished_time - m.arrival_time)
        if generated:
            self.generation_tokens.inc(generated)
            self.throughput.add(generated)

    def observe_kv_transfer(self, seconds: float, num_bytes: int) -> None:
        """Called on a KV pull thread when a pull finished."""
        self.kv_transfer_seconds.observe(seconds)
        self.kv_transfer_bytes.observe(num_bytes)

    def observe_engine_failure(self, error: BaseException) -> None:
        self.engine_failures.inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _SchedulerCollector(Collector):
    def __init__(self, model_name: str, stats: Callable[[], EngineStats | None], throughput: TokenRate,
                 vllm_names: bool):
        self.model_name = model_name
        self.stats = stats
        self.throughput = throughput
        self.vllm_names = vllm_names

    def collect(self) -> Iterable[Metric]:
        s = self.stats()
        waiting, running, kv, preemptions = (
            (s.num_waiting, s.num_running, s.kv_usage, s.num_preemptions) if s else (0, 0, 0.0, 0)
        )
        label = [self.model_name]
        yield _gauge(names.WAITING_REQUESTS, "Requests waiting to be scheduled.", label, waiting)
        yield _gauge(names.RUNNING_SEQS, "Sequences in the running batch.", label, running)
        yield _gauge(names.KV_CACHE_USAGE, "Fraction of KV cache blocks running sequences hold (0..1); "
                     "cached blocks nobody holds do not count.", label, kv)
        yield _gauge(names.THROUGHPUT_TOKENS_PER_SECOND,
                     f"Generated tokens per second over the last {THROUGHPUT_WINDOW_S:g} s.", label,
                     self.throughput.per_second())
        if s is not None:
            yield _gauge(names.MAX_NUM_SEQS, "The effective cap on running sequences.", label, s.max_num_seqs)
        yield _counter(names.PREEMPTIONS_TOTAL, "Sequences preempted for lack of KV blocks.", label, preemptions)
        queries, hits = (s.prefix_cache_queries, s.prefix_cache_hits) if s else (0, 0)
        yield _counter(names.PREFIX_CACHE_QUERIES_TOTAL, "Prompt tokens looked up in the prefix cache.", label,
                       queries)
        yield _counter(names.PREFIX_CACHE_HITS_TOTAL, "Prompt tokens found in the prefix cache.", label, hits)
        yield _gauge(names.PREFIX_CACHE_HIT_RATE, "Prefix cache hit rate in tokens over the last 1000 admissions.",
                     label, s.prefix_cache_hit_rate if s else 0.0)
        yield _gauge(names.KV_CACHE_CACHED_FRACTION, "Fraction of KV cache blocks cached but held by no sequence "
                     "(free for allocation, kept for prefix reuse).", label,
                     s.num_cached_blocks / s.num_kv_blocks if s and s.num_kv_blocks else 0.0)
        yield _counter(names.KV_TRANSFER_FAILURES_TOTAL, "Decode role: KV pulls that failed (the prompt was then "
                       "recomputed, or the request failed, per --kv-failure-policy).", label,
                       s.kv_pulls_failed if s else 0)
        yield _counter(names.KV_TRANSFER_EXPIRED_TOTAL, "Prefill role: KV leases freed at expiry, never released by "
                       "a decode engine.", label, s.kv_leases_expired if s else 0)
        yield _gauge(names.KV_PINNED_BLOCKS, "Prefill role: KV blocks pinned under leases for decode engines.", label,
                     s.num_pinned_blocks if s else 0)
        yield _gauge(names.QUEUED_PROMPT_TOKENS, "Prompt tokens not computed yet, of waiting requests and of running "
                     "ones still prefilling (prompts whose KV is pulled from a prefill engine left out).", label,
                     s.queued_prompt_tokens if s else 0)
        yield _gauge(names.WAITING_FOR_KV_REQUESTS, "Decode role: requests holding blocks while their prompt KV is "
                     "pulled.", label, s.num_waiting_for_kv if s else 0)
        yield from _spec_decode_counters(s, label, own=True)
        lora = CounterMetricFamily(names.LORA_REQUESTS_TOTAL, "Requests accepted per LoRA adapter.",
                                   labels=[names.MODEL_LABEL, names.LORA_NAME_LABEL])
        for lora_name, count in s.lora_requests if s else ():
            lora.add_metric([*label, lora_name], count)
        yield lora
        if not self.vllm_names:
            return
        if s is not None and s.max_loras:
            info = GaugeMetricFamily(names.VLLM_LORA_REQUESTS_INFO, "Running stats on lora requests.",
                                     labels=[names.LORA_MAX_LABEL, names.LORA_WAITING_LABEL, names.LORA_RUNNING_LABEL])
            info.add_metric([str(s.max_loras), ",".join(s.waiting_lora_adapters), ",".join(s.running_lora_adapters)],
                            time.time())
            yield info
        yield from _spec_decode_counters(s, label, own=False)
        yield _gauge(names.VLLM_WAITING, "Requests waiting (vLLM name).", label, waiting)
        yield _gauge(names.VLLM_RUNNING, "Requests running (vLLM name).", label, running)
        yield _gauge(names.VLLM_KV_USAGE, "KV cache usage, 0..1 (vLLM name).", label, kv)
        yield _counter(names.VLLM_PREEMPTIONS_TOTAL, "Preemptions (vLLM name).", label, preemptions)
        yield _counter(names.VLLM_PREFIX_CACHE_QUERIES_TOTAL, "Prefix cache queries in tokens (vLLM name).", label,
                       queries)
        yield _counter(names.VLLM_PREFIX_CACHE_HITS_TOTAL, "Prefix cache hits in tokens (vLLM name).", label, hits)
        if s is not None:
            info = GaugeMetricFamily(names.VLLM_CACHE_CONFIG_INFO, "KV cache configuration (vLLM name).",
                                     labels=[names.MODEL_LABEL, "block_size", "num_gpu_blocks"])
            info.add_metric([self.model_name, str(s.block_size), str(s.num_kv_blocks)], 1)
            yield info


def _spec_decode_counters(s: EngineStats | None, label: list[str], own: bool) -> Iterable[Metric]:
    """Speculative decoding's counters under our names (own) or vLLM's; zeros while it is off."""
    drafts, tokens, accepted = (s.spec_num_drafts, s.spec_num_draft_tokens, s.spec_num_accepted_tokens) if s else (0,) * 3
    if own:
        names_ = (names.SPEC_DECODE_DRAFTS_TOTAL, names.SPEC_DECODE_DRAFT_TOKENS_TOTAL,
                  names.SPEC_DECODE_ACCEPTED_TOKENS_TOTAL, names.SPEC_DECODE_ACCEPTED_TOKENS_PER_POS_TOTAL)
    else:
        names_ = (names.VLLM_SPEC_DECODE_NUM_DRAFTS, names.VLLM_SPEC_DECODE_NUM_DRAFT_TOKENS,
                  names.VLLM_SPEC_DECODE_NUM_ACCEPTED_TOKENS, names.VLLM_SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS)
    yield _counter(names_[0], "Speculative decoding: verification rounds with proposed tokens.", label, drafts)
    yield _counter(names_[1], "Speculative decoding: proposed tokens.", label, tokens)
    yield _counter(names_[2], "Speculative decoding: accepted proposed tokens.", label, accepted)
    per_pos = CounterMetricFamily(names_[3], "Speculative decoding: accepted tokens by proposal position.",
                                  labels=[names.MODEL_LABEL, names.SPEC_DECODE_POSITION_LABEL])
    for position, count in enumerate(s.spec_accepted_per_pos if s else ()):
        per_pos.add_metric([*label, str(position)], count)
    yield per_pos


def _gauge(name: str, doc: str, label: list[str], value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=[names.MODEL_LABEL])
    family.add_metric(label, value)
    return family


def _counter(name: str, doc: str, label: list[str], value: float) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=[names.MODEL_LABEL])
    family.add_metric(label, value)
    return family
