"""KV transfer is an optional executor capability declared on the interface (KVTransferCapable):
the engine builds a KV connector for an executor that declares it, and none for one that does not,
even if it happens to have methods of the same names."""

from __future__ import annotations

import pytest

from iterserve.engine.config import ConfigError, EngineConfig
from iterserve.engine.executor import kv_transfer_of
from iterserve.engine.fake_executor import FakeExecutor, FakeTokenizer
from iterserve.engine.llm_engine import LLMEngine


class PlainExecutor:
    """Steps only: no declared KV transfer, though it has a method named like one."""

    num_kv_blocks, num_cpu_blocks = 32, 0

    def execute(self, out):
        return [0 if chunk.sample else None for chunk in out.chunks]

    def release(self, request_ids):
        pass

    def kv_layout(self):  # a name alone declares nothing
        raise AssertionError("the engine probed an undeclared capability")


def _engine(executor) -> LLMEngine:
    config = EngineConfig(model="fake", max_model_len=128).resolve()
    return LLMEngine(config, executor, FakeTokenizer())


def test_an_executor_that_declares_kv_transfer_gets_a_connector():
    executor = FakeExecutor(32)
    assert kv_transfer_of(executor) is executor
    assert _engine(executor).kv_connector is not None


def test_an_executor_without_the_declaration_gets_none_and_no_kv_listener():
    engine = _engine(PlainExecutor())
    assert kv_transfer_of(engine.executor) is None and engine.kv_connector is None
    engine.config = EngineConfig(model="fake", max_model_len=128, role="prefill", kv_auth_key_file="/k").resolve()
    with pytest.raises(ConfigError, match="cannot transfer KV"):
        engine.start_kv_transfer()
