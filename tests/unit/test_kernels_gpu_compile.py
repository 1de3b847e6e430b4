"""Every engine kernel compiles for a CUDA GPU (sm_90, fp16 and bf16), checked ahead of time on
this CPU-only machine: the interpreter does not enforce the GPU compiler's rules."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

KERNELS = ["decode", "merge splits", "extend", "write_kv", "rms_norm", "rotary", "silu_and_mul", "moe"]


@pytest.mark.slow
def test_every_kernel_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[2]  # the helper imports triton: keep it out of this process
    proc = subprocess.run([sys.executable, "-m", "tests.unit.kernel_gpu_compile", "fp16", "bf16"],
                          cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for dtype in ("fp16", "bf16"):
        for kernel in KERNELS:
            assert f"{dtype} {kernel}" in proc.stdout, proc.stdout
