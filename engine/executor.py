"""The seam between scheduling and computing: an executor takes one step's scheduled chunks
(a flat batch of prefill chunks and decode tokens, with block tables) and returns one sampled
token per chunk that reached its sequence's end (None for a mid-prompt chunk).

Two executors implement it: the model runner (engine/model_runner.py) and the fake model
(engine/fake_executor.py), which needs no weights.
"""

from __future__ import annotations

from typing import Any, Protocol

from iterserve.engine.config import EngineConfig
from iterserve.engine.fake_executor import FAKE_MODEL, fake_model
from iterserve.engine.scheduler import SchedulerOutput
from iterserve.engine.step_result import StepToken


class Executor(Protocol):
    num_kv_blocks: int
    num_cpu_blocks: int

    def execute(self, out: SchedulerOutput) -> list[StepToken]:
        """Apply the step's block swaps, run the batch, return per chunk a sampled token, None (a
        mid-prompt chunk) or RequestFailed (that request's own part failed; see step_result)."""

    def release(self, request_ids: list[str]) -> None:
        """Forget per-request state (random generators) of finished requests."""


def load_executor(config: EngineConfig) -> tuple[Executor, Any, str, EngineConfig]:
    """The executor for config.model (the model runner, or the fake model), with its tokenizer,
    the model's name and the config resolved against the model (the only place it is resolved)."""
    if config.model == FAKE_MODEL:
        config = config.resolve()
        executor, tokenizer = fake_model(config)
        config.check_kv_capacity(executor.num_kv_blocks, executor.num_cpu_blocks)
        return executor, tokenizer, FAKE_MODEL, config
    from iterserve.engine.model_runner import ModelRunner

    runner = ModelRunner(config)
    return runner, runner.tokenizer, runner.model_name, runner.config
