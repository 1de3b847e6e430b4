"""The fake model: an executor and a tokenizer that need no weights.

Its tokens depend only on the sequence's own tokens, so the real scheduler can run in tests,
routers and simulators at any speed, with a modelled step time (`--fake-model` serves it). Its KV
pool is sized as SmolLM2-135M's would be.
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass

from iterserve.engine.config import EngineConfig, kv_pool_blocks
from iterserve.engine.executor import KVTransferCapable
from iterserve.engine.kv_transfer.layout import KVLayout
from iterserve.engine.scheduler import SchedulerOutput
from iterserve.engine.step_result import RequestFailed

FAKE_MODEL = "fake"
# KV bytes per token of SmolLM2-135M in fp32 (30 layers x K,V x 3 heads x 64 dims x 4 bytes).
FAKE_KV_BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 4


@dataclass(frozen=True)
class LinearStepTime:
    """Step duration = base + per prefill token + per decode token + per sequence (seconds)."""

    base_s: float = 0.0
    per_prefill_token_s: float = 0.0
    per_decode_token_s: float = 0.0
    per_seq_s: float = 0.0

    def __call__(self, out: SchedulerOutput) -> float:
        return (
            self.base_s
            + self.per_prefill_token_s * out.num_prefill_tokens
            + self.per_decode_token_s * out.num_decode_tokens
            + self.per_seq_s * len(out.chunks)
        )


FAKE_ALPHABET = b"abcdefghijklmnopqrstuvwxyz     "


class FakeTokenizer:
    """Bytes as tokens: id = byte value. EOS is 256, which FakeExecutor never emits."""

    eos_token_id = 256
    bos_token_id = None
    vocab_size = 257
    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(t for t in token_ids if t < 256).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        lines = [f"{m['role']}: {m['content']}" for m in messages]
        return "\n".join(lines) + ("\nassistant: " if add_generation_prompt else "")


class FakeExecutor(KVTransferCapable):
    grammars = None  # no real vocabulary: no structured outputs
    lora = None  # no weights to adapt

    def __init__(
        self,
        num_kv_blocks: int,
        num_cpu_blocks: int = 0,
        step_time: Callable[[SchedulerOutput], float] | None = None,
        sleep: Callable[[float], None] = time.sleep,
        block_size: int = 16,
    ):
        self.num_kv_blocks = num_kv_blocks
        self.num_cpu_blocks = num_cpu_blocks
        self.step_time = step_time
        self.sleep = sleep
        self.steps = 0
        self.block_size = block_size
        # KV transfer: the fake "KV" of a slot is the token id computed there, kept only once a KV
        # transfer listener asks for it (enable_kv_store), so transfers move checkable bytes.
        self._kv: array | None = None

    def execute(self, out: SchedulerOutput) -> list[int | None]:
        self.steps += 1
        failed = self._load_kv(out.kv_loads) if out.kv_loads else set()
        if self.step_time is not None:
            duration = self.step_time(out)
            if duration > 0:
                self.sleep(duration)
        if self._kv is not None:
            self._store(out)
        return [RequestFailed("the pulled KV does not match the prompt") if chunk.seq in failed
                else self.verify(chunk.seq) if chunk.num_spec
                else self.token_after(chunk.seq.last_token_id, chunk.seq.num_tokens) if chunk.sample else None
                for chunk in out.chunks]

    def verify(self, seq) -> list[int]:
        """Speculative decoding (greedy): the proposals the fake model agrees with, then its own token."""
        tokens, last, position = [], seq.last_token_id, seq.num_tokens
        for proposed in seq.spec_token_ids:
            expected = self.token_after(last, position)
            tokens.append(expected)
            if expected != proposed:
                return tokens
            last, position = proposed, position + 1
        return [*tokens, self.token_after(last, position)]

    # -- KV transfer ---------------------------------------------------------------------------
    def kv_layout(self) -> KVLayout:
        return KVLayout(model="fake", dtype="int32", num_layers=1, num_kv_heads=1, head_size=1,
                        block_size=self.block_size, itemsize=4)

    def enable_kv_store(self) -> None:
        if self._kv is None:
            self._kv = array("i", bytes(4 * self.num_kv_blocks * self.block_size))

    def _store(self, out: SchedulerOutput) -> None:
        size = self.block_size
        for chunk in out.chunks:
            seq = chunk.seq
            tokens = seq.token_slice(chunk.start, chunk.start + chunk.num_tokens)
            for position, token in enumerate(tokens, chunk.start):
                self._kv[seq.block_table[position // size] * size + position % size] = token

    def read_kv(self, block_ids: list[int]):
        size = self.block_size
        keys = array("i")
        for block in block_ids:
            keys.extend(self._kv[block * size : (block + 1) * size])
        yield memoryview(keys.tobytes()), memoryview(keys.tobytes())

    def _load_kv(self, loads) -> set:
        """Check the pulled tokens against each sequence's prompt (the fake KV is the token ids)."""
        failed = set()
        size = self.block_size
        for load in loads:
            keys = array("i", bytes(load.layers[0][: len(load.layers[0]) // 2]))
            prompt = load.seq.prompt_token_ids[load.first_block * size :]
            if list(keys[: len(prompt)]) != prompt:
                failed.add(load.seq)
            if self._kv is not None:
                for i, block in enumerate(load.block_ids):
                    self._kv[block * size : (block + 1) * size] = keys[i * size : (i + 1) * size]
        return failed

    @staticmethod
    def token_after(last_token: int, position: int) -> int:
        return FAKE_ALPHABET[(last_token * 31 + position * 17 + 7) % len(FAKE_ALPHABET)]

    def release(self, request_ids: list[str]) -> None:
        pass


def fake_model(config: EngineConfig) -> tuple[FakeExecutor, FakeTokenizer]:
    """The executor and tokenizer `--fake-model` serves, for a resolved config."""
    num_blocks, num_cpu_blocks = kv_pool_blocks(config, FAKE_KV_BYTES_PER_TOKEN)
    k = config.fake_step_time_scale
    step_time = LinearStepTime(base_s=0.002 * k, per_prefill_token_s=0.00005 * k, per_decode_token_s=0.0003 * k)
    return FakeExecutor(num_blocks, num_cpu_blocks, step_time, block_size=config.block_size), FakeTokenizer()
