"""bench/kernels/triton_kernels.py: says so and exits 0 without a GPU; its whole pipeline (both backends, the
table, the JSON) runs on a tiny grid through the Triton interpreter with --cpu-smoke."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def run_bench(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""  # the no-GPU path, even on a machine with one
    return subprocess.run([sys.executable, "-m", "bench.kernels.triton_kernels", *args], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=300)


def test_without_a_gpu_it_says_so_and_exits_0(tmp_path):
    proc = run_bench("--json", str(tmp_path / "k.json"))
    assert proc.returncode == 0, proc.stderr
    assert "no CUDA device" in proc.stdout
    assert "no CUDA device" in json.loads((tmp_path / "k.json").read_text())["skipped"]


@pytest.mark.slow
def test_cpu_smoke_times_every_kernel_and_writes_json(tmp_path):
    proc = run_bench("--cpu-smoke", "--json", str(tmp_path / "k.json"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((tmp_path / "k.json").read_text())
    kernels = {row["kernel"].split(" (")[0] for row in data["results"]}
    assert kernels == {"decode_attention", "extend_attention", "rms_norm+residual", "silu_and_mul", "rotary",
                       "write_kv"}
    decode = [row for row in data["results"] if row["kernel"] == "decode_attention"]
    assert len(decode) == 4  # 2 batch sizes x 2 context lengths
    assert all(row["kv_bytes"] > 0 and row["triton_gbps"] > 0 and row["max_abs_error"] < 1e-4 for row in decode)
    assert "decode attention peaks at" in proc.stdout and "triton GB/s" in proc.stdout
