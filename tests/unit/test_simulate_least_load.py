"""Least-load routing in a large simulated fleet: the pick index gives the run that building every
ready pod's load and calling the router's pick() on each arrival gives."""

from __future__ import annotations

import pytest

from iterserve.operator.models import InferenceServiceSpec
from iterserve.replica_model.profile import load_profile
from iterserve.simulate import traces
from iterserve.simulate.cluster import ClusterSim, SimOptions


def _run(spec: dict, trace, scan: bool):
    sim = ClusterSim(InferenceServiceSpec.model_validate(spec), load_profile("modelled-accelerator"), trace,
                     SimOptions(router="least-load", scan_routing=scan))
    result = sim.run()
    return ([(r.pod, r.status, r.error, r.first_token, r.last_token, r.tokens, r.max_gap) for r in result.requests],
            [(p.name, p.last_picked, p.replica.steps, p.replica.clock.now) for p in result.pods], result.end)


@pytest.mark.parametrize(("replicas", "seconds", "rate", "engine", "routing"), [
    # the scale benchmark's fleet and per-replica rate, on a short trace: mostly ties at low loads
    (200, 6.0, 200 / 3.6, {"maxNumSeqs": 64, "kvCacheMemory": "2GiB", "maxModelLen": 2048}, None),
    # a tight one: every replica saturates (the router holds, retries as requests finish, answers 429)
    (20, 3.0, 100.0, {"maxNumSeqs": 1, "kvCacheMemory": "2GiB", "maxModelLen": 2048}, {"mode": "Router", "maxQueue": 1}),
])
def test_the_pick_index_routes_a_fleet_as_picking_over_every_pod_does(replicas, seconds, rate, engine, routing):
    spec = {"model": {"uri": "smollm2-135m"}, "replicas": replicas, "engine": engine}
    if routing is not None:
        spec["routing"] = routing
    trace = traces.poisson(rate, seconds, traces.Lengths.parse("uniform:64:1024"), traces.Lengths.parse("zipf:512"),
                           seed=3)
    indexed, scanned = _run(spec, trace, scan=False), _run(spec, trace, scan=True)
    assert indexed == scanned
    records = indexed[0]
    assert len({r[0] for r in records} - {None}) == replicas  # every replica got requests
    if routing is not None:
        assert {r[1] for r in records} >= {"ok", "rejected"}  # saturated: some requests got the router's 429
