"""Step outputs -> Prometheus series: which latency each output records, and the sliding rate."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from iterserve.engine import metrics as names
from iterserve.engine.llm_engine import EngineStats
from iterserve.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from iterserve.engine.server.metrics import ServerMetrics, TokenRate


def _output(request_id: str, metrics: RequestMetrics, new_tokens: int, finish_reason: str | None = None):
    completion = CompletionOutput(0, "", [], finish_reason, new_token_ids=[7] * new_tokens)
    return RequestOutput(request_id, None, [1, 2, 3], [completion], finish_reason is not None, metrics)


def _samples(metrics: ServerMetrics) -> dict[str, float]:
    families = text_string_to_metric_families(metrics.exposition().decode())
    return {s.name + str(sorted(s.labels.items())): s.value for f in families for s in f.samples
            if "bucket" not in s.name}


def test_first_token_records_ttft_and_queue_time_later_tokens_record_itl():
    stats = EngineStats(num_waiting=3, num_running=2, num_swapped=0, kv_usage=0.25, num_preemptions=4,
                        max_num_seqs=8, num_kv_blocks=100, block_size=16, num_steps=9)
    metrics = ServerMetrics("m", lambda: stats)
    timing = RequestMetrics(arrival_time=10.0, first_scheduled_time=10.5, first_token_time=11.0, last_token_time=11.0)
    metrics.observe_step([_output("a", timing, 1)])
    timing.last_token_time = 11.25
    metrics.observe_step([_output("a", timing, 1)])
    timing.last_token_time, timing.finished_time = 11.75, 11.75
    metrics.observe_step([_output("a", timing, 1, "stop")])

    s = _samples(metrics)
    label = "[('model_name', 'm')]"
    assert s[f"{names.TIME_TO_FIRST_TOKEN}_sum{label}"] == 1.0
    assert s[f"{names.VLLM_TIME_TO_FIRST_TOKEN}_sum{label}"] == 1.0
    assert s[f"{names.REQUEST_QUEUE_TIME}_sum{label}"] == 0.5
    assert s[f"{names.INTER_TOKEN_LATENCY}_count{label}"] == 2
    assert s[f"{names.INTER_TOKEN_LATENCY}_sum{label}"] == 0.75
    assert s[f"{names.E2E_REQUEST_LATENCY}_sum{label}"] == 1.75
    assert s[f"{names.PROMPT_TOKENS_TOTAL}{label}"] == 3 and s[f"{names.GENERATION_TOKENS_TOTAL}{label}"] == 3
    assert s[f"{names.REQUESTS_TOTAL}[('finished_reason', 'stop'), ('model_name', 'm')]"] == 1
    assert s[f"{names.WAITING_REQUESTS}{label}"] == 3 and s[f"{names.VLLM_RUNNING}{label}"] == 2
    assert s[f"{names.PREEMPTIONS_TOTAL}{label}"] == 4 and s[f"{names.VLLM_KV_USAGE}{label}"] == 0.25
    assert s[f"{names.MAX_NUM_SEQS}{label}"] == 8


def test_without_vllm_names_only_the_own_names_are_exported():
    metrics = ServerMetrics("m", lambda: None, vllm_names=False)
    text = metrics.exposition().decode()
    assert "vllm:" not in text
    assert f'{names.WAITING_REQUESTS}{{model_name="m"}} 0.0' in text  # zeros, not missing, before loading


def test_token_rate_is_a_sliding_window():
    now = [0.0]
    rate = TokenRate(window_s=10.0, clock=lambda: now[0])
    rate.add(50)
    now[0] = 5.0
    rate.add(30)
    assert rate.per_second() == 8.0
    now[0] = 12.0
    assert rate.per_second() == 3.0
    now[0] = 30.0
    assert rate.per_second() == 0.0
