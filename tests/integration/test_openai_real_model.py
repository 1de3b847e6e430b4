"""OpenAI sampling and logprobs on the embedded SmolLM2-135M through `iterserve serve`: sampling penalties match
transformers' generate with the same processors and change the output; logprobs (prompt and
generated) equal transformers' log-softmax on the same GGUF model."""

from __future__ import annotations

import httpx
import pytest
import torch

from tests.server_fixture import ServerProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]  # the model loads twice (server, HF)
PROMPT = "List three colours of the rainbow:\n1. Red\n2."


@pytest.fixture(scope="module")
def started(tmp_path_factory):
    """The server process, loading its model meanwhile (hf loads the other copy on the other core)."""
    log = tmp_path_factory.mktemp("real-model") / "server.log"
    # fp32: transformers' exact parity (--dtype auto picks bf16 where the CPU runs it faster).
    server = ServerProcess(["--max-model-len", "512", "--max-num-seqs", "8", "--device", "cpu", "--dtype", "float32"],
                           {"OMP_NUM_THREADS": "1"}, log)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def server(started):
    started.wait_ready(300)
    return started


@pytest.fixture(scope="module")
def hf(started, hf_smollm):
    """transformers' model and tokenizer on the same GGUF file (tests/hf_fixture.py: loaded once per
    session; if not yet, while the server loads: the tests that use both ask for hf first)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield hf_smollm
    torch.set_num_threads(previous)


def complete(server, **body) -> dict:
    response = httpx.post(f"{server.url}/v1/completions", json={"prompt": PROMPT, "temperature": 0, **body},
                          timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def tokens_of(server, text: str) -> list[int]:
    return httpx.post(f"{server.url}/tokenize", json={"prompt": text}).json()["tokens"]


def test_repetition_penalty_matches_transformers_generate(hf, server):
    model, tokenizer = hf
    ids = torch.tensor([tokenizer.encode(PROMPT)])
    with torch.inference_mode():
        penalized = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=16,
                                   repetition_penalty=1.5, pad_token_id=tokenizer.eos_token_id)[0, ids.shape[1]:]
    ours = complete(server, max_tokens=16, repetition_penalty=1.5, ignore_eos=True)["choices"][0]["text"]
    assert ours == tokenizer.decode(penalized.tolist())
    assert complete(server, max_tokens=16, ignore_eos=True)["choices"][0]["text"] != ours  # the penalty mattered


def test_frequency_presence_bias_and_min_tokens_change_the_output(server):
    plain = complete(server, max_tokens=24, ignore_eos=True)["choices"][0]["text"]
    plain_ids = tokens_of(server, plain)
    repeats = len(plain_ids) - len(set(plain_ids))
    freq = complete(server, max_tokens=24, ignore_eos=True, frequency_penalty=2.0)["choices"][0]["text"]
    freq_ids = tokens_of(server, freq)
    assert freq != plain and len(freq_ids) - len(set(freq_ids)) < repeats
    presence = complete(server, max_tokens=24, ignore_eos=True, presence_penalty=2.0)["choices"][0]["text"]
    assert presence != plain
    forced = tokens_of(server, " banana")[0]
    biased = complete(server, max_tokens=4, logit_bias={str(forced): 100})["choices"][0]
    assert tokens_of(server, biased["text"]) == [forced] * 4
    chat = {"messages": [{"role": "user", "content": "What is 2+2?"}], "temperature": 0, "max_tokens": 60}
    short = httpx.post(f"{server.url}/v1/chat/completions", json=chat, timeout=120).json()
    assert short["choices"][0]["finish_reason"] == "stop" and short["usage"]["completion_tokens"] < 40
    long = httpx.post(f"{server.url}/v1/chat/completions", json={**chat, "min_tokens": 40}, timeout=120).json()
    assert long["usage"]["completion_tokens"] >= 40


LOGPROB_PROMPTS = ["The capital of France is", "def add(a, b):\n    return", "Once upon a time, there was a"]


def test_logprobs_equal_transformers_log_softmax_for_prompt_and_generated_tokens(hf, server):
    model, tokenizer = hf
    for prompt in LOGPROB_PROMPTS:
        ids = tokenizer.encode(prompt)
        body = {"prompt": ids, "max_tokens": 8, "temperature": 0, "logprobs": 3, "echo": True, "ignore_eos": True}
        response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        logprobs = response.json()["choices"][0]["logprobs"]
        token_logprobs = logprobs["token_logprobs"]
        assert len(token_logprobs) == len(ids) + 8 and token_logprobs[0] is None
        # The generated ids: the greedy choice is the top-1 of each generated position.
        with torch.inference_mode():
            full = list(ids)
            for _ in range(8):
                full.append(int(model(torch.tensor([full])).logits[0, -1].argmax()))
            reference = model(torch.tensor([full])).logits[0].float().log_softmax(-1)
        expected = [float(reference[i - 1, full[i]]) for i in range(1, len(full))]
        torch.testing.assert_close(torch.tensor(token_logprobs[1:]), torch.tensor(expected), rtol=0, atol=1e-4)
        # Top-3 per position: the same values as transformers' top-3.
        for i in (1, len(ids), len(full) - 1):
            ours = sorted(logprobs["top_logprobs"][i].values(), reverse=True)[:3]
            torch.testing.assert_close(torch.tensor(ours), reference[i - 1].topk(3).values, rtol=0, atol=1e-4)


def test_chat_logprobs_with_top_logprobs(server):
    chat = {"messages": [{"role": "user", "content": "What is 2+2?"}], "temperature": 0, "max_tokens": 5,
            "logprobs": True, "top_logprobs": 2}
    body = httpx.post(f"{server.url}/v1/chat/completions", json=chat, timeout=120).json()
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == body["usage"]["completion_tokens"]
    assert "".join(entry["token"] for entry in content) == body["choices"][0]["message"]["content"]
    for entry in content:  # greedy: the chosen token is the most likely one
        assert len(entry["top_logprobs"]) == 2 and entry["top_logprobs"][0]["logprob"] == entry["logprob"] <= 0


def prefix_counters(server) -> tuple[float, float]:
    metrics = server.metrics()
    return metrics["llm_prefix_cache_queries_total"], metrics["llm_prefix_cache_hits_total"]


def test_n4_with_a_seed_gives_four_samples_and_prefills_the_prompt_once(server):
    prompt = "Write one sentence about the sea. " * 6  # 48 tokens: three full KV blocks of 16
    prompt_len = len(tokens_of(server, prompt))
    queries, hits = prefix_counters(server)
    body = {"prompt": prompt, "n": 4, "seed": 7, "temperature": 1.0, "max_tokens": 8, "ignore_eos": True}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120).json()
    texts = [c["text"] for c in response["choices"]]
    assert len(set(texts)) == 4, texts
    queries_now, hits_now = prefix_counters(server)
    computed = (queries_now - queries) - (hits_now - hits)
    print(f"n=4, prompt {prompt_len} tokens: {computed:.0f} prompt tokens computed (4 separate prefills: "
          f"{4 * prompt_len})")
    assert computed <= prompt_len + 3 * (prompt_len % 16 or 16)
    again = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120).json()
    assert [c["text"] for c in again["choices"]] == texts  # the seed makes the four reproducible
