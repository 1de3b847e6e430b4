"""Property-based fuzzing of the server's own OpenAPI document: whatever a client sends, no 5xx.

It runs against the fake model and against the real embedded one, whose sampler sees every
sampling field drawn over its whole declared range (temperature 0..2, seeds over the generator's
range, top_k up to 2**31 - 1...): a value the API accepts must never fail the engine, and fails a
request only where the request's own input leaves no token to draw (a 400 naming the field).

(Schemathesis' pytest plugin does not run under this pytest, so each operation's strategy is
driven by hypothesis directly.)"""

from __future__ import annotations

import itertools
import re

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.generation.modes import GenerationMode

from tests.server_fixture import running_server

pytestmark = pytest.mark.slow
EXAMPLES = {GenerationMode.POSITIVE: 30, GenerationMode.NEGATIVE: 20}  # per operation
VOCAB = 49152  # SmolLM2's
REAL_EXAMPLES = {GenerationMode.POSITIVE: 15, GenerationMode.NEGATIVE: 5}
MIN_SAMPLED, MAX_TOP_UPS = 10, 4  # generated requests that must reach the real sampler


@pytest.fixture(scope="module")
def fake_server(tmp_path_factory):
    log = tmp_path_factory.mktemp("schemathesis") / "server.log"
    # A short context keeps generated requests quick.
    with running_server(["--fake-model", "--max-model-len", "96", "--max-num-batched-tokens", "128"],
                        log_path=log) as server:
        yield server


@pytest.fixture(scope="module")
def real_server(tmp_path_factory):
    log = tmp_path_factory.mktemp("schemathesis-real") / "server.log"
    # A short context keeps each generated request to a few model steps.
    with running_server(["--max-model-len", "64", "--max-num-batched-tokens", "64"], log_path=log,
                        ready_timeout=300) as server:
        yield server


def test_no_input_makes_the_server_fail(fake_server):
    schema = schemathesis.openapi.from_url(f"{fake_server.url}/openapi.json")
    # Draining is meant to answer every later request with 503, so it is left out.
    operations = [result.ok() for result in schema.exclude(path="/admin/drain").get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/admin/config"}
    for operation, (mode, examples) in itertools.product(operations, EXAMPLES.items()):
        if mode is GenerationMode.NEGATIVE and not list(operation.body):
            continue  # nothing to get wrong

        @given(case=operation.as_strategy(mode))
        @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def no_server_error(case):
            case.call_and_validate(checks=[not_a_server_error], timeout=30)

        no_server_error()


def reaching_the_sampler(body: dict) -> dict:
    """A generated valid request, kept valid for this server so that it reaches the sampler: the
    served model, a short generation, token ids inside the vocabulary, and integers written as
    integers (JSON Schema counts 3.0 as an integer; the strict API does not). The sampling fields
    keep the values drawn over their whole range."""

    def integral(value):
        if isinstance(value, float) and value.is_integer() and abs(value) < 2**63:
            return int(value)
        if isinstance(value, list):
            return [integral(v) for v in value]
        if isinstance(value, dict):
            return {k: integral(v) for k, v in value.items()}
        return value

    body = integral(body)
    for field in ("model", "n", "presence_penalty", "frequency_penalty"):
        body.pop(field, None)  # fields with one accepted value
    for field in ("max_tokens", "max_completion_tokens"):
        if isinstance(body.get(field), int):
            body[field] = min(body[field], 4)
    prompt = body.get("prompt")
    if prompt == "" or prompt == [""]:
        body["prompt"] = "hi"
    elif isinstance(prompt, list) and prompt and isinstance(prompt[0], int | list):
        ids = prompt[0] if isinstance(prompt[0], list) else prompt
        body["prompt"] = [t % VOCAB for t in ids][:32]
    return body


def fuzz_real_model(operation, mode: GenerationMode, examples: int) -> None:
    @given(case=operation.as_strategy(mode))
    @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    def no_server_error(case):
        if mode is GenerationMode.POSITIVE and isinstance(case.body, dict):
            case.body = reaching_the_sampler(case.body)
        case.call_and_validate(checks=[not_a_server_error], timeout=60)

    no_server_error()


def test_no_input_makes_the_real_model_fail(real_server):
    schema = schemathesis.openapi.from_url(f"{real_server.url}/openapi.json")
    operations = [result.ok() for result in schema.include(path_regex="^/v1/(chat/)?completions$").get_all_operations()]
    assert {op.path for op in operations} == {"/v1/completions", "/v1/chat/completions"}
    for operation, (mode, examples) in itertools.product(operations, REAL_EXAMPLES.items()):
        fuzz_real_model(operation, mode, examples)
    # How many generated requests pass validation varies from run to run (8 of 30 in one CI run):
    # top up with more valid ones until enough have reached the sampler.
    for _ in range(MAX_TOP_UPS):
        if finished_requests(real_server) >= MIN_SAMPLED:
            break
        for operation in operations:
            fuzz_real_model(operation, GenerationMode.POSITIVE, REAL_EXAMPLES[GenerationMode.POSITIVE])
    # Still alive and serving: no request took the engine down.
    assert httpx.get(f"{real_server.url}/health").status_code == 200
    response = httpx.post(f"{real_server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
    assert response.status_code == 200, response.text
    log = real_server.log()
    assert "sampling failed" not in log
    # Enough generated requests passed validation to have reached the real sampler.
    metrics = real_server.metrics()
    finished = {reason: metrics.get(f'llm_requests_total{{finished_reason="{reason}",model_name="smollm2-135m"}}', 0)
                for reason in ("stop", "length", "abort", "error")}
    assert finished["stop"] + finished["length"] >= MIN_SAMPLED, finished
    # A request may end in an error only through its own input, named in its 400 (a drawn
    # guided_choice the vocabulary cannot spell, a grammar with min_tokens that leaves no token):
    # never through a failure of the engine's.
    server_faults = re.findall(r"request \S+ failed and was finished with an error: .*", log)
    input_faults = re.findall(r"request \S+ was finished with an error in its \w+: .*", log)
    assert not server_faults, server_faults
    assert finished["error"] == len(input_faults), (finished, input_faults)


def finished_requests(server) -> float:
    metrics = server.metrics()
    return sum(metrics.get(f'llm_requests_total{{finished_reason="{reason}",model_name="smollm2-135m"}}', 0)
               for reason in ("stop", "length"))
