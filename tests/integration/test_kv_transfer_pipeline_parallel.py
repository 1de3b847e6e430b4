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

import random
import socket
import subprocess
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from iterserve.devcluster.waiting import free_port, wait_for
from iterserve.engine import metrics as names
from iterserve.engine.config import EngineConfig
from iterserve.engine.llm_engine import LLMEngine
from iterserve.engine.sampling_params import SamplingParams
from tests import tp_models
from tests.kv_auth_helpers import key_file, remote_decode, run_engine, sign_lease
from tests.server_fixture import ServerProcess, iterserve_command

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

MAX_TOKENS = 8
NUM_BLOCKS = 24
STORY = ("Once upon a time, in a small village at the edge of a great forest, there lived an old clockmaker "
         "who had never once left the valley. Every morning he opened his shop, wound the hundred clocks.")
# One stage's KV per token: 1 of the 2 layers x 4 KV heads x head_dim 16 x (K, V) x 4 bytes (fp32).
STAGE_BYTES_PER_TOKEN = 1 * 4 * 16 * 2 * 4
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(tp_models.build("h8kv4", tmp_path_factory.mktemp("pd-pp") / "h8kv4"))


def free_port_run(count: int) -> int:
    """A port P with P + 1 .. P + count - 1 free too (a prefill engine of `count` ranks listens on all),
    below Linux's ephemeral range (32768-60999), which gloo and every free_port() take ports from."""
    rng = random.Random()
    for _ in range(200):
        first = rng.randrange(20000, 32000)
        try:
            for port in range(first, first + count):
                with socket.socket() as probe:
                    probe.bind(("127.0.0.1", port))
        except OSError:
            continue
        return first
    raise RuntimeError(f"no {count} consecutive free ports")


@contextmanager
def engine_pair(model: str, logs: Path, tp: int, pp: int):
    """(prefill, decode, the prefill engine's --kv-transfer-port): two `iterserve serve` groups of
    tp x pp ranks each."""
    kv_port = free_port_run(tp * pp)
    common = ["--model", model, "--tensor-parallel-size", str(tp), "--pipeline-parallel-size", str(pp),
              "--kv-auth-key-file", key_file(), "--device", "cpu", "--dtype", "float32", "--attention-backend",
              "torch", "--num-kv-blocks", str(NUM_BLOCKS), "--max-model-len", "256", "--kv-transfer-timeout", "20"]
    env = {"OMP_NUM_THREADS": "1"}
    servers = [ServerProcess([*common, "--role", "prefill", "--kv-transfer-port", str(kv_port)], env,
                             logs / f"prefill-tp{tp}-pp{pp}.log"),
               ServerProcess([*common, "--role", "decode"], env, logs / f"decode-tp{tp}-pp{pp}.log")]
    try:
        for server in servers:
            server.wait_ready(300)
        yield servers[0], servers[1], kv_port
    finally:
        for server in servers:
            server.stop()


@pytest.fixture(scope="module")
def pd(model, tmp_path_factory):
    """(prefill, decode, the router's URL, the prefill engine's --kv-transfer-port), two stages each."""
    with engine_pair(model, tmp_path_factory.mktemp("pd-pp-logs"), 1, 2) as (prefill, decode, kv_port):
        port = free_port()
        router = subprocess.Popen([*iterserve_command(), "router", "--port", str(port), "--prefill", prefill.url,
                                   "--decode", decode.url, "--pd-threshold-tokens", "0", "--kv-auth-key-file",
                                   key_file()], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, cwd="/")
        try:
            url = f"http://127.0.0.1:{port}"
            wait_for(lambda: _status(f"{url}/health") == 200, 30, 0.1, what="router up")
            yield prefill, decode, url, kv_port
        finally:
            router.terminate()
            router.wait(10)


def one_process(model: str, role: str) -> LLMEngine:
    return LLMEngine.from_config(EngineConfig(
        model=model, role=role, kv_auth_key_file=key_file(), num_kv_blocks=NUM_BLOCKS, max_model_len=256,
        device="cpu", dtype="float32", attention_backend="torch"))


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
    ids = single.tokenizer.encode(STORY)
    return {n: ids[:n] for n in (5, 16, 17, 33)}  # in this order: each a prefix of the next


@pytest.fixture(scope="module")
def expected(single, prompts):
    for n, ids in prompts.items():
        single.add_request(prompt_token_ids=ids, params=GREEDY, request_id=f"ref-{n}")
    return {int(rid.removeprefix("ref-")): out.outputs[0].text for rid, out in run_engine(single, 120).items()}


def _status(url: str) -> int | None:
    try:
        return httpx.get(url, timeout=2).status_code
    except httpx.HTTPError:
        return None


def complete(url: str, prompt: list[int], **extra) -> dict:
    answer = httpx.post(f"{url}/v1/completions", timeout=120, json={
        "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, **extra})
    assert answer.status_code == 200, answer.text
    return answer.json()


def lease(prefill: ServerProcess, prompt: list[int]) -> dict:
    """The prefill engine's kv_transfer_params for prompt (a prefill call, as the router signs it)."""
    return complete(prefill.url, prompt, max_tokens=1, kv_transfer_params=remote_decode())["kv_transfer_params"]


def local_lease(prefill: LLMEngine, prompt: list[int], request_id: str) -> dict:
    prefill.add_request(prompt_token_ids=prompt, params=SamplingParams(temperature=0, max_tokens=1),
                        request_id=request_id, kv_transfer_params=remote_decode())
    return run_engine(prefill, 120)[request_id].kv_transfer_params


def remote_decisions(url: str) -> float:
    """The router's prompts sent to the prefill engine."""
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name == names.ROUTER_PD_DECISIONS_TOTAL and sample.labels.get("reason") == "remote":
                return sample.value
    return 0.0


def metric(server: ServerProcess, name: str) -> float:
    return server.metrics().get(name, 0.0)


def wait_unpinned(prefill: ServerProcess) -> None:
    """Every lease released (not left to expire) and its blocks freed."""
    wait_for(lambda: metric(prefill, names.KV_PINNED_BLOCKS) == 0, 10, 0.05, what="the prefill engine's leases freed")


def full_log(server: ServerProcess) -> str:
    return server.log_path.read_text(errors="replace")


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
    pulls, remote = metric(decode, names.KV_TRANSFER_SECONDS + "_count"), remote_decisions(url)
    for n, ids in prompts.items():
        assert complete(url, ids)["choices"][0]["text"] == expected[n], n
    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = dict(zip(prompts, pool.map(lambda ids: complete(url, ids), prompts.values()), strict=True))
    for n, answer in answers.items():
        assert answer["choices"][0]["text"] == expected[n], n
    # Every prompt the router prefilled remotely moved its KV: all of the first round's (the router
    # counts a prompt it saw before as cached on the decode engine, so the second round's may not).
    assert remote_decisions(url) - remote >= len(prompts)
    assert metric(decode, names.KV_TRANSFER_SECONDS + "_count") - pulls == remote_decisions(url) - remote
    assert metric(decode, names.KV_TRANSFER_FAILURES_TOTAL) == 0
    wait_unpinned(prefill)


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
    kv_port = free_port_run(2)
    common = ["--model", model, "--pipeline-parallel-size", "2", "--kv-auth-key-file", key_file(), "--device", "cpu",
              "--dtype", "float32", "--attention-backend", "torch", "--num-kv-blocks", str(NUM_BLOCKS),
              "--max-model-len", "256", "--kv-transfer-timeout", "20", "--nnodes", "2", "--master-addr", "127.0.0.1",
              "--rendezvous-timeout", "240"]
    groups, nodes = [], []
    try:
        for role, extra in (("prefill", ["--kv-transfer-port", str(kv_port)]), ("decode", [])):
            master = ["--master-port", str(free_port())]
            nodes.append(subprocess.Popen(
                [*iterserve_command(), "serve", *common, *master, "--role", role, "--node-rank", "1",
                 "--worker-health-port", str(free_port())], cwd=tmp_path,
                stdout=(tmp_path / f"{role}-node1.log").open("wb"), stderr=subprocess.STDOUT))
            groups.append(ServerProcess([*common, *master, "--role", role, "--node-rank", "0", *extra],
                                        {"OMP_NUM_THREADS": "1"}, tmp_path / f"{role}.log"))
        for server in groups:
            server.wait_ready(300)
        prefill, decode = groups
        params = lease(prefill, prompts[33])
        assert params["pipeline_parallel_size"] == 2 and params["shards"] == [["127.0.0.1", kv_port + 1]]
        answer = complete(decode.url, prompts[33], kv_transfer_params={**params, "do_remote_prefill": True})
        assert answer["choices"][0]["text"] == expected[33]
        assert metric(decode, names.KV_TRANSFER_SECONDS + "_count") == 1
        assert metric(decode, names.KV_TRANSFER_FAILURES_TOTAL) == 0
        wait_unpinned(prefill)
    finally:
        for server in groups:
            server.stop()
        for node in nodes:
            node.terminate()
            node.wait(30)
