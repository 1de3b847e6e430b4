"""What the P/D tests between sharded engines share (tests/integration/test_kv_transfer_tensor_parallel.py
and test_kv_transfer_pipeline_parallel.py): a prefill and a decode `iterserve serve` group of the
same tensor x pipeline shape on tests/tp_models.py's small random Llama, optionally as two nodes
each, the router in front of them, a one-process reference engine, and the calls and metrics the
tests read."""

from __future__ import annotations

import random
import socket
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from iterserve.devcluster.waiting import free_port, wait_for
from iterserve.engine import metrics as names
from iterserve.engine.config import EngineConfig
from iterserve.engine.llm_engine import LLMEngine
from iterserve.engine.sampling_params import SamplingParams
from tests.kv_auth_helpers import key_file, remote_decode, run_engine
from tests.server_fixture import ServerProcess, iterserve_command

MAX_TOKENS = 8
NUM_BLOCKS = 24
STORY = ("Once upon a time, in a small village at the edge of a great forest, there lived an old clockmaker "
         "who had never once left the valley. Every morning he opened his shop, wound the hundred clocks.")
PROMPT_LENGTHS = (5, 16, 17, 33)  # in this order: each prompt a prefix of the next
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
ENV = {"OMP_NUM_THREADS": "1"}


def free_port_run(count: int) -> int:
    """A port P with P + 1 .. P + count - 1 free too (a prefill engine of `count` ranks listens on all),
    below Linux's ephemeral range (32768-60999), which gloo and every free_port() take ports from:
    one of those once took P + 1 between a probe and rank 1's listen."""
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


def serve_args(model: str, tp: int, pp: int) -> list[str]:
    return ["--model", model, "--tensor-parallel-size", str(tp), "--pipeline-parallel-size", str(pp),
            "--kv-auth-key-file", key_file(), "--device", "cpu", "--dtype", "float32", "--attention-backend",
            "torch", "--num-kv-blocks", str(NUM_BLOCKS), "--max-model-len", "256", "--kv-transfer-timeout", "20"]


@contextmanager
def engine_pair(model: str, logs: Path, tp: int, pp: int) -> Iterator[tuple[ServerProcess, ServerProcess, int]]:
    """(prefill, decode, the prefill engine's --kv-transfer-port): two `iterserve serve` groups of
    tp x pp ranks each, on one node."""
    kv_port = free_port_run(tp * pp)
    common = serve_args(model, tp, pp)
    servers = [ServerProcess([*common, "--role", "prefill", "--kv-transfer-port", str(kv_port)], ENV,
                             logs / f"prefill-tp{tp}-pp{pp}.log"),
               ServerProcess([*common, "--role", "decode"], ENV, logs / f"decode-tp{tp}-pp{pp}.log")]
    try:
        for server in servers:
            server.wait_ready(300)
        yield servers[0], servers[1], kv_port
    finally:
        for server in servers:
            server.stop()


@contextmanager
def two_node_pair(model: str, workdir: Path, tp: int, pp: int) -> Iterator[tuple[ServerProcess, ServerProcess, int]]:
    """engine_pair's groups with --nnodes 2 (two `iterserve serve` processes each, the store on
    127.0.0.1): node 1 of each runs the group's second half of the ranks."""
    kv_port = free_port_run(tp * pp)
    common = [*serve_args(model, tp, pp), "--nnodes", "2", "--master-addr", "127.0.0.1", "--rendezvous-timeout", "240"]
    groups, nodes = [], []
    try:
        for role, extra in (("prefill", ["--kv-transfer-port", str(kv_port)]), ("decode", [])):
            master = ["--master-port", str(free_port())]
            nodes.append(subprocess.Popen(
                [*iterserve_command(), "serve", *common, *master, "--role", role, "--node-rank", "1",
                 "--worker-health-port", str(free_port())], cwd=workdir,
                stdout=(workdir / f"{role}-node1.log").open("wb"), stderr=subprocess.STDOUT))
            groups.append(ServerProcess([*common, *master, "--role", role, "--node-rank", "0", *extra], ENV,
                                        workdir / f"{role}.log"))
        for server in groups:
            server.wait_ready(300)
        yield groups[0], groups[1], kv_port
    finally:
        for server in groups:
            server.stop()
        for node in nodes:
            node.terminate()
            node.wait(30)


@contextmanager
def router(prefill: ServerProcess, decode: ServerProcess) -> Iterator[str]:
    """`iterserve router` sending every prompt to the prefill engine first; yields its URL."""
    port = free_port()
    process = subprocess.Popen([*iterserve_command(), "router", "--port", str(port), "--prefill", prefill.url,
                                "--decode", decode.url, "--pd-threshold-tokens", "0", "--kv-auth-key-file",
                                key_file()], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, cwd="/")
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: _status(f"{url}/health") == 200, 30, 0.1, what="router up")
        yield url
    finally:
        process.terminate()
        process.wait(10)


def one_process(model: str, role: str) -> LLMEngine:
    """One process (TP = PP = 1) of `role`: the reference, and an engine of another size."""
    return LLMEngine.from_config(EngineConfig(
        model=model, role=role, kv_auth_key_file=key_file(), num_kv_blocks=NUM_BLOCKS, max_model_len=256,
        device="cpu", dtype="float32", attention_backend="torch"))


def reference_prompts(engine: LLMEngine) -> dict[int, list[int]]:
    ids = engine.tokenizer.encode(STORY)
    return {n: ids[:n] for n in PROMPT_LENGTHS}


def greedy_texts(engine: LLMEngine, prompts: dict[int, list[int]]) -> dict[int, str]:
    """Each prompt's greedy completion on one process: what every sharded pair must answer."""
    for n, ids in prompts.items():
        engine.add_request(prompt_token_ids=ids, params=GREEDY, request_id=f"ref-{n}")
    return {int(rid.removeprefix("ref-")): out.outputs[0].text for rid, out in run_engine(engine, 120).items()}


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


def assert_router_completions_equal(url: str, prefill: ServerProcess, decode: ServerProcess,
                                    prompts: dict[int, list[int]], expected: dict[int, str]) -> None:
    """Through the router, one prompt at a time (each a prefix of the next: the decode engine's
    prefix cache holds the earlier ones' blocks, so every rank pulls from the same later block) and
    all at once: each completion equals one process's, and every prompt prefilled remotely moved its KV."""
    pulls, remote = metric(decode, names.KV_TRANSFER_SECONDS + "_count"), remote_decisions(url)
    for n, ids in prompts.items():
        assert complete(url, ids)["choices"][0]["text"] == expected[n], n
    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = dict(zip(prompts, pool.map(lambda ids: complete(url, ids), prompts.values()), strict=True))
    for n, answer in answers.items():
        assert answer["choices"][0]["text"] == expected[n], n
    # All of the first round's prompts went remote (the router counts a prompt it saw before as
    # cached on the decode engine, so the second round's may not), and each remote one was a pull.
    assert remote_decisions(url) - remote >= len(prompts)
    assert metric(decode, names.KV_TRANSFER_SECONDS + "_count") - pulls == remote_decisions(url) - remote
    assert metric(decode, names.KV_TRANSFER_FAILURES_TOTAL) == 0
    wait_unpinned(prefill)
