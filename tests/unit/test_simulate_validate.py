"""bench/simulator/validate.py on the shipped evidence (real runs of the embedded model, recorded by
bench/simulator/record.py): the shipped default profile is exactly the fit of that evidence, the committed
validate.json (whose figures docs/simulator.md quotes) is what the script computes from
it, and the printout carries the checks and the residual analysis."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from iterserve.replica_model import profile as profiles

ROOT = Path(__file__).resolve().parents[2]
EVIDENCE = ROOT / "docs" / "perf" / "sim" / "cpu_profile"  # the recording the shipped smollm2-135m-cpu profile is fitted on


def _numbers(value, path=""):
    """Every number in a JSON value, by its path (the simulator's wall-clock speed left out)."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _numbers(item, f"{path}/{key}")
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _numbers(item, f"{path}/{index}")
    elif isinstance(value, int | float) and not isinstance(value, bool):
        yield path, value


@pytest.mark.slow
def test_shipped_profile_is_the_fit_of_the_shipped_evidence(tmp_path):
    out = tmp_path / "profile.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.simulator.validate",
         "--train-runs", str(EVIDENCE / "train_runs.json"), "--train-runs", str(EVIDENCE / "train_small_runs.json"),
         "--heldout-runs", str(EVIDENCE / "heldout_runs.json"), "--trace", str(EVIDENCE / "heldout.csv"),
         "--json", str(tmp_path / "v.json"), "--profile-out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr
    fitted = profiles.load_profile(str(out))
    shipped = profiles.load_profile("smollm2-135m-cpu")
    assert fitted.coefficients == pytest.approx(shipped.coefficients, rel=1e-9)
    assert not shipped.modelled and shipped.coefficients["const"] > 0

    result = json.loads((tmp_path / "v.json").read_text())
    committed = json.loads((EVIDENCE / "validate.json").read_text())
    for key in ("cpu", "parity", "real_runs", "sim_error_vs_real_mean", "checks"):
        computed = dict(_numbers(result[key]))
        for path, value in _numbers(committed[key]):
            if not path.endswith("wall_s"):
                assert computed[path] == pytest.approx(value, rel=1e-9, abs=1e-12), f"{key}{path}"
    cpu = result["cpu"]
    assert result["parity"]["fraction"] >= 0.99
    # The checks: each error within 1.2x the noise this machine showed in the same recording.
    checks = {k: v for k, v in result["checks"].items() if k != "noise_margin"}
    assert set(checks) == {"step_model_decode_only", "step_model_mixed", "end_to_end_ttft_p95", "end_to_end_throughput"}
    for name, check in checks.items():
        assert check["passed"] and check["error"] <= 1.2 * check["noise"], (name, check)
    assert checks["step_model_decode_only"]["noise"] == pytest.approx(cpu["measurement_floor"]["decode_only"])
    assert "checks (CPU time; pass: error <= 1.2x the noise" in proc.stdout
    assert len(cpu["error_by_measurements"]) == cpu["noise_heldout"]["measurements_per_step"]
    assert sum(g["steps"] for g in cpu["decode_only_residuals"]["by_num_seqs"].values()) \
        == cpu["step_errors_vs_medians"]["decode_only"]["steps"]
    # Term selection is by CV: no candidate shape left out would have earned its place.
    shapes = cpu["candidate_shapes_cv_error"]
    assert min(shapes.values()) > shapes["profile's terms"] - profiles.EARN_PLACE
    for line in ("decode-only residuals vs the medians", "error vs medians of the first k measurements",
                 "4-fold CV error on the training steps", f"parity: {result['parity']['same_composition']}/"):
        assert line in proc.stdout
