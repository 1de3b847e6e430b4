"""Property-based fuzzing of the server's own OpenAPI document: whatever a client sends, no 5xx.

(Schemathesis' pytest plugin does not run under this pytest, so each operation's strategy is
driven by hypothesis directly.)"""

from __future__ import annotations

import itertools

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.generation.modes import GenerationMode

from tests.server_fixture import running_server

pytestmark = pytest.mark.slow
EXAMPLES = {GenerationMode.POSITIVE: 30, GenerationMode.NEGATIVE: 20}  # per operation


@pytest.fixture(scope="module")
def fake_server(tmp_path_factory):
    log = tmp_path_factory.mktemp("schemathesis") / "server.log"
    # A short context keeps generated requests quick.
    with running_server(["--fake-model", "--max-model-len", "96", "--max-num-batched-tokens", "128"],
                        log_path=log) as server:
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
