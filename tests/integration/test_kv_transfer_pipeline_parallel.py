"""P/D disaggregation between pipeline-parallel engines (engine/kv_transfer/sharded.py): `iterserve
serve --pipeline-parallel-size 2 --role prefill --kv-transfer-port P` and `--role decode` (real rank
processes over gloo on 127.0.0.1), behind `iterserve router`, on a small random Llama
(tests/tp_models.py: 2 layers, so each of two stages holds the KV of one layer, all 4 KV heads):

- rank r of the decode engine pulls its stage's layers from rank r of the prefill engine, whose
  ranks listen on P and P + 1: the completion equals one process's and a TP=1 P/D pair's, and the
  pull moved both stages' KV (more than twice one stage's bytes);
- through the router, one prompt at a time (each a prefix of the next: the decode engine's prefix
  cache holds the earlier ones' blocks, so both stages pull from the same later block) and all at
  once: completions equal one process's and every prompt's KV moved;
- a decode engine of another pipeline size refuses the lease before any dial, naming both sizes,
  releases it, and answers by computing the prompt itself: one stage (in this process) given the
  two-stage lease, and the two-stage engine given a one-stage engine's lease;
- a pull that fails on rank 1 only (stage 1's listener address made unreachable, the params
  re-signed with the InferenceService's key) fails the whole pull on both stages: the prompt is
  recomputed, the answer is unchanged, the lease is released, and the next pull works;
- tensor x pipeline 2 x 2 on both sides: rank r (stage r // 2, tensor rank r % 2) pulls from rank r,
  the lease names the listeners of ranks 1..3, and the completion equals one process's;
- two stages over two nodes on both sides: stage 1's messages go through the rendezvous store."""

from __future__ import annotations

import pytest

from iterserve.devcluster.waiting import wait_for
from iterserve.engine import metrics as names
from tests import tp_models
from tests.kv_auth_helpers import run_engine, sign_lease
from tests.sharded_pd import (
    GREEDY,
    assert_router_completions_equal,
    complete,
    engine_pair,
    full_log,
    greedy_texts,
    lease,
    local_lease,
    metric,
    one_process,
    reference_prompts,
    router,
    two_node_pair,
    wait_unpinned,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

# One stage's KV per token: 1 of the 2 layers x 4 KV heads x head_dim 16 x (K, V) x 4 bytes (fp32).
STAGE_BYTES_PER_TOKEN = 1 * 4 * 16 * 2 * 4


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(tp_models.build("h8kv4", tmp_path_factory.mktemp("pd-pp") / "h8kv4"))


@pytest.fixture(scope="module")
def pd(model, tmp_path_factory):
    """(prefill, decode, the router's URL, the prefill engine's --kv-transfer-port), two stages each."""
    with engine_pair(model, tmp_path_factory.mktemp("pd-pp-logs"), 1, 2) as (prefill, decode, kv_port), \
            router(prefill, decode) as url:
        yield prefill, decode, url, kv_port


@pytest.fixture(scope="module")
def single(model):
    """One process (TP=1, PP=1) of role decode: the reference, and a decode engine of another size."""
    engine = one_process(model, "decode")
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def single_prefill(model):
    """One process of role prefill, listening: the prefill half of a TP=1 P/D pair."""
    engine = one_process(model, "prefill")
    engine.start_kv_transfer()
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def prompts(single):
    return reference_prompts(single)


@pytest.fixture(scope="module")
def expected(single, prompts):
    return greedy_texts(single, prompts)


def test_each_rank_pulls_its_stages_kv_from_the_same_rank_of_the_prefill_engine(pd, single, single_prefill, prompts,
                                                                                expected):
    prefill, decode, _, kv_port = pd
    params = lease(prefill, prompts[33])
    assert params["port"] == kv_port
    assert params["pipeline_parallel_size"] == 2 and params["tensor_parallel_size"] == 1
    assert params["shards"] == [["127.0.0.1", kv_port + 1]]  # rank 1 (stage 1) listens on --kv-transfer-port + 1
    moved = metric(decode, names.KV_TRANSFER_BYTES + "_sum")
    answer = complete(decode.url, prompts[33], kv_transfer_params={**params, "do_remote_prefill": True})
    assert answer["choices"][0]["text"] == expected[33]
    one_stage = len(params["block_ids"]) * 16 * STAGE_BYTES_PER_TOKEN
    assert metric(decode, names.KV_TRANSFER_BYTES + "_sum") - moved > 2 * one_stage  # both stages (and headers)
    assert metric(decode, names.KV_TRANSFER_SECONDS + "_count") == 1
    assert metric(decode, names.KV_TRANSFER_FAILURES_TOTAL) == 0
    wait_unpinned(prefill)
    # The same prompt through a pair of one-process engines gives the same tokens.
    single.add_request(prompt_token_ids=prompts[33], params=GREEDY, request_id="tp1-pd",
                       kv_transfer_params={**local_lease(single_prefill, prompts[33], "tp1-p"),
                                           "do_remote_prefill": True})
    pulls = single.stats().kv_pulls_ok
    assert run_engine(single, 120)["tp1-pd"].outputs[0].text == answer["choices"][0]["text"]
    assert single.stats().kv_pulls_ok == pulls + 1


def test_completions_through_the_router_equal_one_process(pd, prompts, expected):
    prefill, decode, url, _ = pd
    assert_router_completions_equal(url, prefill, decode, prompts, expected)


def test_a_decode_engine_of_another_pipeline_size_refuses_the_lease_and_computes_the_prompt(
        pd, single, single_prefill, prompts, expected):
    prefill, decode, _, _ = pd
    params = lease(prefill, prompts[33])
    single.add_request(prompt_token_ids=prompts[33], params=GREEDY, request_id="mismatch",
                       kv_transfer_params={**params, "do_remote_prefill": True})
    seq = single._sequences["mismatch"]
    pulls = single.stats().kv_pulls_ok
    out = run_engine(single, 120)["mismatch"]
    assert out.error is None and out.outputs[0].text == expected[33]
    assert "the prefill engine runs --pipeline-parallel-size 2, this decode engine 1" in seq.kv_transfer.failure
    assert single.stats().kv_pulls_ok == pulls
    wait_unpinned(prefill)  # released at once, not left to expire

    # The other way: a one-stage engine's lease at the two-stage decode engine.
    failures = metric(decode, names.KV_TRANSFER_FAILURES_TOTAL)
    params = local_lease(single_prefill, prompts[17], "mismatch-p")
    answer = complete(decode.url, prompts[17], kv_transfer_params={**params, "do_remote_prefill": True})
    assert answer["choices"][0]["text"] == expected[17]
    assert metric(decode, names.KV_TRANSFER_FAILURES_TOTAL) == failures + 1
    assert "the prefill engine runs --pipeline-parallel-size 1, this decode engine 2" in full_log(decode)
    wait_for(lambda: (single_prefill.collect_kv_leases(), single_prefill.kv_connector.num_leases)[1] == 0, 10, 0.05,
             what="the one-process prefill engine's lease released")


def test_a_failure_on_one_stage_fails_the_pull_on_every_stage(pd, prompts, expected):
    prefill, decode, url, _ = pd
    failures = metric(decode, names.KV_TRANSFER_FAILURES_TOTAL)
    params = lease(prefill, prompts[17])
    broken = sign_lease({**params, "shards": [[params["shards"][0][0], 1]]})  # rank 1 cannot connect
    answer = complete(decode.url, prompts[17], kv_transfer_params={**broken, "do_remote_prefill": True})
    assert answer["choices"][0]["text"] == expected[17]  # recomputed, on both stages
    assert metric(decode, names.KV_TRANSFER_FAILURES_TOTAL) == failures + 1
    assert "rank 1 (pipeline stage 1, tensor rank 0): cannot connect" in full_log(decode)
    wait_unpinned(prefill)
    assert complete(url, prompts[16])["choices"][0]["text"] == expected[16]  # no rank kept anything of it
    assert metric(decode, names.KV_TRANSFER_FAILURES_TOTAL) == failures + 1


def test_tensor_by_pipeline_groups_move_each_ranks_shard_of_its_stage(model, prompts, expected, tmp_path):
    with engine_pair(model, tmp_path, 2, 2) as (prefill, decode, kv_port):
        params = lease(prefill, prompts[33])
        assert (params["tensor_parallel_size"], params["pipeline_parallel_size"]) == (2, 2)
        assert params["shards"] == [["127.0.0.1", kv_port + rank] for rank in (1, 2, 3)]
        moved = metric(decode, names.KV_TRANSFER_BYTES + "_sum")
        answer = complete(decode.url, prompts[33], kv_transfer_params={**params, "do_remote_prefill": True})
        assert answer["choices"][0]["text"] == expected[33]
        one_rank = len(params["block_ids"]) * 16 * STAGE_BYTES_PER_TOKEN // 2  # half the KV heads of one stage
        assert metric(decode, names.KV_TRANSFER_BYTES + "_sum") - moved > 4 * one_rank  # all four (and headers)
        assert metric(decode, names.KV_TRANSFER_SECONDS + "_count") == 1
        assert metric(decode, names.KV_TRANSFER_FAILURES_TOTAL) == 0
        wait_unpinned(prefill)


def test_groups_of_two_nodes_move_each_stages_kv_from_its_own_node(model, prompts, expected, tmp_path):
    """--pipeline-parallel-size 2 --nnodes 2 on both sides (two `iterserve serve` processes each, the
    store on 127.0.0.1): stage 1 runs on node 1, the prefill leader's lease names its listener as
    node 1 advertises it, and the decode group's stage 1 gets its pull order and its load through
    the store."""
    with two_node_pair(model, tmp_path, 1, 2) as (prefill, decode, kv_port):
        params = lease(prefill, prompts[33])
        assert params["pipeline_parallel_size"] == 2 and params["shards"] == [["127.0.0.1", kv_port + 1]]
        answer = complete(decode.url, prompts[33], kv_transfer_params={**params, "do_remote_prefill": True})
        assert answer["choices"][0]["text"] == expected[33]
        assert metric(decode, names.KV_TRANSFER_SECONDS + "_count") == 1
        assert metric(decode, names.KV_TRANSFER_FAILURES_TOTAL) == 0
        wait_unpinned(prefill)
