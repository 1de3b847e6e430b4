"""`--dtype auto` on a CPU (engine/model/cpu_dtype.py): bf16 only with native bf16 flags and a
measured speed-up; fp32 (exact parity) otherwise."""

from __future__ import annotations

import logging

import torch

from iterserve.engine.model import cpu_dtype
from iterserve.engine.model_runner import pick_dtype

AMX_CPUINFO = "processor\t: 0\nflags\t\t: fpu sse4_2 avx2 avx512f avx512_bf16 amx_tile amx_bf16 amx_int8\n"
AVX2_CPUINFO = "processor\t: 0\nflags\t\t: fpu sse4_2 avx2 fma f16c\n"


def test_flags_are_read_from_cpuinfo():
    assert cpu_dtype.native_bf16_flags(AMX_CPUINFO) == ["amx_bf16", "avx512_bf16"]
    assert cpu_dtype.native_bf16_flags(AVX2_CPUINFO) == []
    assert cpu_dtype.native_bf16_flags("") == []


def test_bf16_only_with_the_flags_and_a_measured_speedup():
    assert cpu_dtype.choose([], 1.0, 0.1)[0] == torch.float32  # no flags: never, whatever a timing says
    dtype, why = cpu_dtype.choose(["amx_bf16"], 1.0, 0.5)
    assert dtype == torch.bfloat16 and "2.00x" in why and "--dtype float32" in why
    dtype, why = cpu_dtype.choose(["amx_bf16"], 1.0, 0.9)  # 1.11x: below MIN_SPEEDUP
    assert dtype == torch.float32 and "1.11x" in why
    assert cpu_dtype.choose(["amx_bf16"], 1.0, 1.0 / cpu_dtype.MIN_SPEEDUP)[0] == torch.bfloat16  # the boundary


def test_this_cpu_gets_what_its_flags_and_timings_say(caplog):
    """On the test machine: the real flags and, where there are some, the real timings."""
    with caplog.at_level(logging.INFO, logger="iterserve.engine.model.cpu_dtype"):
        dtype = cpu_dtype.auto_cpu_dtype(576, 1536)
    assert "--dtype auto on CPU" in caplog.text
    if not cpu_dtype.native_bf16_flags():
        assert dtype == torch.float32 and "no native bf16" in caplog.text
    else:
        assert ("ran" in caplog.text) and (("faster than fp32" in caplog.text) == (dtype == torch.bfloat16))


def test_pick_dtype_keeps_explicit_choices_cuda_and_quantized_models():
    cpu, config = torch.device("cpu"), type("Config", (), {"hidden_size": 64, "intermediate_size": 128})()
    assert pick_dtype("float32", cpu, config) == torch.float32
    assert pick_dtype("bfloat16", cpu, config) == torch.bfloat16
    assert pick_dtype("auto", torch.device("cuda"), config) == torch.bfloat16
    assert pick_dtype("auto", cpu, config, quantization="w8a8") == torch.float32  # quantized: fp32 activations
    assert pick_dtype("auto", cpu) == torch.float32
    assert pick_dtype("auto", cpu, config, attention_backend="triton") == torch.float32  # the interpreter
