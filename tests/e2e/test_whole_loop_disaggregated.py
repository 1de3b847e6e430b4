"""The whole loop with a disaggregated InferenceService (e2e/whole_loop.py --disaggregated --quick,
on the session's control plane): a prefill pool scaled on queued prompt tokens per replica and a
decode pool scaled on waiting requests, each on its own pods' readings. Long prompts must scale the
prefill pool up while the decode pool holds; short prompts with long outputs must scale the decode
pool up while the prefill pool does not rise; both come back to their minimum with every request
answered, and every decision is an Event and a scalingHistory record naming its pool. Engines use
--fake-model (the real scheduler, KV pool and KV transfer, with a modelled step time).

This is also the cluster test of the two pools' separate scaling: one run covers both
directions, so no separate test in tests/integration repeats it."""

from __future__ import annotations

import json

import pytest

from e2e.wholeloop.disaggregated import DisaggregatedScenario, evaluate, plot
from e2e.wholeloop.run import run

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.cluster]


def test_the_prefill_and_decode_pools_scale_separately_on_their_own_signals(k8s_cluster, tmp_path):
    scenario = DisaggregatedScenario.quick()
    result = run(k8s_cluster, tmp_path / "run", scenario, log=print)
    summary, checks = evaluate(result)
    result.update(summary=summary, checks=[vars(c) for c in checks])
    (tmp_path / "whole-loop-disaggregated.json").write_text(json.dumps(result, indent=1))
    plot(result, summary, tmp_path / "whole-loop-disaggregated.png")
    failed = [f"{c.name}: {c.detail}" for c in checks if not c.ok]
    assert not failed, "\n".join(failed) + f"\n(timeline, logs: {tmp_path})"
    # The figures the checks rest on, stated once more where a reader of the test looks.
    assert summary["max_ready_prefill_replicas"] >= 2 and summary["max_ready_decode_replicas"] >= 2
    assert summary["final_prefill_replicas"] == scenario.prefill_min_replicas
    assert summary["final_decode_replicas"] == scenario.min_replicas
    assert summary["failed_requests"] == 0 and summary["router_pd_decisions"].get("remote", 0) > 0
