"""The prefill pool's scaling signal: an engine's queued prompt tokens, i.e. prompt
tokens not computed yet of waiting requests and of running ones still prefilling, on the real
scheduler (fake executor) and exported on /metrics; the real embedded model counts the same way."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from iterserve.engine import metrics as names
from iterserve.engine.sampling_params import SamplingParams
from iterserve.engine.server.metrics import ServerMetrics
from tests.unit.engine_helpers import fake_engine, run_to_completion

GREEDY = SamplingParams(temperature=0.0, max_tokens=4)


def _gauge(engine) -> float:
    text = ServerMetrics("m", engine.stats).exposition().decode()
    return next(s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == names.QUEUED_PROMPT_TOKENS)


def test_queued_prompt_tokens_follow_chunked_prefill_down_to_zero():
    engine = fake_engine(max_num_seqs=8, max_num_batched_tokens=16)
    assert engine.stats().queued_prompt_tokens == 0 and _gauge(engine) == 0
    engine.add_request(prompt_token_ids=[98] * 40, params=GREEDY, request_id="long")
    engine.add_request(prompt_token_ids=[97] * 10, params=GREEDY, request_id="short")
    assert engine.stats().queued_prompt_tokens == 50  # still in the inbox: counted
    assert _gauge(engine) == 50
    engine.step()  # 16 of the long prompt
    assert engine.stats().queued_prompt_tokens == 34
    engine.step()  # 16 more
    assert engine.stats().queued_prompt_tokens == 18
    engine.step()  # the long one's last 8 and the short prompt's first 8
    assert engine.stats().queued_prompt_tokens == 2
    engine.step()  # a decode token for "long", the short prompt's last 2: nothing left to prefill
    assert engine.stats().queued_prompt_tokens == 0 and _gauge(engine) == 0
    # Decoding sequences queue no prompt tokens, whatever they have generated.
    assert engine.stats().num_running == 2
    run_to_completion(engine)
    assert engine.stats().queued_prompt_tokens == 0


def test_waiting_requests_beyond_max_num_seqs_count_whole():
    engine = fake_engine(max_num_seqs=1, max_num_batched_tokens=64)
    for i in range(3):
        engine.add_request(prompt_token_ids=[97 + i] * 20, params=GREEDY, request_id=f"r{i}")
    engine.step()
    engine.step()  # r0 prefilled (in chunks of at most 16), decoding; r1, r2 wait for the one slot
    assert engine.stats().num_waiting == 2 and engine.stats().num_running == 1
    assert engine.stats().queued_prompt_tokens == 40


@pytest.mark.slow
def test_the_embedded_model_engine_exports_the_same_count():
    from iterserve.engine.config import EngineConfig
    from iterserve.engine.llm_engine import LLMEngine

    engine = LLMEngine.from_config(EngineConfig(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=16,
                                                device="cpu"))
    try:
        prompt = engine.tokenizer.encode("The capital of France is a city that many people visit every year, "
                                          "because its museums, parks and old streets are famous all over the world")
        engine.add_request(prompt_token_ids=prompt, params=GREEDY, request_id="a")
        assert _gauge(engine) == len(prompt) > 16
        engine.step()
        assert engine.stats().queued_prompt_tokens == len(prompt) - 16
        outputs = run_to_completion(engine)
        assert len(outputs["a"]) == 4 and _gauge(engine) == 0
    finally:
        close = getattr(engine, "close", None)
        if close:
            close()
