"""The KV pool sized from memory when --kv-cache-memory is not given (engine/kv_memory.py)."""

from __future__ import annotations

import pytest
import torch

from iterserve.engine import kv_memory
from iterserve.engine.config import (
    DEFAULT_KV_CACHE_MEMORY,
    ConfigError,
    EngineConfig,
    kv_pool_blocks,
)

PER_TOKEN = 46080  # SmolLM2-135M in fp32: 2 x 30 layers x 3 KV heads x 64 x 4 bytes


def test_cpu_takes_a_share_of_available_memory_capped_by_what_the_sequences_can_use(monkeypatch):
    monkeypatch.setattr(kv_memory, "available_cpu_memory", lambda: 8 * 2**30)
    budget, why = kv_memory.auto_kv_bytes("cpu", PER_TOKEN, 256, 2048, 0, 0.9)
    assert budget == 2 * 2**30 and "0.25 of 8.0 GiB" in why
    budget, _ = kv_memory.auto_kv_bytes("cpu", PER_TOKEN, 4, 2048, 0, 0.9)  # 4 full sequences need less
    assert budget == 4 * 2048 * PER_TOKEN
    monkeypatch.setattr(kv_memory, "available_cpu_memory", lambda: 64 * 2**30)
    assert kv_memory.auto_kv_bytes("cpu", PER_TOKEN, 1024, 2048, 0, 0.9)[0] == kv_memory.CPU_CAP
    monkeypatch.setattr(kv_memory, "available_cpu_memory", lambda: None)
    assert kv_memory.auto_kv_bytes("cpu", PER_TOKEN, 256, 2048, 0, 0.9)[0] == kv_memory.FALLBACK


def test_available_memory_is_read_from_this_machine():
    available = kv_memory.available_cpu_memory()
    assert available is None or 0 < available < 2**50


def test_an_explicit_size_or_block_count_overrides_the_measured_one():
    measured = 100 * 2**20
    assert kv_pool_blocks(EngineConfig(), PER_TOKEN, measured)[0] == measured // (PER_TOKEN * 16)
    assert kv_pool_blocks(EngineConfig(), PER_TOKEN)[0] == DEFAULT_KV_CACHE_MEMORY // (PER_TOKEN * 16)
    assert kv_pool_blocks(EngineConfig(kv_cache_memory="32MiB"), PER_TOKEN, measured)[0] == 2**25 // (PER_TOKEN * 16)
    assert kv_pool_blocks(EngineConfig(num_kv_blocks=7), PER_TOKEN, measured)[0] == 7


@pytest.mark.parametrize("value", [0.0, 1.5, -0.1])
def test_gpu_memory_utilization_outside_0_1_is_refused_by_name(value):
    with pytest.raises(ConfigError, match="--gpu-memory-utilization"):
        EngineConfig(gpu_memory_utilization=value).resolve()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpu_pool_is_zeroed_aligned_and_writable(dtype):
    pool = kv_memory.kv_zeros((5, 16, 3, 64), dtype, torch.device("cpu"))
    assert pool.shape == (5, 16, 3, 64) and pool.dtype == dtype and pool.is_contiguous()
    assert pool.data_ptr() % 64 == 0 and not pool.any()
    pool[4, 15] = 1.5
    assert pool.sum() == 1.5 * 3 * 64
