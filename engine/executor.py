"""The seam between scheduling and computing: an executor takes one step's scheduled chunks
(a flat batch of prefill chunks and decode tokens, with block tables) and returns one sampled
token per chunk that reached its sequence's end (None for a mid-prompt chunk).

Two executors implement it: the model runner (engine/model_runner.py) and the fake model
(engine/fake_executor.py), which needs no weights. Moving KV between engines (P/D disaggregation,
engine/kv_transfer) is an optional capability: an executor that has it subclasses KVTransferCapable,
and the engine builds a KV connector for that executor only.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from iterserve.engine.config import ConfigError, EngineConfig
from iterserve.engine.kv_transfer.layout import KVLayout
from iterserve.engine.kv_transfer.transport import KVTransport
from iterserve.engine.scheduler import SchedulerOutput
from iterserve.engine.step_result import StepToken


class Executor(Protocol):
    num_kv_blocks: int
    num_cpu_blocks: int
    # Structured outputs' compiled grammars over the model's vocabulary; None where there is no real
    # vocabulary (the fake model), and the server then refuses structured outputs.
    grammars: Any | None
    # engine/lora's LoraManager when the engine serves LoRA adapters (--enable-lora), else None.
    lora: Any | None

    def execute(self, out: SchedulerOutput) -> list[StepToken]:
        """Apply the step's block swaps, run the batch, return per chunk a sampled token, None (a
        mid-prompt chunk) or RequestFailed (that request's own part failed; see step_result)."""

    def release(self, request_ids: list[str]) -> None:
        """Forget per-request state (random generators) of finished requests."""


class KVTransferCapable(ABC):
    """The optional capability of an executor whose KV pool other engines can read and write into:
    a prefill engine serves its blocks (read_kv), a decode engine loads pulled blocks at a step's start
    (SchedulerOutput.kv_loads, in execute)."""

    @abstractmethod
    def kv_layout(self) -> KVLayout:
        """The pool's shape and dtype: two engines exchange KV only when theirs match."""

    @abstractmethod
    def read_kv(self, block_ids: list[int]) -> Iterator[tuple[memoryview, memoryview]]:
        """Per layer, (K bytes, V bytes) of these blocks; runs on a KV transfer thread, reading only
        blocks a lease pins (no step writes into them)."""

    @abstractmethod
    def enable_kv_store(self) -> None:
        """Called once before a KV transfer listener opens: keep whatever read_kv needs."""

    def kv_transport(self, clock: Callable[[], float]) -> KVTransport | None:
        """The transport for the engine's connector; None: one process's TcpTransport. A tensor-parallel
        executor's reaches its other ranks' shards (engine/kv_transfer/sharded.py)."""
        return None


def kv_transfer_of(executor: Executor) -> KVTransferCapable | None:
    """The executor as a KV transfer endpoint, or None when it declares no such capability."""
    return executor if isinstance(executor, KVTransferCapable) else None


def load_executor(config: EngineConfig) -> tuple[Executor, Any, str, EngineConfig]:
    """The executor for config.model (the model runner, or the fake model), with its tokenizer,
    the model's name and the config resolved against the model (the only place it is resolved)."""
    # Here, not at the top: the fake executor subclasses KVTransferCapable, defined above.
    from iterserve.engine.fake_executor import FAKE_MODEL, fake_model

    if config.model == FAKE_MODEL:
        if config.tensor_parallel_size * config.pipeline_parallel_size > 1:
            raise ConfigError(f"--tensor-parallel-size {config.tensor_parallel_size} / --pipeline-parallel-size "
                              f"{config.pipeline_parallel_size} needs a real model; the fake model has no weights to "
                              "split")
        config = config.resolve()
        executor, tokenizer = fake_model(config)
        config.check_kv_capacity(executor.num_kv_blocks, executor.num_cpu_blocks)
        return executor, tokenizer, FAKE_MODEL, config
    if config.tensor_parallel_size * config.pipeline_parallel_size > 1:  # one process per rank (engine/distributed/tensor_parallel.py)
        from iterserve.engine.distributed.tensor_parallel import TensorParallelRunner

        runner = TensorParallelRunner(config)
        return runner, runner.tokenizer, runner.model_name, runner.config
    from iterserve.engine.model_runner import ModelRunner

    runner = ModelRunner(config)
    return runner, runner.tokenizer, runner.model_name, runner.config
