"""--nnodes 2: two `iterserve serve` processes on this machine form one TP=2 group over 127.0.0.1
(engine/distributed/multinode.py), as two pods of a group do over their pod IPs:

- the worker node starts first (its rendezvous waits for the leader), the leader's chat completion
  gives the same greedy tokens as one process, and the worker answers GET /health and /ready on its
  own port and has no API;
- killing the worker node turns the leader's /health to 503, naming the node, and the leader exits 1;
  killing the leader makes the worker node exit 1 with a log line saying the leader is gone;
- a leader whose other node never comes names the missing ranks and node when the rendezvous times out."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from iterserve.engine import LLM, SamplingParams
from iterserve.engine.config import ConfigError, EngineConfig
from tests import tp_models
from tests.server_fixture import free_port, iterserve_command, running_server

MESSAGES = [{"role": "user", "content": "Tell me a story about a clockmaker."}]
NEW_TOKENS = 16
ENGINE = ["--tensor-parallel-size", "2", "--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "32",
          "--max-model-len", "128", "--max-num-seqs", "4"]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(tp_models.build("h8kv4", tmp_path_factory.mktemp("multinode") / "h8kv4"))


def _worker_node(model: str, master_port: int, health_port: int, log: Path) -> subprocess.Popen:
    command = [*iterserve_command(), "serve", "--model", model, *ENGINE, "--nnodes", "2", "--node-rank", "1",
               "--master-addr", "127.0.0.1", "--master-port", str(master_port), "--worker-health-port",
               str(health_port), "--rendezvous-timeout", "240"]
    return subprocess.Popen(command, cwd=log.parent, stdout=log.open("wb"), stderr=subprocess.STDOUT)


def _leader_args(model: str, master_port: int) -> list[str]:
    return ["--model", model, *ENGINE, "--nnodes", "2", "--node-rank", "0", "--master-addr", "127.0.0.1",
            "--master-port", str(master_port), "--rendezvous-timeout", "240"]


def _wait(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def _status(url: str) -> int | None:
    try:
        return httpx.get(url, timeout=2).status_code
    except httpx.HTTPError:
        return None


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _start_group(model: str, tmp_path: Path):
    master_port, health_port = free_port(), free_port()
    worker = _worker_node(model, master_port, health_port, tmp_path / "worker.log")  # first: pods start in any order
    return worker, f"http://127.0.0.1:{health_port}", _leader_args(model, master_port)


@pytest.mark.slow
def test_two_nodes_serve_like_one_process_and_a_killed_worker_ends_the_group(model, tmp_path):
    llm = LLM(model=model, device="cpu", dtype="float32", num_kv_blocks=32, max_model_len=128)
    try:
        reference = llm.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True),
                             use_tqdm=False)[0].outputs[0].text
    finally:
        llm.engine.close()
    worker, health, leader_args = _start_group(model, tmp_path)
    try:
        assert _status(f"{health}/health") in (None, 200)
        with running_server(leader_args, log_path=tmp_path / "leader.log", ready_timeout=240) as leader:
            _wait(lambda: _status(f"{health}/ready") == 200, 30, "the worker node never became ready")
            assert _status(f"{health}/v1/models") == 404  # no API on a worker node
            reply = httpx.post(f"{leader.url}/v1/chat/completions", timeout=120, json={
                "model": Path(model).name, "messages": MESSAGES, "temperature": 0, "max_tokens": NEW_TOKENS,
                "ignore_eos": True})
            assert reply.status_code == 200, reply.text
            assert reply.json()["choices"][0]["message"]["content"] == reference
            ranks = _children(worker.pid)
            assert len(ranks) == 1, ranks
            worker.send_signal(signal.SIGKILL)  # the pod is gone: its rank dies with it
            _wait(lambda: _status(f"{leader.url}/health") in (503, None), 30, "the leader's /health stayed 200")
            _wait(lambda: leader.proc.poll() is not None, 30, "the leader did not exit")
            assert leader.proc.returncode == 1
            _wait(lambda: not any(Path(f"/proc/{pid}").exists() for pid in ranks), 10, "the worker's rank lived on")
        log = (tmp_path / "leader.log").read_text()
        assert "node 1 (ranks 1..1) sent no heartbeat" in log, log[-3000:]
    finally:
        worker.kill()
        worker.wait()


@pytest.mark.slow
def test_a_worker_node_that_loses_the_leader_exits_1(model, tmp_path):
    worker, health, leader_args = _start_group(model, tmp_path)
    try:
        with running_server(leader_args, log_path=tmp_path / "leader.log", ready_timeout=240) as leader:
            _wait(lambda: _status(f"{health}/ready") == 200, 30, "the worker node never became ready")
            os.kill(leader.proc.pid, signal.SIGKILL)
            started = time.monotonic()
            worker.wait(30)
            assert worker.returncode == 1
            assert time.monotonic() - started < 30
    finally:
        worker.kill()
        worker.wait()
    log = (tmp_path / "worker.log").read_text()
    assert "the leader is gone" in log or "the group is broken" in log, log[-3000:]


def test_a_missing_node_is_named_when_the_rendezvous_times_out(model):
    with pytest.raises(ConfigError, match=r"ranks \[1\] \(node 1\) of 2 did not join within --rendezvous-timeout"):
        LLM(model=model, tensor_parallel_size=2, nnodes=2, master_port=free_port(), rendezvous_timeout=2,
            device="cpu", dtype="float32", num_kv_blocks=32, max_model_len=128)


def test_node_options_are_checked():
    with pytest.raises(ConfigError, match=r"--nnodes 3 does not divide the 2 ranks"):
        EngineConfig(tensor_parallel_size=2, nnodes=3).resolve()
    with pytest.raises(ConfigError, match=r"--node-rank must be in 0..1"):
        EngineConfig(tensor_parallel_size=2, nnodes=2, node_rank=2).resolve()
    with pytest.raises(ConfigError, match=r"--nnodes 2 needs more than one rank"):
        EngineConfig(nnodes=2).resolve()
