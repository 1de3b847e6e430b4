"""The router's pure parts: picking, the /metrics reading, prefix keys, pod readiness, framing."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import yaml

from iterserve.engine.config import DEFAULT_MAX_WAITING_REQUESTS
from iterserve.router.discovery import parse_endpoints, ready_urls
from iterserve.router.endpoints import parse_load
from iterserve.router.picking import (
    LEAST_LOAD,
    NONE_READY,
    PREFIX_AFFINITY,
    SATURATED,
    TIE_BREAK,
    EndpointLoad,
    PickPolicy,
    pick,
)
from iterserve.router.prefix import PrefixTable, block_hashes, prompt_keys

A, B, C = "http://a:1", "http://b:1", "http://c:1"
REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("endpoints", "affinity", "url", "reason"), [
    # load = max(scraped waiting + running, in flight)
    ([EndpointLoad(A, waiting=3, running=4), EndpointLoad(B, waiting=0, running=2)], None, B, LEAST_LOAD),
    ([EndpointLoad(A, in_flight=5, waiting=0, running=1), EndpointLoad(B, waiting=1, running=2)], None, B, LEAST_LOAD),
    # stale (no scrape): local counts only, never dropped
    ([EndpointLoad(A, in_flight=2), EndpointLoad(B, in_flight=1, waiting=None)], None, B, LEAST_LOAD),
    # the scrape brought forward: B finished 3 requests since its scrape said 5
    ([EndpointLoad(A, in_flight=3, waiting=0, running=3), EndpointLoad(B, in_flight=2, waiting=0, running=5,
                                                                       since_scrape=-3)], None, B, LEAST_LOAD),
    # ejected endpoints are never picked
    ([EndpointLoad(A, routable=False), EndpointLoad(B, in_flight=9)], None, B, LEAST_LOAD),
    ([EndpointLoad(A, routable=False)], None, None, NONE_READY),
    ([], None, None, NONE_READY),
    # saturated: load >= max_num_seqs + max_queue (16)
    ([EndpointLoad(A, waiting=16, running=4, max_num_seqs=4), EndpointLoad(B, in_flight=20, max_num_seqs=4)],
     None, None, SATURATED),
    ([EndpointLoad(A, waiting=16, running=4, max_num_seqs=4), EndpointLoad(B, in_flight=19, max_num_seqs=4)],
     None, B, LEAST_LOAD),
    # affinity wins within the tolerance (4), not beyond
    ([EndpointLoad(A, in_flight=5), EndpointLoad(B, in_flight=1)], A, A, PREFIX_AFFINITY),
    ([EndpointLoad(A, in_flight=6), EndpointLoad(B, in_flight=1)], A, B, LEAST_LOAD),
    ([EndpointLoad(A, in_flight=1), EndpointLoad(B, in_flight=1), EndpointLoad(C, in_flight=3)], None, None, TIE_BREAK),
])
def test_pick(endpoints, affinity, url, reason):
    choice = pick(endpoints, random.Random(0), PickPolicy(max_queue=16), affinity)
    assert choice.reason == reason
    if reason == TIE_BREAK:
        assert choice.url in (A, B)
    else:
        assert choice.url == url


def test_the_default_queue_bound_lets_the_engines_queue_what_the_autoscaler_and_alerts_read():
    """Routed traffic must still build the engine queue: a router that refused first would hide the
    backlog from the autoscaler's waiting signal and from the backlog alert."""
    values = yaml.safe_load((REPO / "charts/iterserve/values.yaml").read_text())
    backlog_threshold = values["alerts"]["schedulerBacklog"]["threshold"]
    assert PickPolicy().max_queue == DEFAULT_MAX_WAITING_REQUESTS
    assert PickPolicy().max_queue > backlog_threshold
    one_engine = [EndpointLoad(A, waiting=backlog_threshold + 1, running=64, max_num_seqs=64)]
    assert pick(one_engine, random.Random(0)).url == A


def test_ties_between_endpoints_never_picked_are_broken_at_random():
    loads = [EndpointLoad(u, in_flight=2) for u in (A, B, C)]
    rng = random.Random(1)
    seen = {pick(loads, rng).url for _ in range(100)}
    assert seen == {A, B, C}


def test_a_tie_goes_to_the_endpoint_picked_longest_ago_so_equal_loads_rotate():
    """As round robin does on identical replicas, which queue less than a random split."""
    rng = random.Random(1)
    last = {A: 5, B: 3, C: 9}
    order = []
    for number in range(10, 16):
        loads = [EndpointLoad(u, in_flight=2, last_picked=last[u]) for u in (A, B, C)]
        chosen = pick(loads, rng)
        assert chosen.reason == "tie_break"
        last[chosen.url] = number
        order.append(chosen.url)
    assert order == [B, A, C, B, A, C]
    # a lower load still wins whenever it was picked
    loads = [EndpointLoad(A, in_flight=1, last_picked=99), EndpointLoad(B, in_flight=2, last_picked=1)]
    assert pick(loads, rng).url == A


ENGINE_METRICS = b"""# HELP llm_scheduler_waiting_requests Requests waiting to be scheduled.
# TYPE llm_scheduler_waiting_requests gauge
llm_scheduler_waiting_requests{model_name="fake"} 3.0
llm_scheduler_running_seqs{model_name="fake"} 4.0
llm_scheduler_max_num_seqs{model_name="fake"} 4.0
vllm:num_requests_waiting{model_name="fake"} 3.0
"""


def test_parse_load_reads_our_names_then_vllms():
    assert parse_load(ENGINE_METRICS) == (3, 4, 4)
    assert parse_load(b'vllm:num_requests_waiting{model_name="m"} 2\nvllm:num_requests_running{model_name="m"} 7\n') == (2, 7, None)
    with pytest.raises(ValueError):
        parse_load(b"# nothing\nprocess_cpu_seconds_total 1.0\n")


def test_prefix_keys_are_block_aligned_chains():
    a = block_hashes(list(range(40)), 16, 256)
    b = block_hashes(list(range(32)) + [99] * 8, 16, 256)
    assert len(a) == 2 and a == b  # only full blocks; the tail after 32 tokens is not hashed
    assert block_hashes([5] * 16 + list(range(16)), 16, 256)[1] != block_hashes([6] * 16 + list(range(16)), 16, 256)[1]
    assert len(block_hashes(list(range(1000)), 16, 256)) == 16  # only the first N tokens
    assert prompt_keys(b'{"prompt": [1, 2, 3]}', 16, 256) == []
    assert len(prompt_keys(b'{"prompt": "' + b"x" * 130 + b'"}', 16, 256)) == 2  # 64 bytes a block
    salted = prompt_keys(b'{"prompt": "' + b"x" * 130 + b'", "cache_salt": "s"}', 16, 256)
    assert len(salted) == 2 and not set(salted) & set(prompt_keys(b'{"prompt": "' + b"x" * 130 + b'"}', 16, 256))
    table = PrefixTable()
    keys = prompt_keys(b'{"messages": [{"role": "user", "content": "' + b"y" * 300 + b'"}]}', 16, 256)
    table.record(keys, A)
    assert table.lookup(keys[:2]) == A and table.lookup([12345]) is None
    table.forget(A)
    assert table.lookup(keys) is None


def test_ready_urls_and_static_lists():
    def pod(name, ready=True, deleting=False, ip="127.10.0.1"):
        meta = {"name": name, **({"deletionTimestamp": "x"} if deleting else {})}
        return {"metadata": meta, "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": str(ready)}]},
                "spec": {"containers": [{"ports": [{"name": "http", "containerPort": 8000}]}]}}

    pods = [pod("a"), pod("b", ready=False), pod("c", deleting=True), pod("d", ip="127.10.0.2")]
    assert ready_urls(pods, "http") == ["http://127.10.0.1:8000", "http://127.10.0.2:8000"]
    assert ready_urls(pods, "grpc") == []
    assert parse_endpoints("http://127.0.0.1:8001/, 127.0.0.1:8002") == ["http://127.0.0.1:8001", "http://127.0.0.1:8002"]


def test_round_robin_baseline_turns_over_open_endpoints():
    from iterserve.router.picking import ROUND_ROBIN, pick_round_robin

    loads = [EndpointLoad(B, in_flight=9), EndpointLoad(A), EndpointLoad(C, routable=False)]
    assert [pick_round_robin(loads, turn).url for turn in range(4)] == [A, B, A, B]
    assert pick_round_robin(loads, 0).reason == ROUND_ROBIN
    full = EndpointLoad(A, in_flight=64 + PickPolicy().max_queue, max_num_seqs=64)
    assert pick_round_robin([full], 0).reason == SATURATED
