"""bench/sim_validate.py on the shipped evidence (docs/perf/sim/v3: real runs of the embedded model):
the shipped default profile is exactly the fit of that evidence, and the printout carries the checks
and the residual analysis docs/simulator.md quotes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from iterserve.simulate import profile as profiles

ROOT = Path(__file__).resolve().parents[2]
EVIDENCE = ROOT / "docs" / "perf" / "sim" / "v3"


@pytest.mark.slow
def test_shipped_profile_is_the_fit_of_the_shipped_evidence(tmp_path):
    out = tmp_path / "profile.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "sim_validate.py"),
         "--train-runs", str(EVIDENCE / "train_runs.json"), "--train-runs", str(EVIDENCE / "train_small_runs.json"),
         "--heldout-runs", str(EVIDENCE / "heldout_runs.json"), "--trace", str(EVIDENCE / "heldout.csv"),
         "--json", str(tmp_path / "v.json"), "--profile-out", str(out)],
        capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr
    fitted = profiles.load_profile(str(out))
    shipped = profiles.load_profile("smollm2-135m-cpu")
    assert fitted.coefficients == pytest.approx(shipped.coefficients, rel=1e-9)
    assert set(shipped.coefficients) == {*profiles.BASE_TERMS, "multi_token"}

    result = json.loads((tmp_path / "v.json").read_text())
    cpu = result["cpu"]
    assert result["parity"]["fraction"] == 1.0
    # The figures docs/simulator.md and the README quote (rounded there).
    assert cpu["step_errors_vs_medians"]["decode_only"]["mean"] == pytest.approx(0.0504, abs=5e-4)
    assert cpu["step_errors_vs_medians"]["mixed"]["mean"] == pytest.approx(0.0387, abs=5e-4)
    assert [round(t["decode_only"], 3) for t in cpu["error_by_measurements"]] == [0.068, 0.049, 0.050]
    residuals = cpu["decode_only_residuals"]
    assert residuals["by_num_seqs"]["2"]["signed"] == pytest.approx(0.045, abs=1e-3)
    assert len(residuals["by_series_abs"]) == 3
    # No candidate shape cuts the CV error by the point a term needs to earn its place.
    shapes = cpu["candidate_shapes_cv_error"]
    assert min(shapes.values()) > shapes["profile's terms"] - profiles.EARN_PLACE
    for line in ("decode-only residuals vs the medians", "error vs medians of the first k measurements",
                 "4-fold CV error on the training steps", "parity: 177/177"):
        assert line in proc.stdout
