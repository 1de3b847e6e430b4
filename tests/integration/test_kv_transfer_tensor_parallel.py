"""P/D disaggregation between tensor-parallel engines (engine/kv_transfer/sharded.py): `iterserve
serve --tensor-parallel-size 2 --role prefill --kv-transfer-port P` and `--role decode` (real rank
processes over gloo on 127.0.0.1), behind `iterserve router`, on a small random Llama
(tests/tp_models.py: 8 heads, 4 KV heads, so each of two ranks holds the KV of 2):

- rank i of the decode engine pulls shard i from rank i of the prefill engine, whose ranks listen
  on P and P + 1: the completion equals one process's, and the pull moved both ranks' shards (more
  than twice one rank's bytes);
- through the router, one prompt at a time (each a prefix of the next: the decode engine's prefix
  cache holds the earlier ones' blocks, so every rank pulls from the same later block) and all at
  once: completions equal one process's and every prompt's KV moved;
- a decode engine of another size (TP=1, in this process) refuses the lease before any dial,
  naming both sizes, releases it, and answers by computing the prompt itself;
- a pull that fails on rank 1 only (its listener address made unreachable, the params re-signed
  with the InferenceService's key) fails the whole pull on every rank: the prompt is recomputed on
  both, the answer is unchanged, the lease is released, and the next pull works."""

from __future__ import annotations

import pytest

from iterserve.engine import metrics as names
from tests import tp_models
from tests.kv_auth_helpers import run_engine, sign_lease
from tests.sharded_pd import (
    GREEDY,
    assert_router_completions_equal,
    complete,
    engine_pair,
    greedy_texts,
    lease,
    metric,
    one_process,
    reference_prompts,
    router,
    two_node_pair,
    wait_unpinned,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

# One rank's KV per token: 2 of the 4 KV heads x head_dim 16 x (K, V) x 2 layers x 4 bytes (fp32).
RANK_BYTES_PER_TOKEN = 2 * 16 * 2 * 2 * 4


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(tp_models.build("h8kv4", tmp_path_factory.mktemp("pd-tp") / "h8kv4"))


@pytest.fixture(scope="module")
def pd(model, tmp_path_factory):
    """(prefill, decode, the router's URL, the prefill engine's --kv-transfer-port), two ranks each."""
    with engine_pair(model, tmp_path_factory.mktemp("pd-tp-logs"), 2, 1) as (prefill, decode, kv_port), \
            router(prefill, decode) as url:
        yield prefill, decode, url, kv_port


@pytest.fixture(scope="module")
def single(model):
    """One process (TP=1) of role decode: the reference, and a decode engine of another size."""
    engine = one_process(model, "decode")
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def prompts(single):
    return reference_prompts(single)


@pytest.fixture(scope="module")
def expected(single, prompts):
    return greedy_texts(single, prompts)


def test_each_rank_pulls_its_shard_from_the_same_rank_of_the_prefill_engine(pd, prompts, expected):
    prefill, decode, _, kv_port = pd
    params = lease(prefill, prompts[33])
    assert params["port"] == kv_port and params["tensor_parallel_size"] == 2
    assert params["shards"] == [["127.0.0.1", kv_port + 1]]  # rank 1 listens on --kv-transfer-port + 1
    moved = metric(decode, names.KV_TRANSFER_BYTES + "_sum")
    answer = complete(decode.url, prompts[33], kv_transfer_params={**params, "do_remote_prefill": True})
    assert answer["choices"][0]["text"] == expected[33]
    one_rank = len(params["block_ids"]) * 16 * RANK_BYTES_PER_TOKEN
    assert metric(decode, names.KV_TRANSFER_BYTES + "_sum") - moved > 2 * one_rank  # both shards (and headers)
    assert metric(decode, names.KV_TRANSFER_FAILURES_TOTAL) == 0
    wait_unpinned(prefill)


def test_completions_through_the_router_equal_one_process(pd, prompts, expected):
    prefill, decode, url, _ = pd
    assert_router_completions_equal(url, prefill, decode, prompts, expected)


def test_a_decode_engine_of_another_size_refuses_the_lease_and_computes_the_prompt(pd, single, prompts, expected):
    prefill = pd[0]
    params = lease(prefill, prompts[33])
    single.add_request(prompt_token_ids=prompts[33], params=GREEDY, request_id="mismatch",
                       kv_transfer_params={**params, "do_remote_prefill": True})
    seq = single._sequences["mismatch"]
    out = run_engine(single, 120)["mismatch"]
    assert out.error is None and out.outputs[0].text == expected[33]
    assert "the prefill engine runs --tensor-parallel-size 2, this decode engine 1" in seq.kv_transfer.failure
    assert single.stats().kv_pulls_ok == 0
    wait_unpinned(prefill)  # released at once, not left to expire


def test_a_failure_on_one_rank_fails_the_pull_on_every_rank(pd, prompts, expected):
    prefill, decode, url, _ = pd
    failures = metric(decode, names.KV_TRANSFER_FAILURES_TOTAL)
    params = lease(prefill, prompts[17])
    broken = sign_lease({**params, "shards": [[params["shards"][0][0], 1]]})  # rank 1 cannot connect
    answer = complete(decode.url, prompts[17], kv_transfer_params={**broken, "do_remote_prefill": True})
    assert answer["choices"][0]["text"] == expected[17]  # recomputed, on both ranks
    assert metric(decode, names.KV_TRANSFER_FAILURES_TOTAL) == failures + 1
    assert "tensor rank 1: cannot connect" in decode.log()
    wait_unpinned(prefill)
    assert complete(url, prompts[16])["choices"][0]["text"] == expected[16]  # no rank kept anything of it
    assert metric(decode, names.KV_TRANSFER_FAILURES_TOTAL) == failures + 1


def test_groups_of_two_nodes_move_each_ranks_shard_from_its_own_node(model, prompts, expected, tmp_path):
    """--nnodes 2 on both sides (two `iterserve serve` processes each, the store on 127.0.0.1): the
    prefill leader's lease names rank 1's listener as rank 1's node advertises it, and the decode
    group's rank 1 gets its pull order and its load through the store."""
    with two_node_pair(model, tmp_path, 2, 1) as (prefill, decode, kv_port):
        params = lease(prefill, prompts[33])
        assert params["port"] == kv_port and params["shards"] == [["127.0.0.1", kv_port + 1]]
        answer = complete(decode.url, prompts[33], kv_transfer_params={**params, "do_remote_prefill": True})
        assert answer["choices"][0]["text"] == expected[33]
        assert metric(decode, names.KV_TRANSFER_SECONDS + "_count") == 1
        assert metric(decode, names.KV_TRANSFER_FAILURES_TOTAL) == 0
        wait_unpinned(prefill)
