"""`iterserve serve` with the embedded SmolLM2-135M, through the real openai client."""

from __future__ import annotations

import openai
import pytest

from tests.server_fixture import running_server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    log = tmp_path_factory.mktemp("real-model") / "server.log"
    # the exact model: under the default (--quantization auto) the chat's first token, a near tie ("The"
    # -1.88, "L" -1.97), flips to "L'Étoile", as it does in llama.cpp (docs/performance.md)
    with running_server(["--max-model-len", "512", "--max-num-seqs", "8", "--quantization", "none"], log_path=log,
                        ready_timeout=300) as server:
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_the_embedded_model_knows_the_capital_of_france(client):
    question = [{"role": "user", "content": "What is the capital of France?"}]
    answer = client.chat.completions.create(model="smollm2-135m", messages=question, temperature=0, max_tokens=30)
    assert "Paris" in answer.choices[0].message.content
    assert answer.choices[0].finish_reason == "stop"  # the chat template's end-of-turn token ended it

    chunks = list(client.chat.completions.create(model="smollm2-135m", messages=question, temperature=0,
                                                 max_tokens=30, stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == answer.choices[0].message.content  # greedy: streaming changes nothing


def test_completion_with_the_embedded_model(client):
    completion = client.completions.create(model="smollm2-135m", prompt="The capital of France is",
                                           temperature=0, max_tokens=5)
    assert completion.usage.completion_tokens == 5 and "Paris" in completion.choices[0].text
