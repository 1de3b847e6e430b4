"""The benchmark scripts' --quick modes, run as a user runs them, so they keep working.

No timing is asserted (the machine is shared); what is checked is that every system and
configuration ran the same workload to completion and that the derived figures are sane.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def run_quick(script: str, tmp_path: Path) -> dict:
    """`python -m bench.engine.<script> --quick` from the repository root, as docs/development.md says."""
    out, png = tmp_path / f"{script}.json", tmp_path / f"{script}.png"
    result = subprocess.run([sys.executable, "-m", f"bench.engine.{script}", "--quick", "--json", str(out),
                             "--plot", str(png)], cwd=REPO, capture_output=True, text=True, timeout=400)
    assert result.returncode == 0, result.stderr[-3000:]
    assert png.stat().st_size > 5000 and png.read_bytes()[:4] == b"\x89PNG"
    report = json.loads(out.read_text())
    assert report["machine"]["torch_threads"] == 1
    # The recorded command re-runs it: the module form, no path of this machine.
    assert report["run"]["command"][:4] == ["python", "-m", f"bench.engine.{script}", "--quick"]
    return report


def positive(value) -> bool:
    return isinstance(value, int | float) and value > 0 and math.isfinite(value)


@pytest.mark.slow
def test_throughput_quick_every_system_generates_the_same_useful_tokens(tmp_path):
    report = run_quick("throughput", tmp_path)
    systems = report["systems"]
    assert set(systems) == {"iterserve-continuous", "iterserve-static", "hf-generate-static", "hf-generate-batch"}
    useful = report["workload"]["useful_tokens"]
    for name, system in systems.items():
        assert system["useful_tokens"] == useful, name
        assert system["exact_output_lengths"], name
        assert system["generated_tokens"] >= useful, name
        assert positive(system["useful_tokens_per_s"]) and positive(system["continuous_speedup"]), name
    # The speedups are the measured times' ratios (not a baseline compared with itself), and each
    # target's verdict follows from its figure.
    continuous = systems["iterserve-continuous"]
    for name, system in systems.items():
        assert system["continuous_speedup"] == pytest.approx(system["total_time_s"] / continuous["total_time_s"]), name
        assert system["useful_tokens_per_s"] == pytest.approx(useful / system["total_time_s"]), name
    for label, target in report["targets"].items():
        measured = systems[label.removeprefix("continuous vs ")]["continuous_speedup"]
        assert target["measured_x"] == measured and target["met"] == (measured >= target["target_x"]), label
    # Continuous batching computes each request's tokens only: exactly the useful ones.
    assert continuous["generated_tokens"] == useful
    # Padded static batches compute up to each batch's longest output; zipf lengths differ.
    assert systems["hf-generate-static"]["generated_tokens"] > useful
    assert set(report["targets"]) == {f"continuous vs {n}" for n in systems if n != "iterserve-continuous"}


@pytest.mark.slow
def test_kv_waste_quick_paged_wastes_less_than_static_slabs(tmp_path):
    report = run_quick("kv_waste", tmp_path)
    sizes = report["block_sizes"]
    assert list(sizes) == ["8", "16", "32"]
    wastes = [sizes[s]["mean_waste"] for s in sizes]
    assert 0 <= wastes[0] <= wastes[1] <= wastes[2] < 1
    for r in sizes.values():
        assert r["mean_waste"] < r["static_exact_length_waste"] < r["static_output_cap_waste"] \
            < r["static_max_model_len_waste"] < 1
        assert r["mean_capacity_allocated"] >= r["mean_tokens_stored"] > 0


@pytest.mark.slow
def test_scheduler_overhead_quick_fractions(tmp_path):
    report = run_quick("scheduler_overhead", tmp_path)
    assert list(report["seqs"]) == ["8", "32"]
    for r in report["seqs"].values():
        assert positive(r["real"]["model_s"]) and positive(r["real"]["forward_s"])
        assert 0 < r["real_overhead_fraction"] < 1
        assert 0 < r["fake_vs_gpu_class_step_fraction"] < 1
        assert positive(r["fake_bookkeeping_s"])


@pytest.mark.slow
def test_chunked_prefill_quick_every_config_served_every_request(tmp_path):
    report = run_quick("chunked_prefill", tmp_path)
    configs = report["configs"]
    assert set(configs) == {"off", "chunk 128", "chunk 128, no cap"}
    assert report["prefill_caps"] == {"off": 0, "chunk 128": 16, "chunk 128, no cap": 0}
    for r in configs.values():
        assert r["short"]["requests"] == report["workload"]["short_requests"]
        assert len(r["short"]["ttft_samples_s"]) == r["short"]["requests"] * report["workload"]["rounds"]
        assert r["long"]["requests"] == 1
        ttft = r["short"]["ttft_s"]
        assert 0 < ttft["p50"] <= ttft["p95"] <= ttft["p99"]
    assert configs["off"]["short_p95_ttft_cut_vs_off"] == 0


@pytest.mark.slow
def test_online_latency_quick_both_modes_every_rate(tmp_path):
    report = run_quick("online_latency", tmp_path)
    assert set(report["modes"]) == {"continuous", "static"}
    for by_rate in report["modes"].values():
        assert list(by_rate) == ["1", "4"]
        for r in by_rate.values():
            assert r["completed"] == report["workload"]["requests_per_rate"]
            assert positive(r["output_throughput_tokens_per_s"])
            assert 0 < r["ttft_s"]["p50"] <= r["ttft_s"]["p95"]
