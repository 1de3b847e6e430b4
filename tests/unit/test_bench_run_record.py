"""Every benchmark JSON written through bench/common.py says which commit, CPU and command made it,
with no path of the machine it ran on, so a figure in the docs can be traced and re-run."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from bench import common

REPO = Path(__file__).resolve().parents[2]


def test_a_result_records_its_commit_cpu_and_command_without_machine_paths(tmp_path, monkeypatch):
    # `python -m bench.engine.kv_waste ...` leaves the module's file path in sys.argv[0].
    monkeypatch.setattr(sys, "argv", [str(REPO / "bench" / "engine" / "kv_waste.py"), "--quick", "--json", "out.json"])
    out = tmp_path / "result.json"
    common.write_json(str(out), {"benchmark": "kv_waste"})
    run = json.loads(out.read_text())["run"]
    assert re.fullmatch(r"[0-9a-f]{40}", run["commit"])
    assert isinstance(run["tree_modified"], bool) and run["cpu_model"]
    assert run["command"] == ["python", "-m", "bench.engine.kv_waste", "--quick", "--json", "out.json"]
    assert str(REPO) not in json.dumps(run)


def test_a_script_outside_the_bench_package_is_recorded_by_its_path():
    assert common.invocation(str(REPO / "e2e" / "whole_loop.py")) == ["e2e/whole_loop.py"]
    assert common.invocation("/elsewhere/tool.py") == ["tool.py"]


def test_a_run_record_the_script_already_made_is_kept(tmp_path):
    out = tmp_path / "result.json"
    common.write_json(str(out), {"run": {"command": ["python", "-m", "bench.peers.compare"]}})
    assert json.loads(out.read_text())["run"] == {"command": ["python", "-m", "bench.peers.compare"]}


# Results older than the run record carry one backfilled from git history and their own machine
# field; these are the ones no documented command writes (their "command_source" says what is known).
NO_DOCUMENTED_COMMAND = {
    "cpu_attention.json", "cpu_attention_prefetch.json", "guidellm_sweep.json", "quant_linear.json",
    "robustness.json", "routing_identical_exponential.json", "routing_identical_same_hop.json",
    "step_overhead.json", "step_profile.json", "step_split.json", "step_split_served.json",
    "step_threads.json", "structured_outputs.json",
}


def test_every_result_in_docs_perf_records_its_commit_and_command():
    perf = REPO / "docs" / "perf"
    files = sorted([*perf.glob("*.json"), *perf.glob("sim/*.json")])
    assert len(files) > 30
    for path in files:
        name = path.relative_to(perf).as_posix()
        run = json.loads(path.read_text()).get("run")
        assert isinstance(run, dict), f"{name} has no run record"
        assert re.fullmatch(r"[0-9a-f]{40}", run.get("commit") or ""), name
        assert "command" in run, name
        if name in NO_DOCUMENTED_COMMAND:
            assert run["command"] is None or isinstance(run["command"], list), name
        else:
            assert isinstance(run["command"], list) and run["command"], f"{name} has no command"
            assert all(isinstance(arg, str) for arg in run["command"]), name
        assert str(REPO) not in json.dumps(run), name
