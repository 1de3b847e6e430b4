"""--tensor-parallel-size through the engine, with real rank processes over gloo on 127.0.0.1
(engine/distributed/tensor_parallel.py):

- greedy: 32 tokens per prompt with chunked prefill (16-token steps), a KV pool small enough to
  preempt, and prefix caching on (two prompts share a 40-token prefix) are the same tokens at
  TP=2 (and TP=4) as in one process, on small random Llamas (tests/tp_models.py: heads and KV
  heads split by 2 and 4; one KV head replicated; biases; a vocabulary not divisible by the ranks)
  and on the embedded SmolLM2 (9 heads, 3 KV heads) at TP=3; the same at PP=2 and TP=2 x PP=2;
- a size that does not divide the heads is refused at start-up, naming both numbers;
- a killed rank ends the group: GET /health answers 503 and the log names the rank (no hang)."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import httpx
import pytest

from iterserve.engine import LLM, SamplingParams
from iterserve.engine.config import ConfigError
from iterserve.engine.model.registry import resolve_model_path
from iterserve.engine.model.tokenizer import Tokenizer
from tests import tp_models
from tests.server_fixture import running_server

NEW_TOKENS = 32


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_gguf(resolve_model_path(None)[0])


@pytest.fixture(scope="module")
def prompts(tokenizer):
    story = ("Once upon a time, in a small village at the edge of a great forest, there lived an old "
             "clockmaker who had never once left the valley. Every morning he opened his shop, wound the "
             "hundred clocks on its walls, and waited for customers who rarely came. One winter day,")
    base = tokenizer.encode(story)
    return [base[:75], base[:40] + tokenizer.encode(" a stranger knocked"), tokenizer.encode("The capital of France is"),
            tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+2?"}]))]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp-engine")
    return {name: tp_models.build(name, root / name) for name in tp_models.MODELS}


def greedy(model: str, prompts, tp: int, new_tokens: int = NEW_TOKENS, pp: int = 1, **options) -> list[list[int]]:
    # 10 blocks x 16 = 160 tokens of KV for four sequences of up to 107 tokens: preemption. Steps of at
    # most 16 tokens are under the default --pipeline-micro-batch-min-tokens: 0 cuts every one, so
    # that PP runs here still go through micro-batches.
    options = dict(num_kv_blocks=10, num_cpu_blocks=32, max_model_len=144, max_num_seqs=4, max_num_batched_tokens=16,
                   enable_prefix_caching=True, device="cpu", attention_backend="torch", dtype="float32",
                   pipeline_micro_batch_min_tokens=0) | options
    llm = LLM(model=model, tensor_parallel_size=tp, pipeline_parallel_size=pp, **options)
    try:
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True),
                               use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]
    finally:
        llm.engine.close()


@pytest.mark.slow
@pytest.mark.parametrize("name,tp,pp,micro", [("h8kv4", 2, 1, None), ("h4kv1", 2, 1, None), ("h8kv4", 4, 1, None),
                                              ("h4kv1", 1, 2, None), ("h8kv4", 1, 2, 3), ("h8kv4", 2, 2, None)])
def test_greedy_tokens_equal_one_process(checkpoints, prompts, name, tp, pp, micro):
    """TP alone, PP alone (two stages of one layer each; two micro-batches per step by default, three
    that cut prompt chunks), and TP=2 x PP=2 (four ranks)."""
    path = str(checkpoints[name])
    one = greedy(path, prompts, 1)
    assert all(len(tokens) == NEW_TOKENS for tokens in one)
    assert greedy(path, prompts, tp, pp=pp, pipeline_micro_batches=micro) == one


@pytest.mark.slow
def test_prompt_logprobs_equal_one_process_through_two_stages(checkpoints, prompts):
    """Prompt logprobs take the pipeline's logits path for every prompt row (not only sampled ones)."""
    def logprobs(pp):
        llm = LLM(model=str(checkpoints["h8kv4"]), pipeline_parallel_size=pp, tensor_parallel_size=pp, device="cpu",
                  attention_backend="torch", dtype="float32", num_kv_blocks=32, max_num_batched_tokens=16,
                  max_num_seqs=4)
        try:
            out = llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2),
                               use_tqdm=False)
            return [[(p.token_id, p.logprob) for p in o.prompt_logprobs if p is not None] for o in out]
        finally:
            llm.engine.close()

    one, four = logprobs(1), logprobs(2)
    assert len(one[0]) == len(prompts[0]) - 1
    for a, b in zip(one, four, strict=True):
        assert [t for t, _ in a] == [t for t, _ in b]
        assert max(abs(x - y) for (_, x), (_, y) in zip(a, b, strict=True)) < 1e-4


@pytest.mark.slow
def test_embedded_smollm2_at_three_ranks(prompts):
    """9 heads and 3 KV heads over 3 ranks; quantization none (TP shards the dense weights)."""
    options = dict(quantization="none", num_kv_blocks=24, max_model_len=256)
    one = greedy("smollm2-135m", prompts[:2], 1, new_tokens=16, **options)
    assert greedy("smollm2-135m", prompts[:2], 3, new_tokens=16, **options) == one


def test_a_size_that_does_not_divide_the_heads_is_refused(checkpoints):
    with pytest.raises(ConfigError, match=r"--tensor-parallel-size 3 does not divide the model's 8 attention heads"):
        LLM(model=str(checkpoints["h8kv4"]), tensor_parallel_size=3, device="cpu", dtype="float32")
    with pytest.raises(ConfigError, match=r"--tensor-parallel-size 2 / --pipeline-parallel-size 1 needs a real model"):
        LLM(model="fake", tensor_parallel_size=2)


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


@pytest.mark.slow
def test_a_killed_rank_ends_the_group_and_health_answers_503(checkpoints, tmp_path):
    log = tmp_path / "serve.log"
    args = ["--model", str(checkpoints["h4kv1"]), "--tensor-parallel-size", "2", "--device", "cpu",
            "--dtype", "float32", "--num-kv-blocks", "32", "--max-model-len", "128"]
    with running_server(args, log_path=log, ready_timeout=180) as server:
        reply = httpx.post(f"{server.url}/v1/completions", timeout=60,
                           json={"prompt": "Hello", "max_tokens": 4, "temperature": 0})
        assert reply.status_code == 200, reply.text
        workers = _children(server.proc.pid)
        assert len(workers) == 1, workers
        os.kill(workers[0], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while httpx.get(f"{server.url}/health", timeout=5).status_code != 503:
            assert time.monotonic() < deadline, "GET /health still answers 200 after a rank died"
            time.sleep(0.2)
        assert "tensor-parallel rank 1" in httpx.get(f"{server.url}/health", timeout=5).text
        reply = httpx.post(f"{server.url}/v1/completions", timeout=60, json={"prompt": "Hello", "max_tokens": 4})
        assert reply.status_code == 503
    assert f"tensor-parallel rank 1 (pid {workers[0]}) exited with code -9" in log.read_text()
