"""Builders for engines that run the real scheduler with the fake executor."""

from __future__ import annotations

from iterserve.engine.config import EngineConfig
from iterserve.engine.fake_executor import FakeExecutor, FakeTokenizer
from iterserve.engine.llm_engine import LLMEngine


class ManualClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def fake_engine(num_blocks: int = 64, num_cpu_blocks: int = 64, **options) -> LLMEngine:
    options.setdefault("max_model_len", 256)
    config = EngineConfig(model="fake", **options).resolve()
    config.check_kv_capacity(num_blocks, num_cpu_blocks)
    return LLMEngine(config, FakeExecutor(num_blocks, num_cpu_blocks), FakeTokenizer(), ManualClock())


def run_to_completion(engine: LLMEngine, max_steps: int = 100_000) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return tokens
        for output in engine.step():
            if output.finished:
                tokens[output.request_id] = output.outputs[0].token_ids
    raise AssertionError("engine did not finish")
