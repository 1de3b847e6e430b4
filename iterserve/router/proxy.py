"""The router process: an asyncio HTTP/1.1 server that proxies the OpenAI API (/v1/...) to the
replica `picking.pick` names, and serves its own /metrics, /health and /ready.

Per request: pick (waiting up to queue_timeout_s while every replica is saturated, then 429
with Retry-After; 503 at once when none is routable), send, relay the answer byte for byte.
A request whose replica fails before any byte reached the client (connection refused or reset,
or a 503 from a draining engine) is sent once more, to another replica. A client that goes away
closes the upstream connection, which makes the engine abort the request.

With a prefill pool (`set_prefill_endpoints`), a completions or chat request whose uncached prompt
is long goes first to a prefill replica (max_tokens 1), and its decode replica then pulls the KV
(disagg.py decides and shapes the bodies); a prefill that fails or times out falls back to the
decode replica prefilling locally. The client sees one ordinary answer from the decode replica.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

from iterserve.engine import metrics as names
from iterserve.router import disagg
from iterserve.router.endpoints import CONNECTION_ERRORS, Endpoint, ScrapeFailed, scrape_once
from iterserve.router.http import (
    HOP_BY_HOP,
    Conn,
    ProtocolError,
    error_json,
    header,
    parse_head,
    read_body,
    relay_body,
    response_head,
    simple_response,
    wants_close,
)
from iterserve.router.metrics import RouterMetrics
from iterserve.router.picking import NONE_READY, PickPolicy, pick, pick_round_robin
from iterserve.router.prefix import CHARS_PER_TOKEN, PrefixTable, block_hashes, prompt_keys

logger = logging.getLogger("iterserve.router")


@dataclass
class RouterOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    scrape_interval_s: float = 0.2
    stale_after_s: float = 1.0  # a scrape older than this is ignored (local counts only)
    scrape_timeout_s: float = 1.0
    connect_timeout_s: float = 1.0
    queue_timeout_s: float = 2.0  # how long a request waits while every replica is saturated
    retry_after_s: int = 1
    eject_backoff_s: float = 0.5  # first ejection; doubles while the replica keeps failing
    max_eject_backoff_s: float = 10.0
    max_idle_conn_s: float = 4.0  # below uvicorn's 5 s keep-alive, so we never reuse a closing one
    max_body_bytes: int = 16 * 1024 * 1024
    policy: PickPolicy = field(default_factory=PickPolicy)
    prefix_affinity: bool = False
    prefix_tokens: int = 256  # affinity looks at the first this many prompt tokens
    block_size: int = 16  # the engines' KV block size
    seed: int | None = None
    round_robin: bool = False  # the comparison baseline instead of least load
    pd: disagg.PdPolicy = field(default_factory=disagg.PdPolicy)  # with a prefill pool only
    pd_prefill_timeout_s: float = 30.0  # a remote prefill slower than this falls back to local
    pd_tokenize_timeout_s: float = 2.0  # counting a long text prompt's tokens on the decode replica


class _Retry(Exception):
    """This replica failed before the client saw a byte; try another."""


class _ClientGone(Exception):
    """The client closed its connection while the router worked on its request."""


class Router:
    def __init__(self, options: RouterOptions):
        self.options = options
        self.clock = time.monotonic
        self.rng = random.Random(options.seed)
        self._turn = 0
        self._picks = 0  # picks so far: Endpoint.last_picked, by which ties rotate
        self.endpoints: dict[str, Endpoint] = {}  # where requests go (decode and aggregated replicas)
        self.prefills: dict[str, Endpoint] = {}  # the prefill pool of the P/D path (empty: no P/D)
        self._scrapers: dict[str, asyncio.Task] = {}
        self._changed_event = asyncio.Event()
        self.prefixes = PrefixTable()
        self.decode_prefixes = PrefixTable()  # P/D: which decode replica has which prompt blocks cached
        self.metrics = RouterMetrics(lambda: list({**self.prefills, **self.endpoints}.values()), self.clock,
                                     options.stale_after_s)
        self._fallback_logged: dict[str, float] = {}
        self.server: asyncio.Server | None = None

    # -- endpoints ------------------------------------------------------------------------------
    def set_endpoints(self, urls: Iterable[str]) -> None:
        """The replicas requests are sent to (decode and aggregated ones)."""
        self._sync(self.endpoints, urls, "endpoint")

    def set_prefill_endpoints(self, urls: Iterable[str]) -> None:
        """The prefill pool of the P/D path; empty turns the P/D path off."""
        self._sync(self.prefills, urls, "prefill endpoint")

    def _sync(self, table: dict[str, Endpoint], urls: Iterable[str], what: str) -> None:
        wanted = {u.rstrip("/") for u in urls}
        for url in wanted - table.keys():
            if url in self._scrapers:  # the same URL in both pools: one scraper, one Endpoint
                table[url] = (self.endpoints.get(url) or self.prefills[url])
                continue
            table[url] = endpoint = Endpoint(url, self.clock)
            self._scrapers[url] = asyncio.create_task(self._scrape_loop(endpoint), name=f"scrape {url}")
            logger.info("%s added: %s", what, url)
        for url in table.keys() - wanted:
            endpoint = table.pop(url)
            self.prefixes.forget(url)
            self.decode_prefixes.forget(url)
            logger.info("%s removed: %s", what, url)
            if url in self.endpoints or url in self.prefills:
                continue
            endpoint.removed = True
            endpoint.close_idle()
            self._scrapers.pop(url).cancel()
        self._changed()

    def _changed(self) -> None:
        self._changed_event.set()
        self._changed_event = asyncio.Event()

    def _eject(self, endpoint: Endpoint, why: str) -> None:
        if endpoint.eject(why, self.options.eject_backoff_s, self.options.max_eject_backoff_s):
            self.metrics.ejections.labels(endpoint.url).inc()
        self._changed()

    async def _scrape_loop(self, endpoint: Endpoint) -> None:
        o = self.options
        conn: Conn | None = None
        failing: str | None = None
        while not endpoint.removed:
            started = self.clock()
            try:
                try:
                    conn = await scrape_once(endpoint, conn, o.scrape_timeout_s)
                except CONNECTION_ERRORS:
                    if conn is None:
                        raise
                    conn = await scrape_once(endpoint, None, o.scrape_timeout_s)  # a kept-alive one had closed
                if failing:
                    logger.info("scrapes of %s work again", endpoint.url)
                failing = None
                endpoint.connected()
            except CONNECTION_ERRORS as error:
                conn = None
                self._eject(endpoint, f"scrape: {type(error).__name__}: {error}")
            except ScrapeFailed as error:
                if failing is None:
                    logger.warning("scrape of %s failed (%s): routing on local counts", endpoint.url, error)
                failing = str(error)
                if conn is not None and not conn.closing:
                    endpoint.connected()
            except Exception:  # noqa: BLE001 - the scraper must outlive any one bad answer
                logger.exception("scrape of %s", endpoint.url)
                conn = None
            self._changed()
            await asyncio.sleep(max(0.0, o.scrape_interval_s - (self.clock() - started)))
        if conn is not None:
            conn.writer.close()

    # -- serving --------------------------------------------------------------------------------
    async def start(self) -> None:
        self.server = await asyncio.start_server(self._serve, self.options.host, self.options.port,
                                                 backlog=4096, reuse_address=True)

    @property
    def port(self) -> int:
        return self.server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
        for task in self._scrapers.values():
            task.cancel()
        for endpoint in [*self.endpoints.values(), *self.prefills.values()]:
            endpoint.removed = True
            endpoint.close_idle()

    def ready(self) -> bool:
        return any(e.ejected_until is None for e in self.endpoints.values())

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        client = Conn(reader, writer)
        try:
            while True:
                head = await client.read_head()
                if head is None:
                    break
                start, headers = parse_head(head)
                method, target = start[0], start[1]
                version = start[2] if len(start) > 2 else b"HTTP/1.0"
                close = wants_close(version, headers)
                if (header(headers, b"expect") or b"").lower() == b"100-continue":
                    writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")  # curl waits 1 s for this before a big body
                try:
                    body = await read_body(client, headers, self.options.max_body_bytes)
                except (ProtocolError, ValueError) as error:
                    writer.write(error_json(400, f"cannot read the request body: {error}",
                                            "invalid_request_error", "bad_body", close=True))
                    break
                path = target.split(b"?", 1)[0]
                if path.startswith(b"/v1/"):
                    close = await self._proxy(client, method, target, headers, body, close)
                else:
                    writer.write(self._local(path, close))
                    await writer.drain()
                if close:
                    break
        except (ProtocolError, ValueError):
            writer.write(error_json(400, "malformed HTTP request", "invalid_request_error", "bad_request",
                                    close=True))
        except (*CONNECTION_ERRORS, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    def _local(self, path: bytes, close: bool) -> bytes:
        if path == b"/metrics":
            return simple_response(200, self.metrics.exposition(), b"text/plain; version=0.0.4; charset=utf-8",
                                   close=close)
        if path == b"/health":
            return simple_response(200, b'{"status":"ok"}', close=close)
        if path == b"/ready":
            ok = self.ready()
            return simple_response(200 if ok else 503, b'{"ready":%s}' % (b"true" if ok else b"false"),
                                   close=close)
        return error_json(404, "not found: the router serves /v1/..., /metrics, /health and /ready",
                          "invalid_request_error", "not_found", close=close)

    def _reply(self, client: Conn, response: bytes, status: int) -> None:
        self.metrics.requests.labels(str(status)).inc()
        client.writer.write(response)

    async def _proxy(self, client: Conn, method: bytes, target: bytes, headers, body: bytes,
                     close: bool) -> bool:
        """Returns whether the client connection must close."""
        o = self.options
        keys = prompt_keys(body, o.block_size, o.prefix_tokens) if o.prefix_affinity and body else []
        affinity = self.prefixes.lookup(keys) if keys else None
        request = self._upstream_request(method, target, headers, body)
        path = target.split(b"?", 1)[0]
        pd = bool(self.prefills) and method == b"POST" and path in disagg.GENERATION_PATHS
        decode_keys: list[int] = []
        tried: set[str] = set()
        for attempt in range(2):
            endpoint = await self._choose(client, tried, affinity, close)
            if endpoint is None:
                return close
            endpoint.in_flight += 1
            try:
                if pd:
                    pd = False  # decided once: a retry re-sends the same body to another decode replica
                    request, decode_keys = await self._disaggregate(client, endpoint, path, headers, body, request)
                close = await self._exchange(endpoint, client, request, method == b"HEAD", close)
            except _Retry:
                tried.add(endpoint.url)
                if attempt == 0:
                    self.metrics.retries.inc()
                continue
            except _ClientGone:
                return True
            finally:
                endpoint.in_flight -= 1
                self._changed()
            if keys:
                self.prefixes.record(keys, endpoint.url)
            if decode_keys:
                self.decode_prefixes.record(decode_keys, endpoint.url)
            return close
        self._reply(client, error_json(502, "the replica failed before answering, and so did the retry",
                                       "service_unavailable", "upstream_failed", close=close), 502)
        return close

    # -- the P/D path ---------------------------------------------------------------------------
    async def _disaggregate(self, client: Conn, decode: Endpoint, path: bytes, headers, body: bytes,
                            request: list[bytes]) -> tuple[list[bytes], list[int]]:
        """The request to send to the decode replica (with the prefill's kv_transfer_params when
        a prefill replica ran the prompt; unchanged otherwise), and the prompt's block keys (to
        remember what that decode replica now has cached)."""
        o = self.options
        parsed = disagg.parse_request(path, body)
        if parsed is None:
            self.metrics.pd_decisions[disagg.UNSUPPORTED].inc()
            return request, []
        fields, prompt = parsed
        token_ids = prompt.token_ids
        if token_ids is None and not disagg.surely_short(prompt, o.pd.threshold_tokens):
            token_ids = await self._tokenize(decode, headers, fields, prompt)
        keys: list[int] = []
        if token_ids is not None:
            salt = fields.get("cache_salt")
            keys = block_hashes(token_ids, o.block_size, len(token_ids), (salt,) if isinstance(salt, str) and salt
                                else ())
            owner, cached_blocks = self.decode_prefixes.longest(keys)
            uncached = len(token_ids) - (cached_blocks * o.block_size if owner == decode.url else 0)
        else:  # surely short, or /tokenize failed: estimate from the text
            uncached = prompt.utf8_len // CHARS_PER_TOKEN
        now = self.clock()
        loads = [e.load(now, o.stale_after_s) for e in self.prefills.values()]
        decision = disagg.decide(uncached, loads, self.rng, o.pd)
        self.metrics.pd_decisions[decision.reason].inc()
        if decision.prefill is None:
            logger.debug("P/D: %s (%s uncached tokens) -> %s prefills", decision.reason, uncached, decode.url)
            return request, keys
        prefill = self.prefills[decision.prefill]
        self._picks += 1
        prefill.last_picked = self._picks  # ties among prefill replicas rotate too
        prefill.in_flight += 1
        started = self.clock()
        try:
            params = await self._remote_prefill(client, prefill, path, headers, disagg.prefill_body(fields))
        finally:
            prefill.in_flight -= 1
            self._changed()
        if isinstance(params, str):  # a fallback reason
            self.metrics.pd_fallbacks[params].inc()
            return request, keys
        self.metrics.pd_prefill_seconds.observe(self.clock() - started)
        return self._upstream_request(b"POST", path, headers, disagg.decode_body(fields, params)), keys

    async def _tokenize(self, decode: Endpoint, headers, fields: dict, prompt: disagg.Prompt) -> list[int] | None:
        """The prompt's token ids from the decode replica's /tokenize (the engine's own tokenizer and
        chat template), or None if it cannot say in time."""
        try:
            status, answer = await asyncio.wait_for(
                self._call(decode, b"/tokenize", headers, disagg.tokenize_body(fields, prompt)),
                self.options.pd_tokenize_timeout_s)
            tokens = json.loads(answer)["tokens"] if status == 200 else None
        except (*CONNECTION_ERRORS, TimeoutError, ProtocolError, ValueError, KeyError, TypeError) as error:
            logger.debug("P/D: /tokenize on %s failed (%s); estimating the prompt's length", decode.url, error)
            return None
        return tokens if isinstance(tokens, list) else None

    async def _remote_prefill(self, client: Conn, prefill: Endpoint, path: bytes, headers,
                              body: bytes) -> dict | str:
        """Runs the prompt on the prefill replica: its kv_transfer_params, or why not (a fallback
        reason). Raises _ClientGone if the client leaves meanwhile (the prefill call is cut, so
        the prefill replica aborts the request)."""
        o = self.options
        call = asyncio.ensure_future(asyncio.wait_for(self._call(prefill, path, headers, body), o.pd_prefill_timeout_s))
        watcher = asyncio.ensure_future(client.wait_eof())
        try:
            await asyncio.wait([call, watcher], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (call, watcher):
                task.cancel()
            await asyncio.wait([call, watcher])  # nothing else may read the client until it has stopped
        if not call.cancelled() and call.exception() is None:
            status, answer = call.result()
            if status != 200:
                return self._fallback(disagg.FALLBACK_STATUS, prefill, f"it answered {status}: {answer[:200]!r}")
            params = disagg.kv_params_of(answer)
            if params is None:
                return self._fallback(disagg.FALLBACK_NO_PARAMS, prefill, "its answer has no kv_transfer_params "
                                      "(is it an iterserve engine started with --role prefill or both?)")
            return params
        if watcher.done() and not watcher.cancelled():
            raise _ClientGone
        error = call.exception() if not call.cancelled() else TimeoutError()
        if isinstance(error, TimeoutError):
            return self._fallback(disagg.FALLBACK_TIMEOUT, prefill, f"no answer within {o.pd_prefill_timeout_s:g} s "
                                  "(--pd-prefill-timeout)")
        if isinstance(error, (*CONNECTION_ERRORS, ProtocolError, ValueError)):
            self._eject(prefill, f"prefill: {type(error).__name__}: {error}")
            return self._fallback(disagg.FALLBACK_CONNECT, prefill, f"{type(error).__name__}: {error}")
        raise error

    def _fallback(self, reason: str, prefill: Endpoint, why: str) -> str:
        now = self.clock()
        if now - self._fallback_logged.get(reason, -1e9) >= 10.0:  # one line per reason per 10 s
            self._fallback_logged[reason] = now
            logger.warning("P/D: remote prefill on %s failed (%s); the decode replica prefills locally "
                           "%s{reason=%r} counts every one)", prefill.url, why,
                           names.ROUTER_PD_FALLBACKS_TOTAL, reason)
        return reason

    async def _call(self, endpoint: Endpoint, path: bytes, headers, body: bytes) -> tuple[int, bytes]:
        """POST body to endpoint's path on a kept-alive connection: (status, de-chunked body).
        The connection is aborted if the caller is cancelled (so the engine aborts the request)."""
        o = self.options
        head = self._upstream_request(b"POST", path, headers, body)
        conn = endpoint.take_idle(o.max_idle_conn_s)
        for _ in range(2):
            reused = conn is not None
            if conn is None:
                conn = await endpoint.connect(o.connect_timeout_s)
            done = False
            try:
                conn.writer.write(head[0] + b"\r\nhost: " + endpoint.host_header + b"\r\n\r\n" + head[1])
                answer_head = await conn.read_head()
                if answer_head is None:
                    raise ConnectionResetError("closed before answering")
                start, answer_headers = parse_head(answer_head)
                answer = await read_body(conn, answer_headers, o.max_body_bytes)
                done = True
            except CONNECTION_ERRORS:
                conn.abort()
                if not reused:
                    raise
                conn = None  # a kept-alive connection the engine had just closed: open a new one
                continue
            finally:
                if not done and conn is not None:
                    conn.abort()
            if b"close" in (header(answer_headers, b"connection") or b"").lower():
                conn.writer.close()
            else:
                endpoint.put_idle(conn)
            return int(start[1]), answer
        raise ConnectionResetError("closed before answering")

    def _upstream_request(self, method: bytes, target: bytes, headers, body: bytes) -> list[bytes]:
        """The request head (without host) as lines; host is added per endpoint."""
        lines = [method + b" " + target + b" HTTP/1.1"]
        lines += [name + b": " + value for name, value in headers if name not in HOP_BY_HOP]
        if body or method in (b"POST", b"PUT", b"PATCH"):
            lines.append(b"content-length: " + str(len(body)).encode())
        return [b"\r\n".join(lines), body]

    async def _choose(self, client: Conn, tried: set[str], affinity: str | None, close: bool) -> Endpoint | None:
        """The endpoint to send to, or None after answering the client with 429, 502 or 503."""
        o = self.options
        deadline = self.clock() + o.queue_timeout_s
        while True:
            now = self.clock()
            loads = [e.load(now, o.stale_after_s) for url, e in self.endpoints.items() if url not in tried]
            if o.round_robin:
                choice = pick_round_robin(loads, self._turn, o.policy)
                self._turn += choice.url is not None
            else:
                choice = pick(loads, self.rng, o.policy, affinity)
            if choice.url is not None:
                self.metrics.picks[choice.reason].inc()
                self._picks += 1
                self.endpoints[choice.url].last_picked = self._picks
                return self.endpoints[choice.url]
            if choice.reason == NONE_READY or now >= deadline:
                self.metrics.picks[choice.reason].inc()
            if choice.reason == NONE_READY:
                why = "the replica failed before answering and no other is ready" if tried else "no replica is ready"
                self._reply(client, error_json(503, why, "service_unavailable", "no_ready_replica",
                                               retry_after=o.retry_after_s, close=close), 503)
                return None
            if now >= deadline:
                self._reply(client, error_json(429, f"every replica is saturated (waited {o.queue_timeout_s:g} s); "
                                               "retry later", "rate_limit_error", "saturated",
                                               retry_after=o.retry_after_s, close=close), 429)
                return None
            try:
                await asyncio.wait_for(self._changed_event.wait(), deadline - now)
            except TimeoutError:
                pass

    async def _exchange(self, endpoint: Endpoint, client: Conn, request: list[bytes], head_only: bool,
                        close: bool) -> bool:
        """One request to one endpoint; raises _Retry if it failed before the client saw a byte.
        Returns whether the client connection must close."""
        o = self.options
        conn = endpoint.take_idle(o.max_idle_conn_s)
        while True:
            reused = conn is not None
            if conn is None:
                try:
                    conn = await endpoint.connect(o.connect_timeout_s)
                except (*CONNECTION_ERRORS, TimeoutError) as error:
                    self._eject(endpoint, f"connect: {type(error).__name__}: {error}")
                    raise _Retry from None
            conn.writer.write(request[0] + b"\r\nhost: " + endpoint.host_header + b"\r\n\r\n" + request[1])
            # While the answer is awaited or relayed, a watcher reads the client side: if the client
            # goes away it closes the upstream connection, which makes the engine abort the request.
            watcher = asyncio.ensure_future(client.wait_eof())
            watcher.add_done_callback(lambda t, upstream=conn: t.cancelled() or upstream.abort())
            try:
                outcome = await self._answer(endpoint, client, conn, watcher, head_only, close, reused)
            finally:
                watcher.cancel()
                await asyncio.wait([watcher])  # nothing else may read the client until it has stopped
            if outcome is not None:
                return outcome
            conn = None  # a kept-alive connection the engine had just closed: open a new one

    async def _answer(self, endpoint: Endpoint, client: Conn, conn: Conn, watcher: asyncio.Future,
                      head_only: bool, close: bool, reused: bool) -> bool | None:
        """Relays upstream's answer; None: try again on a new connection to the same endpoint."""
        gone = lambda: watcher.done() and not watcher.cancelled()  # noqa: E731
        try:
            head = await conn.read_head()
            if head is None:
                raise ConnectionResetError("closed before answering")
        except CONNECTION_ERRORS as error:
            conn.abort()
            if gone():
                raise ConnectionResetError("client went away") from None
            if reused:
                return None
            self._eject(endpoint, f"request: {type(error).__name__}: {error}")
            raise _Retry from None
        try:
            start, headers = parse_head(head)
            status = int(start[1])
            if status == 503 and not gone():
                # A draining or loading engine: nothing reached the client yet, so try another.
                await read_body(conn, headers, self.options.max_body_bytes)
                endpoint.put_idle(conn)
                raise _Retry
            upstream_close = b"close" in (header(headers, b"connection") or b"").lower()
            self.metrics.requests.labels(str(status)).inc()
            reusable = await relay_body(conn, client.writer, response_head(status, headers, close), headers,
                                        status, head_only, watcher.cancel)
        except _Retry:
            raise
        except (*CONNECTION_ERRORS, ProtocolError, ValueError) as error:
            conn.abort()
            if not gone() and isinstance(error, CONNECTION_ERRORS) and not client.writer.transport.is_closing():
                self._eject(endpoint, f"mid-answer: {type(error).__name__}: {error}")
            client.abort()  # a cut-off answer must not look complete
            return True
        if reusable and not upstream_close:
            endpoint.put_idle(conn)
        else:
            conn.writer.close()
        return close or not reusable
