"""The router's upstream client (iterserve/router/upstream.py) against engines scripted byte by
byte on real sockets on 127.0.0.1: what goes out, the answer framings it relays, and every way
an engine can misbehave (unsolicited bytes, a pooled connection closed under it, a malformed
head, an oversize answer, a caller that leaves). One event loop per test; the router runs in it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import httpx
import pytest

from iterserve.devcluster.waiting import free_port
from iterserve.router import upstream
from iterserve.router.proxy import Router, RouterOptions

OK = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 2\r\n\r\nok"
BODY = b'{"model": "m", "prompt": [1, 2]}'


class Engine:
    """A raw-socket engine: answers the router's scrapes itself; every other request is answered
    by `script(writer, n, head, body)` (n counts requests over all connections, from 0). A script
    may read on with `writer.reader`."""

    def __init__(self, script: Callable[[asyncio.StreamWriter, int, bytes, bytes], Awaitable[None]]):
        self.script = script
        self.requests: list[bytes] = []  # each request as received, head and body
        self.connections = 0  # connections that carried a request other than a scrape
        self.closed = 0  # of those, how many the router closed (EOF seen here)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"

    async def start(self) -> Engine:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)
        return self

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        counted = False
        writer.reader = reader
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                body = await reader.readexactly(length)
                if head.startswith((b"GET /metrics", b"GET /v1/models")):
                    text = b"vllm:num_requests_waiting 0\n" if head.startswith(b"GET /metrics") else b'{"data": []}'
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(text), text))
                    continue
                if not counted:
                    self.connections += 1
                    counted = True
                n = len(self.requests)
                self.requests.append(head + body)
                await self.script(writer, n, head, body)
                if writer.is_closing():
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            if counted:
                self.closed += 1
        finally:
            writer.close()

    def close(self) -> None:
        self.server.close()


def answers(*raw: bytes | None):
    """A script answering request n with raw[n] (the last one for every later request); None
    closes the connection without an answer."""
    async def script(writer, n, head, body):
        data = raw[min(n, len(raw) - 1)]
        if data is None:
            writer.close()
            return
        writer.write(data)
    return script


def run(test, *engines: Engine, **options):
    """Runs test(router_url, router) with a router in front of the engines (one event loop)."""
    async def main():
        router = Router(RouterOptions(port=free_port(), scrape_interval_s=0.05, stale_after_s=60.0,
                                      scrape_timeout_s=30.0, eject_backoff_s=30.0, **options))
        await router.start()
        for engine in engines:
            await engine.start()
        try:
            router.set_endpoints([e.url for e in engines])
            deadline = time.monotonic() + 30
            while not all(e.scraped_at is not None for e in router.endpoints.values()):
                assert time.monotonic() < deadline, "never scraped"
                await asyncio.sleep(0.02)
            async with httpx.AsyncClient(timeout=10) as client:
                return await test(client, f"http://127.0.0.1:{router.port}", router)
        finally:
            await router.close()
            for engine in engines:
                engine.close()
    return asyncio.run(main())


async def until(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


def test_the_request_is_the_clients_with_only_host_and_content_length_added():
    engine = Engine(answers(OK))

    async def test(client, url, router):
        answer = await client.post(f"{url}/v1/completions?x=1", content=BODY, headers={
            "content-type": "application/json", "x-trace": "a b", "connection": "keep-alive, x-hop",
            "x-hop": "dropped", "cookie": "c=1"})
        assert answer.status_code == 200 and answer.text == "ok"
        [sent] = engine.requests
        lines = sent.split(b"\r\n\r\n")[0].split(b"\r\n")
        assert lines[0] == b"POST /v1/completions?x=1 HTTP/1.1"
        assert lines[1] == f"Host: 127.0.0.1:{engine.port}".encode()
        rest = sorted(line.lower() for line in lines[2:])
        # httpx's own headers pass as the client sent them; hop-by-hop ones and x-hop do not
        assert rest == sorted([b"accept: */*", b"accept-encoding: gzip, deflate", b"content-type: application/json",
                               b"user-agent: python-httpx/" + httpx.__version__.encode(), b"x-trace: a b",
                               b"cookie: c=1", b"content-length: %d" % len(BODY)])
        assert sent.endswith(b"\r\n\r\n" + BODY)
    run(test, engine)


@pytest.mark.parametrize("framing", ["length", "chunked", "until-close"])
def test_answers_of_every_framing_stream_through_as_sent(framing):
    events = [b"data: {\"i\": %d}\n\n" % i for i in range(3)] + [b"data: [DONE]\n\n"]

    async def script(writer, n, head, body):
        if framing == "length":
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: %d\r\n\r\n"
                         % sum(map(len, events)))
        else:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n%s\r\n"
                         % (b"transfer-encoding: chunked\r\n" if framing == "chunked" else b"connection: close\r\n"))
        for event in events:
            await asyncio.sleep(0.01)
            writer.write(b"%x\r\n%s\r\n" % (len(event), event) if framing == "chunked" else event)
        if framing == "chunked":
            writer.write(b"0\r\n\r\n")
        if framing == "until-close":
            writer.close()
    engine = Engine(script)

    async def test(client, url, router):
        for _ in range(2):
            async with client.stream("POST", f"{url}/v1/completions", content=BODY) as answer:
                got = [chunk async for chunk in answer.aiter_raw()]
            assert answer.status_code == 200 and b"".join(got) == b"".join(events)
            assert answer.headers["content-type"] == "text/event-stream"
        # kept-alive framings reuse one connection; an answer ended by a close cannot
        assert engine.connections == (2 if framing == "until-close" else 1)
    run(test, engine)


def test_head_and_informational_answers():
    engine = Engine(answers(
        b"HTTP/1.1 200 OK\r\ncontent-length: 42\r\n\r\n",  # HEAD: the length of a body that is not sent
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"))

    async def test(client, url, router):
        answer = await client.head(f"{url}/v1/models")
        assert answer.status_code == 200 and answer.content == b""
        answer = await client.post(f"{url}/v1/completions", content=BODY)
        assert answer.status_code == 200 and answer.text == "ok"
    run(test, engine)


@pytest.mark.parametrize("delay_s", [0.0, 0.2])
def test_a_connection_that_got_unsolicited_bytes_is_never_reused(delay_s):
    # The engine's first answer is followed by a second one nobody asked for: in the same write
    # (delay 0) or while the connection sits idle in the pool (delay 0.2 s). Served to the next
    # request, it would be another user's answer.
    secret = b"HTTP/1.1 200 OK\r\ncontent-length: 6\r\n\r\nSECRET"

    async def script(writer, n, head, body):
        if n == 0:
            writer.write(OK + (secret if not delay_s else b""))
            if delay_s:
                await asyncio.sleep(0.05)
                writer.write(secret)
        else:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nfresh")
    engine = Engine(script)

    async def test(client, url, router):
        assert (await client.post(f"{url}/v1/completions", content=BODY)).text == "ok"
        await asyncio.sleep(delay_s)
        assert [(await client.post(f"{url}/v1/completions", content=BODY)).text for _ in range(3)] == ["fresh"] * 3
        assert engine.connections == 2
    run(test, engine)


def test_a_pooled_connection_the_engine_closed_is_resent_on_a_new_one():
    # The engine closes a kept-alive connection just as the next request goes out on it (its
    # keep-alive timer fired): the request is sent again on a new connection, not failed, and the
    # engine is not ejected.
    async def script(writer, n, head, body):
        if n == 1:
            writer.close()
        else:
            writer.write(OK)
    engine = Engine(script)

    async def test(client, url, router):
        assert (await client.post(f"{url}/v1/completions", content=BODY)).text == "ok"
        assert (await client.post(f"{url}/v1/completions", content=BODY)).text == "ok"
        assert engine.connections == 2 and len(engine.requests) == 3
        assert router.endpoints[engine.url].ejected_until is None
        # _call (the P/D path's calls) does the same
        status, text = await router._call(router.endpoints[engine.url], "/tokenize", b"", BODY)
        assert (status, text) == (200, b"ok")
    run(test, engine)


def test_a_pooled_connection_the_engine_closed_while_idle_is_never_sent_on():
    async def script(writer, n, head, body):
        writer.write(OK)
        await asyncio.sleep(0.05)  # the engine's keep-alive ends
        writer.close()
    engine = Engine(script)

    async def test(client, url, router):
        assert (await client.post(f"{url}/v1/completions", content=BODY)).text == "ok"
        await asyncio.sleep(0.2)
        assert (await client.post(f"{url}/v1/completions", content=BODY)).text == "ok"
        assert engine.connections == 2 and len(engine.requests) == 2  # nothing sent on the closed one
    run(test, engine)


def test_a_new_connection_closed_before_an_answer_ejects_and_goes_to_another_replica():
    dead, alive = Engine(answers(None)), Engine(answers(OK))

    async def test(client, url, router):
        router.endpoints[alive.url].in_flight = 1  # the dead one is picked first
        answer = await client.post(f"{url}/v1/completions", content=BODY)
        assert answer.status_code == 200 and answer.text == "ok"
        assert router.endpoints[dead.url].ejected_until is not None and len(dead.requests) == 1
    run(test, dead, alive)


def test_a_503_goes_to_another_replica_before_the_client_sees_a_byte():
    draining = Engine(answers(b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 8\r\n\r\ndraining"))
    alive = Engine(answers(OK))

    async def test(client, url, router):
        router.endpoints[alive.url].in_flight = 1  # the draining one is picked first
        answer = await client.post(f"{url}/v1/completions", content=BODY)
        assert answer.status_code == 200 and answer.text == "ok"
        assert len(draining.requests) == 1 and router.endpoints[draining.url].ejected_until is None
    run(test, draining, alive)


MALFORMED = {
    "a status line without a code": b"HTTP/1.1 OK\r\ncontent-length: 2\r\n\r\nok",
    "not HTTP at all": b"SSH-2.0-OpenSSH_9.6\r\n\r\n",
    "a bare LF in a header": b"HTTP/1.1 200 OK\r\nx-a: 1\nx-b: 2\r\ncontent-length: 2\r\n\r\nok",
    "obs-fold": b"HTTP/1.1 200 OK\r\nx-a: 1\r\n 2\r\ncontent-length: 2\r\n\r\nok",
    "two Content-Lengths": b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-length: 3\r\n\r\nok",
    "a signed Content-Length": b"HTTP/1.1 200 OK\r\ncontent-length: +2\r\n\r\nok",
    "too many headers": b"HTTP/1.1 200 OK\r\n" + b"x-a: 1\r\n" * 101 + b"content-length: 2\r\n\r\nok",
    "101 Switching Protocols": b"HTTP/1.1 101 Switching Protocols\r\nupgrade: h2c\r\nconnection: upgrade\r\n\r\n",
}


@pytest.mark.parametrize("case", MALFORMED)
def test_a_malformed_answer_head_is_a_502_and_the_connection_is_dropped(case):
    engine = Engine(answers(MALFORMED[case], OK))  # the engine would keep the connection

    async def test(client, url, router):
        answer = await client.post(f"{url}/v1/completions", content=BODY)
        assert answer.status_code == 502 and answer.json()["error"]["code"] == "upstream_malformed"
        await until(lambda: engine.closed == 1)  # the router closed it at once
        assert len(engine.requests) == 1  # not re-sent: the engine may have run it
        assert (await client.post(f"{url}/v1/completions", content=BODY)).text == "ok"
        assert engine.connections == 2
    run(test, engine)


def test_a_failure_mid_answer_aborts_the_clients_connection():
    # A bad chunk size after the head went out: the client must not read a cut answer as whole.
    engine = Engine(answers(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n-1\r\n"))

    async def test(client, url, router):
        with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
            await client.post(f"{url}/v1/completions", content=BODY)
    run(test, engine)


def test_an_oversize_answer_to_a_call_is_refused():
    big = b"x" * 2**20
    engine = Engine(answers(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(big), big),
                            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
                            + (b"10000\r\n" + big[:0x10000] + b"\r\n") * 16 + b"0\r\n\r\n"))

    async def test(client, url, router):
        endpoint = router.endpoints[engine.url]
        with pytest.raises(ValueError, match="over 1024"):  # declared: refused before the body is read
            await router._call(endpoint, "/v1/completions", b"", BODY)
        with pytest.raises(ValueError, match="over 1024"):  # chunked: as the total passes the cap
            await router._call(endpoint, "/v1/completions", b"", BODY)
        await until(lambda: engine.closed == 2)  # the rest is not read: neither connection is kept
        assert engine.connections == 2
    run(test, engine, max_body_bytes=1024)


def test_cancelling_a_call_closes_its_connection():
    async def never(writer, n, head, body):
        await writer.reader.read()  # no answer; returns at EOF
        raise ConnectionResetError
    engine = Engine(never)

    async def test(client, url, router):
        call = asyncio.create_task(router._call(router.endpoints[engine.url], "/v1/completions", b"", BODY))
        await until(lambda: engine.requests)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        await until(lambda: engine.closed == 1, timeout=2.0)  # the engine sees EOF and aborts
        assert router.pool._idle.get(engine.url, []) == []
    run(test, engine)


def test_idle_connections_are_closed_before_the_engines_keep_alive():
    engine = Engine(answers(OK))

    async def test(client, url, router):
        assert (await client.post(f"{url}/v1/completions", content=BODY)).text == "ok"
        await asyncio.sleep(0.05)
        assert (await client.post(f"{url}/v1/completions", content=BODY)).text == "ok"
        assert engine.connections == 1  # reused within max_idle_conn_s
        await until(lambda: engine.closed == 1, timeout=3.0)  # the router closed it once idle that long
        assert (await client.post(f"{url}/v1/completions", content=BODY)).text == "ok"
        assert engine.connections == 2
    run(test, engine, max_idle_conn_s=0.3)


def test_request_bytes():
    assert upstream.request_bytes(b"GET", b"/v1/models", b"h:1", b"a: b\r\n", b"") == \
        b"GET /v1/models HTTP/1.1\r\nHost: h:1\r\na: b\r\n\r\n"
    assert upstream.request_bytes(b"POST", b"/x", b"h:1", b"", b"") == \
        b"POST /x HTTP/1.1\r\nHost: h:1\r\nContent-Length: 0\r\n\r\n"
    assert upstream.request_bytes(b"POST", b"/x", b"h:1", b"", b"{}") == \
        b"POST /x HTTP/1.1\r\nHost: h:1\r\nContent-Length: 2\r\n\r\n{}"


def test_an_unreachable_engine_is_a_connect_failure():
    async def main():
        pool = upstream.Pool(connect_timeout_s=1.0, max_idle_s=1.0)
        with pytest.raises(upstream.ConnectFailed, match="cannot connect"):
            await pool.connection(f"http://127.0.0.1:{free_port()}")
        pool.close()
    asyncio.run(main())


def test_an_answer_faster_than_its_reader_is_buffered_only_up_to_the_high_water_mark():
    # An engine (or a pod posing as one) streaming a large answer to a slow client must not grow
    # the router: reading from the engine pauses until the relay catches up.
    big = b"z" * (8 * 2**20)

    async def main():
        engine = await Engine(answers(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(big), big))).start()
        pool = upstream.Pool(connect_timeout_s=5.0, max_idle_s=5.0)
        try:
            conn = await pool.connection(engine.url)
            conn.send(upstream.request_bytes(b"POST", b"/v1/completions", pool.host(engine.url), b"", BODY))
            await conn.head()
            await asyncio.sleep(0.3)  # the engine writes as fast as loopback takes it; nobody reads
            assert conn._buffered <= 2 * upstream.READ_HIGH_WATER
            got = len(conn.take())
            while chunk := await conn.read():
                got += len(chunk)
            assert got == len(big) and conn.finished
            pool.release(conn)
            assert pool._idle[engine.url] == [conn]  # read to the end: kept for the next request
        finally:
            pool.close()
            engine.close()
    asyncio.run(main())
