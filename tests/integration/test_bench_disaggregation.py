"""bench/cluster/disaggregation.py's plumbing, run as a user runs it, on the fake model (seconds, no weights).

The figures of a fake-model run mean nothing; what is checked is what makes the real run's
figures trustworthy: every arm served every request, the router sent exactly the prompts over the
threshold to the prefill replica (all of them with threshold 0, none of the short ones with 512),
every remote prefill became one KV pull on the decode replica, the transfer cost is computed over
the tokens that moved, and no engine found an arm's prompts in its prefix cache (arms and
workloads have their own prompts; a hit would make the KV bytes per token look smaller).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_disaggregation_bench_fake_model_plumbing(tmp_path):
    out, png = tmp_path / "disagg.json", tmp_path / "disagg.png"
    result = subprocess.run([sys.executable, "-m", "bench.cluster.disaggregation", "--fake-model", "--requests", "8", "--rate", "2",
                             "--long-share", "0.5", "--long-tokens", "640", "--short-tokens", "64", "--json", str(out),
                             "--plot", str(png)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert png.read_bytes()[:4] == b"\x89PNG"
    report = json.loads(out.read_text())
    workloads = report["workloads"]
    assert set(workloads) == {"mixed", "short"}
    assert set(workloads["mixed"]) == {"aggregated", "disaggregated"}
    assert set(workloads["short"]) == {"aggregated", "disaggregated", "disaggregated_threshold_0"}
    long_requests = workloads["mixed"]["aggregated"]["long_requests"]
    assert long_requests == 4  # exactly --long-share of the requests
    for workload, arms in workloads.items():
        for arm, r in arms.items():
            where = f"{workload}/{arm}"
            assert r["completed"] == r["requests"] == 8 and r["errors"] == [], where
            # The same arrivals and prompt lengths in every arm of a workload.
            assert r["long_requests"] == (long_requests if workload == "mixed" else 0), where
            assert r["prompt_tokens_total"] == arms["aggregated"]["prompt_tokens_total"], where
            assert set(r["prefix_cache_hits"].values()) == {0.0}, (where, r["prefix_cache_hits"])
            assert all(b is not None and b >= 0 for b in r["engine_cpu_busy"].values()), where
            assert r["ttft_s"]["p50"] > 0 and r["itl_s"]["p99"] >= r["itl_s"]["p90"] > 0, where
            if arm == "aggregated":
                assert "transfer" not in r and set(r["engine_cpu_busy"]) == {"both0", "both1"}, where
                continue
            assert set(r["engine_cpu_busy"]) == {"prefill", "decode"}, where
            t = r["transfer"]
            expected_remote = {"mixed": long_requests, "short": 8 if arm.endswith("threshold_0") else 0}[workload]
            assert t["remote_prefills"] == expected_remote and t["transfers"] == expected_remote, where
            assert t["fallbacks"] == 0 and t["transfer_failures"] == 0, where
            assert t["remote_share"] == expected_remote / 8, where
            assert r["pd_decisions"]["remote"] == expected_remote, where
            if expected_remote:
                moved = expected_remote * (640 if workload == "mixed" else 64)
                assert t["transferred_tokens"] == moved, where
                assert t["transfer_bytes_per_token"] == pytest.approx(t["transfer_bytes_total"] / moved), where
                assert t["transfer_bytes_total"] > 0 and t["transfer_seconds_total"] > 0, where
            else:
                assert t["transfer_bytes_per_token"] is None and r["pd_decisions"]["short_prompt"] == 8, where
