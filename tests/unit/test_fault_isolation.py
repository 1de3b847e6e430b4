"""One request's fault finishes that request alone: the engine frees its KV and carries
on; requests that can never be admitted are refused on arrival."""

from __future__ import annotations

import pytest

from iterserve.engine.config import ConfigError, EngineConfig
from iterserve.engine.fake_executor import FakeExecutor, FakeTokenizer
from iterserve.engine.llm_engine import LLMEngine
from iterserve.engine.sampling_params import InvalidRequestError, SamplingParams
from iterserve.engine.step_result import RequestFailed
from tests.unit.engine_helpers import ManualClock, fake_engine

PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def prompts() -> dict[str, list[int]]:
    return {f"r{i}": [97 + (i * 7 + j) % 26 for j in range(5 + 3 * i)] for i in range(6)}


def run(engine: LLMEngine, requests: dict[str, list[int]]) -> dict[str, tuple[str, list[int], str | None]]:
    for request_id, prompt in requests.items():
        engine.add_request(prompt_token_ids=prompt, params=PARAMS, request_id=request_id)
    results = {}
    for _ in range(1000):
        if not engine.has_unfinished_requests():
            return results
        for out in engine.step():
            if out.finished:
                results[out.request_id] = (out.outputs[0].finish_reason, out.outputs[0].token_ids, out.error)
    raise AssertionError("engine did not finish")


class FailingExecutor(FakeExecutor):
    """Sampling fails for one request, on its fourth token (mid-stream, with KV blocks held)."""

    def __init__(self, *args, bad: str = "r2", **kwargs):
        super().__init__(*args, **kwargs)
        self.bad = bad

    def execute(self, out):
        tokens = super().execute(out)
        return [RequestFailed("sampling failed: boom")
                if c.seq.request_id == self.bad and t is not None and len(c.seq.output_token_ids) == 3 else t
                for c, t in zip(out.chunks, tokens, strict=True)]


class FailingTokenizer(FakeTokenizer):
    """Detokenizing fails once, on the 20th call (whichever request that is)."""

    calls = 0

    def decode(self, token_ids, skip_special_tokens=True):
        self.calls += 1
        if self.calls == 20:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
        return super().decode(token_ids, skip_special_tokens)


def engine_with(executor=None, tokenizer=None) -> LLMEngine:
    config = EngineConfig(model="fake", max_model_len=128, max_num_batched_tokens=64).resolve()
    return LLMEngine(config, executor or FakeExecutor(64, 0), tokenizer or FakeTokenizer(), ManualClock())


def test_a_sampling_failure_finishes_only_its_request():
    reference = run(engine_with(), prompts())
    engine = engine_with(FailingExecutor(64, 0, bad="r2"))
    results = run(engine, prompts())
    reason, tokens, error = results["r2"]
    assert reason == "error" and "boom" in error and len(tokens) == 3
    assert {r: v for r, v in results.items() if r != "r2"} == {r: v for r, v in reference.items() if r != "r2"}
    assert all(reason == "length" for r, (reason, _, _) in results.items() if r != "r2")
    assert engine.block_manager.usage() == 0.0 and not engine._sequences and not engine._errors
    assert engine.num_request_failures == 1
    # The engine carries on: the same prompt is served again.
    again = run(engine, {"again": prompts()["r2"]})
    assert again["again"][0] == "length" and again["again"][1] == reference["r2"][1]


def test_a_detokenizing_failure_finishes_only_its_request():
    reference = run(engine_with(), prompts())
    engine = engine_with(tokenizer=FailingTokenizer())
    results = run(engine, prompts())
    failed = [r for r, v in results.items() if v[0] == "error"]
    assert len(failed) == 1 and "UnicodeDecodeError" in results[failed[0]][2]
    assert {r: v for r, v in results.items() if r not in failed} == {
        r: v for r, v in reference.items() if r not in failed}
    assert engine.block_manager.usage() == 0.0


def test_without_chunked_prefill_a_prompt_the_pool_cannot_hold_is_refused_on_arrival():
    config = EngineConfig(model="fake", max_model_len=256, chunked_prefill=False, watermark=0.1).resolve()
    # 14 blocks of 16, one of them the watermark: 13 blocks = 208 tokens can be admitted. Before, a
    # 210-token prompt sat at the head of the queue forever, and the engine thread spun.
    engine = LLMEngine(config, FakeExecutor(14, 0), FakeTokenizer(), ManualClock())
    with pytest.raises(InvalidRequestError, match="KV cache can admit at most 208") as err:
        engine.add_request(prompt_token_ids=[97] * 210, params=PARAMS)
    assert err.value.param == "prompt"
    assert not engine.has_unfinished_requests()
    engine.add_request(prompt_token_ids=[97] * 200, params=PARAMS)  # fits beside the watermark
    assert list(run(engine, {})) == ["req-0"] and engine.block_manager.usage() == 0.0


def test_start_up_capacity_check_counts_the_watermark():
    config = EngineConfig(model="fake", max_model_len=256, watermark=0.1).resolve()
    config.check_kv_capacity(18, 0)  # 18 blocks, 1 kept free: 272 tokens usable
    with pytest.raises(ConfigError, match="watermark"):
        config.check_kv_capacity(16, 0)  # 256 tokens, but 1 block is the watermark
    fake_engine(num_blocks=16, max_model_len=256)  # the default 1% watermark of 16 blocks is 0 blocks


def test_stop_token_ids_are_checked_through_a_set():
    params = SamplingParams(stop_token_ids=list(range(1000)))
    assert isinstance(params.stop_token_set, frozenset) and len(params.stop_token_set) == 1000
    with pytest.raises(InvalidRequestError, match="at most 1024") as err:
        SamplingParams(stop_token_ids=list(range(200_000)))
    assert err.value.param == "stop_token_ids"
