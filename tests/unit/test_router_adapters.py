"""The router's adapter rules, pure: a LoRA adapter's requests go to replicas that serve it
(their /v1/models), preferring the ones running it now (vLLM's lora_requests_info) within the load
tolerance; the router answers 404 itself only when every replica's list is known."""

from __future__ import annotations

import random

import pytest

from iterserve.router.endpoints import parse_lora_info, parse_models
from iterserve.router.picking import (
    ADAPTER_AFFINITY,
    LEAST_LOAD,
    PREFIX_AFFINITY,
    SATURATED,
    EndpointLoad,
    PickPolicy,
    pick,
    unknown_model,
)

A, B, C = "http://a:1", "http://b:1", "http://c:1"
BASE = frozenset({"base"})
WITH_SQL = frozenset({"base", "sql"})


def load(url, n, models=None, active=(), **more):
    return EndpointLoad(url, in_flight=n, models=models, active_adapters=frozenset(active), **more)


@pytest.mark.parametrize(("endpoints", "model", "affinity", "url", "reason"), [
    # only B serves sql: B, however loaded (A would answer 404)
    ([load(A, 0, BASE), load(B, 9, WITH_SQL)], "sql", None, B, ADAPTER_AFFINITY),
    # a replica whose list is not known yet may serve it: the least loaded of the two
    ([load(A, 0, None), load(B, 1, WITH_SQL), load(C, 0, BASE)], "sql", None, A, ADAPTER_AFFINITY),
    # both serve it, C runs it now: C within the tolerance (4) ...
    ([load(B, 0, WITH_SQL), load(C, 4, WITH_SQL, ["sql"])], "sql", None, C, ADAPTER_AFFINITY),
    # ... not beyond it
    ([load(B, 0, WITH_SQL), load(C, 5, WITH_SQL, ["sql"])], "sql", None, B, LEAST_LOAD),
    # every open replica runs it: nothing narrowed, plain least load
    ([load(B, 2, WITH_SQL, ["sql"]), load(C, 1, WITH_SQL, ["sql"])], "sql", None, C, LEAST_LOAD),
    # the base model is served everywhere: least load, prefix affinity as before
    ([load(A, 1, BASE), load(B, 0, WITH_SQL)], "base", None, B, LEAST_LOAD),
    ([load(A, 3, BASE), load(B, 0, WITH_SQL)], "base", A, A, PREFIX_AFFINITY),
    # prefix affinity inside the adapter's replicas
    ([load(A, 0, BASE), load(B, 3, WITH_SQL), load(C, 1, WITH_SQL)], "sql", B, B, ADAPTER_AFFINITY),
    # the one replica serving it is full: saturated (429 after the queue timeout), never a 404 elsewhere
    ([load(A, 0, BASE), load(B, 20, WITH_SQL, max_num_seqs=4)], "sql", None, None, SATURATED),
    # nobody lists it (the router answers 404 before picking): any replica, the engine says 404
    ([load(A, 1, BASE), load(B, 0, BASE)], "nope", None, B, LEAST_LOAD),
])
def test_pick_with_a_model(endpoints, model, affinity, url, reason):
    choice = pick(endpoints, random.Random(0), PickPolicy(max_queue=16, affinity_tolerance=4), affinity, model)
    assert (choice.url, choice.reason) == (url, reason)


def test_the_router_answers_404_only_when_every_list_is_known():
    assert unknown_model([load(A, 0, BASE), load(B, 0, WITH_SQL)], "chat")
    assert not unknown_model([load(A, 0, BASE), load(B, 0, WITH_SQL)], "sql")
    assert not unknown_model([load(A, 0, BASE), load(B, 0, None)], "chat")  # B's list not known: maybe
    assert not unknown_model([], "chat")  # no replica: 503 or the activator, not 404


def test_lora_requests_info_gives_running_and_waiting_adapters_of_the_newest_sample():
    text = (b'# HELP vllm:lora_requests_info Running stats on lora requests.\n'
            b'vllm:lora_requests_info{max_lora="2",running_lora_adapters="sql,org/chat:v2",'
            b'waiting_lora_adapters="x"} 1.7e9\n'
            b'vllm:lora_requests_info{max_lora="2",running_lora_adapters="old",waiting_lora_adapters=""} 1.6e9\n'
            b'iterserve_scheduler_waiting_requests 0\n')
    assert parse_lora_info(text) == {"sql", "org/chat:v2", "x"}
    assert parse_lora_info(b'vllm:lora_requests_info{max_lora="2",running_lora_adapters="",'
                           b'waiting_lora_adapters=""} 1.7e9\n') == frozenset()
    assert parse_lora_info(b"iterserve_scheduler_waiting_requests 0\n") is None  # LoRA off


def test_model_lists_are_read_strictly():
    assert parse_models(b'{"object": "list", "data": [{"id": "base"}, {"id": "sql", "parent": "base"}]}') == WITH_SQL
    for bad in (b"[]", b'{"data": [1]}', b'{"data": {"id": "x"}}', b"not json", b'{"data": []}'):
        with pytest.raises(ValueError):
            parse_models(bad)
