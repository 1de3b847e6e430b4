"""PickIndex (the simulator's fleet-sized least-load pick) against the router's pick(): the same
choice, reason and load, and the same draws from the rng, over random loads that change between
picks."""

from __future__ import annotations

import random
from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from iterserve.router.picking import (
    NONE_READY,
    SATURATED,
    TIE_BREAK,
    EndpointLoad,
    PickIndex,
    PickPolicy,
    pick,
)

small = st.integers(min_value=0, max_value=5)
loads = st.builds(
    EndpointLoad,
    url=st.just(""),
    in_flight=small,
    waiting=st.none() | small,
    running=st.none() | small,
    max_num_seqs=st.none() | st.integers(min_value=1, max_value=4),
    routable=st.booleans() | st.just(True),
    since_scrape=st.integers(min_value=-3, max_value=3),
    last_picked=st.integers(min_value=0, max_value=4),  # repeats: ties among last_picked too
)
# (endpoint index, its new load or None to remove it) changes, then a pick
steps = st.lists(st.lists(st.tuples(st.integers(min_value=0, max_value=11), st.none() | loads), max_size=4),
                 min_size=1, max_size=25)


@settings(max_examples=300, deadline=None)
@given(initial=st.lists(loads, max_size=12), steps=steps, max_queue=st.integers(min_value=0, max_value=3),
       seed=st.integers(min_value=0, max_value=2**32))
def test_the_index_picks_what_pick_picks_over_the_same_loads(initial, steps, max_queue, seed):
    policy = PickPolicy(max_queue=max_queue)
    index = PickIndex(policy)
    endpoints: dict[int, EndpointLoad] = {}  # order -> load
    by_scan, by_index = random.Random(seed), random.Random(seed)

    def enter(order: int, load: EndpointLoad | None) -> None:
        url = f"http://replica-{order}:8000"
        if load is None:
            endpoints.pop(order, None)
            index.remove(url)
        else:
            endpoints[order] = replace(load, url=url)
            index.update(endpoints[order], order)

    for order, load in enumerate(initial):
        enter(order, load)
    for picks, changes in enumerate(steps, start=10):
        for order, load in changes:
            enter(order, load)
        expected = pick([endpoints[o] for o in sorted(endpoints)], by_scan, policy)
        assert index.pick(by_index) == expected
        assert by_index.getstate() == by_scan.getstate()
        assert len(index) == sum(e.routable for e in endpoints.values())
        if expected.url is not None:  # the router's bookkeeping after a pick: one more in flight, picked last
            order = next(o for o, e in endpoints.items() if e.url == expected.url)
            enter(order, replace(endpoints[order], in_flight=endpoints[order].in_flight + 1, last_picked=picks))


def test_the_index_answers_none_ready_saturated_and_ties_as_pick_does():
    index = PickIndex(PickPolicy(max_queue=0))
    assert index.pick(random.Random(0)).reason == NONE_READY
    index.update(EndpointLoad("a", in_flight=2, max_num_seqs=2), 0)
    assert index.pick(random.Random(0)).reason == SATURATED
    index.update(EndpointLoad("b", in_flight=1, max_num_seqs=2), 1)
    index.update(EndpointLoad("c", in_flight=1, max_num_seqs=2), 2)
    choice = index.pick(random.Random(0))
    assert choice.reason == TIE_BREAK and choice.load == 1
    index.remove("a")
    index.remove("b")
    assert index.pick(random.Random(0)).url == "c"
