"""The router's P/D path: the pure decision and body shaping (tables), and the router in front of
small stub prefill and decode servers (real sockets, one event loop): which bodies each side gets,
fallbacks on failure, timeout and a busy prefill pool, and a client that leaves mid-prefill.
The same path on the real engines and the embedded model: tests/integration/test_disaggregation.py."""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from iterserve.devcluster.waiting import free_port
from iterserve.engine import metrics as names
from iterserve.engine.kv_transfer import auth
from iterserve.router import disagg
from iterserve.router.discovery import ROLE_LABEL, ready_pools, ready_urls
from iterserve.router.picking import EndpointLoad
from iterserve.router.proxy import Router, RouterOptions

KV_KEY = b"the-router-and-engines-kv-key-32"

P1, P2 = "http://p1:1", "http://p2:1"


@pytest.mark.parametrize(("uncached", "prefills", "url", "reason"), [
    (None, [EndpointLoad(P1)], None, disagg.UNSUPPORTED),
    (512, [EndpointLoad(P1)], None, disagg.SHORT_PROMPT),  # at the threshold: local
    (513, [EndpointLoad(P1)], P1, disagg.REMOTE),
    (2000, [], None, disagg.NO_PREFILL),
    (2000, [EndpointLoad(P1, routable=False)], None, disagg.NO_PREFILL),
    # the least-loaded prefill replica's queue decides
    (2000, [EndpointLoad(P1, waiting=3, running=1), EndpointLoad(P2, in_flight=2)], P2, disagg.REMOTE),
    (2000, [EndpointLoad(P1, waiting=4, running=0), EndpointLoad(P2, in_flight=5)], None, disagg.PREFILL_BUSY),
    (2000, [EndpointLoad(P1, waiting=2, running=1)], P1, disagg.REMOTE),
])
def test_decide(uncached, prefills, url, reason):
    decision = disagg.decide(uncached, prefills, random.Random(0), disagg.PdPolicy(512, 4))
    assert (decision.prefill, decision.reason) == (url, reason)


def test_decide_threshold_zero_sends_every_prompt_remote():
    assert disagg.decide(1, [EndpointLoad(P1)], random.Random(0), disagg.PdPolicy(0, 4)).reason == disagg.REMOTE


@pytest.mark.parametrize(("path", "body", "kind"), [
    (b"/v1/completions", {"prompt": [1, 2, 3]}, "ids"),
    (b"/v1/completions", {"prompt": [[1, 2, 3]]}, "ids"),
    (b"/v1/completions", {"prompt": "hello"}, "text"),
    (b"/v1/completions", {"prompt": ["hello"]}, "text"),
    (b"/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "messages"),
    (b"/v1/completions", {"prompt": ["a", "b"]}, None),  # batched prompts: one transfer cannot carry them
    (b"/v1/completions", {"prompt": "x", "echo": True}, None),  # the prompt's logprobs need its logits
    (b"/v1/completions", {"prompt": "x", "kv_transfer_params": {}}, None),  # the client drives P/D
    (b"/v1/completions", {"prompt": [True, 2]}, None),
    (b"/v1/chat/completions", {"messages": []}, None),
    (b"/v1/models", {"prompt": "x"}, None),
])
def test_parse_request(path, body, kind):
    parsed = disagg.parse_request(path, json.dumps(body).encode())
    if kind is None:
        assert parsed is None
        return
    _, prompt = parsed
    assert {"ids": prompt.token_ids, "text": prompt.text, "messages": prompt.messages}[kind] is not None


def test_parse_request_refuses_what_is_not_a_json_object():
    assert disagg.parse_request(b"/v1/completions", b"{not json") is None
    assert disagg.parse_request(b"/v1/completions", b"[1, 2]") is None


def test_bodies_follow_the_wire_contract():
    client = {"model": "m", "prompt": [1, 2], "max_tokens": 50, "stream": True, "n": 2, "min_tokens": 5,
              "stream_options": {"include_usage": True}, "temperature": 0, "max_completion_tokens": 9}
    prefill = json.loads(disagg.prefill_body(client, disagg.PdPolicy(auth_key=KV_KEY), now=1000.0))
    kv = prefill.pop("kv_transfer_params")
    assert prefill == {"model": "m", "prompt": [1, 2], "temperature": 0, "max_tokens": 1, "stream": False, "n": 1}
    # Signed with the KV key, valid for a short while only: a prefill engine checks exactly this.
    auth.verify(kv, KV_KEY, auth.REMOTE_DECODE, now=1000.0 + disagg.SIGNED_REQUEST_SECONDS - 1)
    assert kv["do_remote_decode"] is True
    with pytest.raises(auth.KVAuthError, match="expired"):
        auth.verify(kv, KV_KEY, auth.REMOTE_DECODE, now=1000.0 + disagg.SIGNED_REQUEST_SECONDS)
    with pytest.raises(auth.KVAuthError, match="does not match"):
        auth.verify(kv, b"x" * 32, auth.REMOTE_DECODE, now=1000.0)
    with pytest.raises(auth.KVAuthError, match="does not match"):  # a lease answer is not a prefill call
        auth.verify(kv, KV_KEY, auth.REMOTE_PREFILL, now=1000.0)
    params = {"transfer_id": "t", "engine_id": "e", "host": "127.0.0.1", "port": 1, "block_ids": [3],
              "num_tokens": 2, "block_size": 16, "compat_hash": "h", "lease_expires_at": 1.0}
    decode = json.loads(disagg.decode_body(client, params))
    assert decode == {**client, "kv_transfer_params": {**params, "do_remote_prefill": True}}
    assert "kv_transfer_params" not in client  # the client's dict is not changed
    assert disagg.kv_params_of(json.dumps({"choices": [], "kv_transfer_params": params}).encode()) == params
    assert disagg.kv_params_of(b'{"choices": []}') is None
    assert disagg.kv_params_of(b'{"kv_transfer_params": null}') is None
    assert disagg.kv_params_of(b"<html>") is None


def test_surely_short_never_skips_a_long_prompt():
    # a token is at least one byte: only text at most threshold - margin bytes long is surely short
    assert disagg.surely_short(disagg.Prompt(None, "x" * 100, None), 512)
    assert not disagg.surely_short(disagg.Prompt(None, "x" * 500, None), 512)
    assert not disagg.surely_short(disagg.Prompt(None, None, [{"role": "user", "content": "x" * 450}]), 512)


def test_ready_pools_split_pods_by_role_label():
    def pod(ip, role=None, ready=True):
        labels = {ROLE_LABEL: role} if role else {}
        return {"metadata": {"name": ip, "labels": labels},
                "spec": {"containers": [{"ports": [{"name": "http", "containerPort": 8000}]}]},
                "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}

    pods = [pod("127.10.0.1", "prefill"), pod("127.10.0.2", "decode"), pod("127.10.0.3"),
            pod("127.10.0.4", "both"), pod("127.10.0.5", "prefill", ready=False)]
    pools = ready_pools(pods, "http")
    assert pools.prefill == ["http://127.10.0.1:8000"]
    assert pools.serving == ["http://127.10.0.2:8000", "http://127.10.0.3:8000", "http://127.10.0.4:8000"]
    assert len(ready_urls(pods, "http")) == 4  # the role-blind list is unchanged


# -- the router in front of stub engines ------------------------------------------------------------

KV_PARAMS = {"transfer_id": "t1", "engine_id": "prefill-0", "host": "127.0.0.1", "port": 1, "block_ids": [0, 1],
             "num_tokens": 40, "block_size": 16, "compat_hash": "abc", "lease_expires_at": 0.0}


class Stub:
    """A tiny engine: /metrics with the given waiting count, /tokenize (one token per word),
    /v1/completions and /v1/chat/completions (a prefill answer with KV_PARAMS, or a decode answer
    that says whether it got kv_transfer_params, streamed when asked). Records every body."""

    def __init__(self, mode: str = "ok", waiting: int = 0, delay_s: float = 0.0):
        self.mode, self.waiting, self.delay_s = mode, waiting, delay_s
        self.bodies: list[tuple[bytes, dict]] = []
        self.cut = 0  # requests whose client went away before the answer
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"

    async def start(self) -> Stub:
        self.server = web.Server(self._serve, handler_cancellation=True)
        self.listener = await asyncio.get_running_loop().create_server(self.server, "127.0.0.1", self.port)
        return self

    async def _serve(self, request: web.BaseRequest) -> web.StreamResponse:
        body, path = await request.read(), request.path.encode()
        if path == b"/metrics":
            return web.Response(text=f"{names.VLLM_WAITING} {self.waiting}\n")
        request_json = json.loads(body)
        self.bodies.append((path, request_json))
        if path == b"/tokenize":
            text = request_json.get("prompt") or json.dumps(request_json.get("messages"))
            tokens = [sum(map(ord, word)) for word in text.split()]
            return web.json_response({"count": len(tokens), "tokens": tokens})
        if self.delay_s:
            try:
                await asyncio.sleep(self.delay_s)
            except asyncio.CancelledError:  # the router closed the connection
                self.cut += 1
                raise
        if self.mode == "500":
            return web.json_response({"error": {"message": "boom"}}, status=500)
        if self.mode == "noparams":
            return web.json_response({"choices": [{"text": "x"}]})
        if "kv_transfer_params" in request_json and request_json["kv_transfer_params"].get("do_remote_decode"):
            return web.json_response({"choices": [{"text": "x"}], "kv_transfer_params": KV_PARAMS})
        remote = bool(request_json.get("kv_transfer_params"))
        if not request_json.get("stream"):
            return web.json_response({"remote": remote})
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        for i in range(3):
            await response.write(b"data: %s\n\n" % json.dumps({"remote": remote, "i": i}).encode())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    def calls(self, path: bytes = b"/v1/completions") -> list[dict]:
        return [body for p, body in self.bodies if p == path]

    def close(self):
        self.listener.close()


def run(test, **options):
    """Runs test(router_url, router) against a router with the given options (one event loop)."""
    async def main():
        # Generous staleness and scrape timeouts: a loaded machine must not turn a scrape stale.
        router = Router(RouterOptions(port=free_port(), scrape_interval_s=0.05, stale_after_s=60.0,
                                      scrape_timeout_s=30.0, **options))
        await router.start()
        try:
            return await test(f"http://127.0.0.1:{router.port}", router)
        finally:
            await router.close()
    return asyncio.run(main())


async def with_pools(router: Router, prefill: list[Stub], decode: list[Stub]):
    for stub in [*prefill, *decode]:
        await stub.start()
    router.set_prefill_endpoints([s.url for s in prefill])
    router.set_endpoints([s.url for s in decode])
    await until(lambda: all(e.scraped_at is not None for e in [*router.prefills.values(), *router.endpoints.values()]))


async def until(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


def counter(router: Router, name: str, **labels) -> float:
    for family in text_string_to_metric_families(router.metrics.exposition().decode()):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


PD = {"pd": disagg.PdPolicy(threshold_tokens=20, max_prefill_queue=2), "pd_prefill_timeout_s": 20.0}
LONG = {"model": "m", "prompt": list(range(40)), "max_tokens": 3}


def long(i: int) -> dict:
    """A 40-token prompt of its own (no cached prefix shared with another i)."""
    return {**LONG, "prompt": [1000 * (i + 1) + t for t in range(40)]}


def test_long_prompt_is_prefilled_remotely_and_streamed_from_decode():
    async def test(url, router):
        prefill, decode = Stub(), Stub()
        await with_pools(router, [prefill], [decode])
        async with httpx.AsyncClient(timeout=10) as client:
            body = {**LONG, "stream": True, "stream_options": {"include_usage": True}, "min_tokens": 2}
            answer = await client.post(f"{url}/v1/completions", json=body)
        assert answer.status_code == 200
        assert answer.text.count('"remote": true') == 3 and answer.text.endswith("data: [DONE]\n\n")
        [sent] = prefill.calls()
        assert sent == {"model": "m", "prompt": list(range(40)), "max_tokens": 1, "stream": False, "n": 1,
                        "kv_transfer_params": {"do_remote_decode": True}}
        [got] = decode.calls()
        assert got == {**body, "kv_transfer_params": {**KV_PARAMS, "do_remote_prefill": True}}
        assert decode.calls(b"/tokenize") == []  # token ids need no counting
        assert counter(router, names.ROUTER_PD_DECISIONS_TOTAL, reason="remote") == 1
        assert counter(router, names.ROUTER_PD_PREFILL_SECONDS + "_count") == 1
        assert prefill.url not in [e.url for e in router.endpoints.values()]  # never sent a client's request
    run(test, **PD)


def test_short_and_cached_prompts_go_straight_to_decode():
    async def test(url, router):
        prefill, decode = Stub(), Stub()
        await with_pools(router, [prefill], [decode])
        async with httpx.AsyncClient(timeout=10) as client:
            short = {**LONG, "prompt": list(range(20))}  # exactly the threshold: local
            assert (await client.post(f"{url}/v1/completions", json=short)).json() == {"remote": False}
            assert len(prefill.calls()) == 0
            assert (await client.post(f"{url}/v1/completions", json=LONG)).json() == {"remote": True}
            # The same 40-token prompt again: its first two 16-token blocks are cached on that decode
            # replica, 8 tokens are not (under the threshold of 20): local.
            assert (await client.post(f"{url}/v1/completions", json=LONG)).json() == {"remote": False}
        assert len(prefill.calls()) == 1
        assert counter(router, names.ROUTER_PD_DECISIONS_TOTAL, reason="short_prompt") == 2
        assert decode.calls()[0] == short  # unchanged
    run(test, **PD)


def test_text_prompts_are_counted_by_the_decode_replicas_tokenizer():
    async def test(url, router):
        prefill, decode = Stub(), Stub()
        await with_pools(router, [prefill], [decode])
        async with httpx.AsyncClient(timeout=10) as client:
            await client.post(f"{url}/v1/completions", json={"model": "m", "prompt": "word " * 30})
            await client.post(f"{url}/v1/completions", json={"model": "m", "prompt": "w"})  # surely short
            chat = {"model": "m", "messages": [{"role": "user", "content": "word " * 30}]}
            assert (await client.post(f"{url}/v1/chat/completions", json=chat)).json() == {"remote": True}
        assert [c.get("prompt") for c in decode.calls(b"/tokenize")] == ["word " * 30, None]
        assert decode.calls(b"/tokenize")[1]["messages"] == chat["messages"]
        assert [c.get("prompt") for c in prefill.calls()] == ["word " * 30]
        assert len(prefill.calls(b"/v1/chat/completions")) == 1
    run(test, **PD)


@pytest.mark.parametrize(("mode", "delay_s", "reason"), [
    ("500", 0.0, disagg.FALLBACK_STATUS),
    ("noparams", 0.0, disagg.FALLBACK_NO_PARAMS),
    ("ok", 120.0, disagg.FALLBACK_TIMEOUT),
])
def test_failed_prefill_falls_back_to_local_prefill(mode, delay_s, reason):
    async def test(url, router):
        prefill, decode = Stub(mode, delay_s=delay_s), Stub()
        await with_pools(router, [prefill], [decode])
        started = time.monotonic()
        async with httpx.AsyncClient(timeout=10) as client:
            answer = await client.post(f"{url}/v1/completions", json=LONG)
        took = time.monotonic() - started
        assert answer.status_code == 200 and answer.json() == {"remote": False}
        assert decode.calls() == [LONG]  # the client's own body: the decode replica prefills
        assert counter(router, names.ROUTER_PD_FALLBACKS_TOTAL, reason=reason) == 1
        if reason == disagg.FALLBACK_TIMEOUT:
            assert took < 60  # the 2 s prefill timeout, not the stub's 120 s
            await until(lambda: prefill.cut == 1)  # the timed-out prefill call was cut (the engine aborts it)
    run(test, **{**PD, "pd_prefill_timeout_s": 2.0 if reason == disagg.FALLBACK_TIMEOUT else 20.0})


def test_unreachable_prefill_is_ejected_and_falls_back():
    async def test(url, router):
        decode = Stub()
        await decode.start()
        dead = f"http://127.0.0.1:{free_port()}"
        router.set_prefill_endpoints([dead])
        router.set_endpoints([decode.url])
        async with httpx.AsyncClient(timeout=10) as client:
            answers = [await client.post(f"{url}/v1/completions", json=long(i)) for i in range(3)]
        assert [a.json() for a in answers] == [{"remote": False}] * 3
        # ejected (by the scraper or the first call): later requests do not try it
        assert counter(router, names.ROUTER_PD_FALLBACKS_TOTAL, reason="connect") <= 1
        assert counter(router, names.ROUTER_PD_DECISIONS_TOTAL, reason="no_prefill_ready") >= 2
    run(test, **PD)


def test_busy_prefill_pool_means_local_prefill():
    async def test(url, router):
        prefill, decode = Stub(waiting=2), Stub()  # queue 2 = max_prefill_queue
        await with_pools(router, [prefill], [decode])
        async with httpx.AsyncClient(timeout=10) as client:
            assert (await client.post(f"{url}/v1/completions", json=long(1))).json() == {"remote": False}
            prefill.waiting = 1
            await until(lambda: router.prefills[prefill.url].waiting == 1)  # scraped
            assert (await client.post(f"{url}/v1/completions", json=long(2))).json() == {"remote": True}
        assert counter(router, names.ROUTER_PD_DECISIONS_TOTAL, reason="prefill_busy") == 1
    run(test, **PD)


def test_client_gone_during_prefill_cuts_it_and_never_decodes():
    async def test(url, router):
        prefill, decode = Stub(delay_s=120.0), Stub()
        await with_pools(router, [prefill], [decode])
        async with httpx.AsyncClient(timeout=0.3) as client:
            with pytest.raises(httpx.ReadTimeout):
                await client.post(f"{url}/v1/completions", json=LONG)
        await until(lambda: prefill.cut == 1)
        assert decode.calls() == []
        assert router.endpoints[decode.url].in_flight == 0 and router.prefills[prefill.url].in_flight == 0
        async with httpx.AsyncClient(timeout=10) as client:  # the router carries on
            prefill.delay_s = 0
            assert (await client.post(f"{url}/v1/completions", json=LONG)).json() == {"remote": True}
    run(test, **PD)


def test_without_a_prefill_pool_nothing_changes():
    async def test(url, router):
        decode = Stub()
        await with_pools(router, [], [decode])
        async with httpx.AsyncClient(timeout=10) as client:
            assert (await client.post(f"{url}/v1/completions", json=LONG)).json() == {"remote": False}
        assert decode.calls(b"/tokenize") == []
        assert counter(router, names.ROUTER_PD_DECISIONS_TOTAL) == 0
    run(test, **PD)
