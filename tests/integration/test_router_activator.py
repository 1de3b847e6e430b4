"""The router as the activator, with real processes: at zero ready replicas it holds requests
(bounded), shows the count as a metric, forwards them when a `--fake-model` engine appears, and
answers 503 with Retry-After (OpenAI's error JSON) past its bounds; a streamed answer's first
byte comes only once a replica serves it."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from iterserve.devcluster.waiting import free_port, wait_for
from iterserve.engine import metrics as names
from iterserve.operator.autoscaling.router_source import read_held_requests
from tests.integration.test_router import _status, metric, process, router
from tests.server_fixture import iterserve_command

pytestmark = pytest.mark.slow
BODY = {"model": "fake", "prompt": [101] * 8, "max_tokens": 4, "ignore_eos": True}


def test_requests_at_zero_replicas_wait_for_the_first_replica_and_overflow_gets_503(tmp_path):
    port = free_port()
    engine_url = f"http://127.0.0.1:{port}"
    with router([engine_url], tmp_path, "--hold-timeout", "60", "--hold-max", "3") as (url, _):
        wait_for(lambda: metric(url, names.ROUTER_ENDPOINT_ROUTABLE, endpoint=engine_url) == 0, 10, 0.05,
                 what="the absent replica not routable")
        assert _status(f"{url}/ready") == 200  # the router stays in the Service: requests wait here

        results: dict[str, object] = {}

        def plain(key: str) -> None:
            results[key] = httpx.post(f"{url}/v1/completions", json=BODY, timeout=90)

        def streamed() -> None:
            with httpx.Client(timeout=90) as client, client.stream(
                    "POST", f"{url}/v1/completions", json={**BODY, "stream": True}) as answer:
                chunks = answer.iter_bytes()
                first = next(chunks)
                results["first_byte_at"] = time.monotonic()
                results["stream"] = (answer.status_code, first + b"".join(chunks))

        threads = [threading.Thread(target=plain, args=(k,)) for k in ("a", "b")] + [threading.Thread(target=streamed)]
        for thread in threads:
            thread.start()
        wait_for(lambda: metric(url, names.ROUTER_HELD_REQUESTS) == 3, 20, 0.05, what="three requests held")
        # What the operator's autoscaler reads from the router pods (plus one router that is not there).
        assert asyncio.run(read_held_requests([url, f"http://127.0.0.1:{free_port()}"])) == 3

        overflow = httpx.post(f"{url}/v1/completions", json=BODY, timeout=10)
        assert overflow.status_code == 503 and overflow.headers["retry-after"] == "1"
        assert overflow.json()["error"]["code"] == "hold_queue_full" and "--hold-max" in overflow.json()["error"]["message"]
        assert "stream" not in results and "a" not in results  # nobody has an answer while no replica exists

        started = time.monotonic()
        command = [*iterserve_command(), "serve", "--host", "127.0.0.1", "--port", str(port), "--fake-model"]
        with process(command, tmp_path / "engine.log"):
            for thread in threads:
                thread.join(90)
            assert results["a"].status_code == 200 and results["b"].status_code == 200
            status, body = results["stream"]
            assert status == 200 and body.rstrip().endswith(b"data: [DONE]")
            assert results["first_byte_at"] > started
            assert metric(url, names.ROUTER_HELD_REQUESTS) == 0
            assert metric(url, names.ROUTER_HOLDS_TOTAL, outcome="forwarded") == 3
            assert metric(url, names.ROUTER_HOLDS_TOTAL, outcome="refused_full") == 1


def test_a_request_held_past_the_hold_timeout_gets_503_with_retry_after(tmp_path):
    dead = f"http://127.0.0.1:{free_port()}"
    with router([dead], tmp_path, "--hold-timeout", "0.5") as (url, _):
        started = time.monotonic()
        answer = httpx.post(f"{url}/v1/completions", json=BODY, timeout=10)
        assert time.monotonic() - started >= 0.5
        assert answer.status_code == 503 and answer.headers["retry-after"] == "1"
        error = answer.json()["error"]
        assert error["code"] == "no_ready_replica" and "--hold-timeout" in error["message"]
        assert metric(url, names.ROUTER_HOLDS_TOTAL, outcome="timed_out") == 1
