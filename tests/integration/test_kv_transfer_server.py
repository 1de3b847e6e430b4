"""`iterserve serve --role prefill` and `--role decode` as real processes (fake model): the prefill
call's answer carries kv_transfer_params, the decode call pulls the KV over TCP and answers as a
plain engine would (completions and streamed chat); /metrics shows the transfer and the lease
coming and going; an unpulled lease expires on an idle server; role and shape refusals are 400s
naming the field; a draining prefill engine waits for its lease to be pulled before it exits. The router's P/D path is tested in test_disaggregation*.py."""

from __future__ import annotations

import json
import signal
import time

import httpx
import pytest

from iterserve.engine import metrics as names
from tests.server_fixture import running_server

PROMPT = "the quick brown fox jumps over the lazy dog " * 4  # 176 fake tokens: 11 blocks of 16


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=30)


@pytest.mark.slow
def test_prefill_then_decode_over_http_with_metrics_and_lease_expiry():
    with (running_server(["--fake-model", "--role", "prefill", "--kv-lease-seconds", "5"]) as prefill,
          running_server(["--fake-model", "--role", "decode"]) as decode):
        both = decode  # a decode engine serves plain requests too: the reference answers
        plain = post(both, "/v1/completions", {"prompt": PROMPT, "max_tokens": 10, "temperature": 0})
        assert "kv_transfer_params" not in plain.json()

        first = post(prefill, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "stream": False, "n": 1,
                                                 "kv_transfer_params": {"do_remote_decode": True}})
        assert first.status_code == 200, first.text
        params = first.json()["kv_transfer_params"]
        assert set(params) == {"transfer_id", "engine_id", "host", "port", "block_ids", "num_tokens", "block_size",
                               "compat_hash", "lease_expires_at"}
        assert params["num_tokens"] == 176 and len(params["block_ids"]) == 11 and params["host"] == "127.0.0.1"
        assert 0 < params["lease_expires_at"] - time.time() <= 5
        assert prefill.metrics()[names.KV_PINNED_BLOCKS] == 11

        second = post(decode, "/v1/completions", {"prompt": PROMPT, "max_tokens": 10, "temperature": 0,
                                                  "kv_transfer_params": {**params, "do_remote_prefill": True}})
        assert second.status_code == 200, second.text
        assert second.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]
        assert "kv_transfer_params" not in second.json()
        m = decode.metrics()
        assert m[f"{names.KV_TRANSFER_SECONDS}_count"] == 1 and m[f"{names.KV_TRANSFER_BYTES}_sum"] > 11 * 16 * 4
        assert m[names.KV_TRANSFER_FAILURES_TOTAL] == 0 and m[names.WAITING_FOR_KV_REQUESTS] == 0
        prefill.wait_metric(names.KV_PINNED_BLOCKS, lambda v: v == 0)  # released by the decode engine
        assert prefill.metrics()[names.KV_TRANSFER_EXPIRED_TOTAL] == 0

        # A streamed chat decode call; a prefill of the same messages first.
        chat = {"messages": [{"role": "user", "content": "tell me a story"}], "max_tokens": 6, "temperature": 0}
        leased = post(prefill, "/v1/chat/completions", {**chat, "max_tokens": 1,
                                                        "kv_transfer_params": {"do_remote_decode": True}})
        kv = {**leased.json()["kv_transfer_params"], "do_remote_prefill": True}
        streamed = post(decode, "/v1/chat/completions", {**chat, "stream": True, "kv_transfer_params": kv})
        events = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
        text = "".join(e["choices"][0]["delta"].get("content", "") for e in events)
        assert text == post(both, "/v1/chat/completions", chat).json()["choices"][0]["message"]["content"]
        assert decode.metrics()[f"{names.KV_TRANSFER_SECONDS}_count"] == 2

        # A lease nobody pulls expires on an idle prefill server; a pull after that recomputes.
        late = post(prefill, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1,
                                                 "kv_transfer_params": {"do_remote_decode": True}})
        assert prefill.metrics()[names.KV_PINNED_BLOCKS] == 11
        prefill.wait_metric(names.KV_TRANSFER_EXPIRED_TOTAL, lambda v: v == 1, timeout=15)
        assert prefill.metrics()[names.KV_PINNED_BLOCKS] == 0
        after = post(decode, "/v1/completions", {"prompt": PROMPT, "max_tokens": 10, "temperature": 0,
                                                 "kv_transfer_params": {**late.json()["kv_transfer_params"],
                                                                        "do_remote_prefill": True}})
        assert after.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]
        assert decode.metrics()[names.KV_TRANSFER_FAILURES_TOTAL] == 1
        for server in (prefill, decode):
            assert server.metrics()[names.KV_CACHE_USAGE] == 0.0

        # Refusals, each naming its field.
        def refused(server, path, body, param):
            response = post(server, path, body)
            assert response.status_code == 400, response.text
            assert response.json()["error"]["param"] == param, response.text
            return response.json()["error"]["message"]

        assert "--role decode" in refused(decode, "/v1/completions", {"prompt": "x", "max_tokens": 1,
                                          "kv_transfer_params": {"do_remote_decode": True}},
                                          "kv_transfer_params.do_remote_decode")
        assert "--role prefill" in refused(prefill, "/v1/completions", {"prompt": "x", "kv_transfer_params": kv},
                                           "kv_transfer_params.do_remote_prefill")
        refused(prefill, "/v1/completions", {"prompt": "x", "stream": True,
                                             "kv_transfer_params": {"do_remote_decode": True}}, "stream")
        refused(prefill, "/v1/completions", {"prompt": "x", "n": 2, "kv_transfer_params": {"do_remote_decode": True}},
                "kv_transfer_params")
        refused(decode, "/v1/completions", {"prompt": "x", "kv_transfer_params": {**kv, "port": "80"}},
                "kv_transfer_params.port")
        refused(decode, "/v1/completions", {"prompt": "x", "kv_transfer_params": [1]}, "kv_transfer_params")

        # A draining prefill engine keeps its leases until they are pulled, then exits.
        lease = post(prefill, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1,
                                                  "kv_transfer_params": {"do_remote_decode": True}})
        prefill.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert prefill.proc.poll() is None, "the prefill engine exited with a lease unpulled"
        failures = decode.metrics()[names.KV_TRANSFER_FAILURES_TOTAL]
        pulled = post(decode, "/v1/completions", {"prompt": PROMPT, "max_tokens": 10, "temperature": 0,
                                                  "kv_transfer_params": {**lease.json()["kv_transfer_params"],
                                                                         "do_remote_prefill": True}})
        assert pulled.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]
        assert decode.metrics()[names.KV_TRANSFER_FAILURES_TOTAL] == failures
        assert prefill.proc.wait(60) == 0


def test_serve_refuses_contradictory_kv_flags():
    import subprocess

    from tests.server_fixture import iterserve_command

    for flags, message in ((["--role", "decoder"], "invalid choice"),
                           (["--kv-lease-seconds", "0"], "--kv-lease-seconds must be above 0"),
                           (["--kv-transfer-port", "70000"], "--kv-transfer-port must be in 0..65535"),
                           (["--role", "prefill", "--scheduling", "static"], "needs --scheduling continuous")):
        result = subprocess.run([*iterserve_command(), "serve", "--fake-model", *flags], capture_output=True,
                                text=True, timeout=60, cwd="/")
        assert result.returncode == 2, (flags, result.stderr)
        assert message in result.stderr, (flags, result.stderr)
