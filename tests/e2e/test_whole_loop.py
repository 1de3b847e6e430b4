"""The whole loop on one machine (e2e/whole_loop.py --quick, on the session's control plane):
engine pods made real by the local pod runtime, the operator as the Helm chart's ServiceAccount,
load in phases idle -> heavy -> light. The operator must scale up under load without runaway,
lower max_num_seqs on a replica under KV pressure (and its preemptions must then fall), come
back to min replicas with no failed request through the drain, and record every decision as an
Event and a scalingHistory entry. Engines use --fake-model (the real scheduler and KV pool with a
modelled step time): three real-model engines do not fit the CI's two cores."""

from __future__ import annotations

import json

import pytest

from e2e.wholeloop.checks import evaluate
from e2e.wholeloop.plot import plot
from e2e.wholeloop.run import run
from e2e.wholeloop.scenario import Scenario

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.cluster]


def test_operator_scales_and_retunes_a_live_service_and_drains_without_failures(k8s_cluster, tmp_path):
    result = run(k8s_cluster, tmp_path / "run", Scenario.quick(), log=print)
    summary, checks = evaluate(result)
    result.update(summary=summary, checks=[vars(c) for c in checks])
    (tmp_path / "whole-loop.json").write_text(json.dumps(result, indent=1))
    plot(result, summary, tmp_path / "whole-loop.png")
    failed = [f"{c.name}: {c.detail}" for c in checks if not c.ok]
    assert not failed, "\n".join(failed) + f"\n(timeline, logs: {tmp_path})"
    # The figures the checks rest on, stated once more where a reader of the test looks.
    assert summary["max_ready_replicas"] >= 2 and summary["final_replicas"] == 1
    assert summary["failed_requests"] == 0
    assert summary["max_num_seqs_after"] < summary["max_num_seqs_before"] == Scenario.quick().max_num_seqs
    assert summary["preemptions_per_min_after"] < summary["preemptions_per_min_before"]
    assert all(row["t"] <= result["timeline"][i + 1]["t"] - 0.5 for i, row in enumerate(result["timeline"][:-1]))
