"""The router process: an HTTP/1.1 server (http.py's front door) that proxies the OpenAI API
(/v1/...) to the replica `picking.pick` names, and serves its own /metrics, /health and /ready.

Per request: read the body (capped, timed), rewrite it (body.py: no client kv_transfer_params;
a tenant's cache_salt), answer 404 for a completions or chat `model` that no replica serves (when
every replica's model list is known: picking.unknown_model), pick (a LoRA adapter's requests go
to replicas that serve it, preferring those running it: picking.py) (waiting up to queue_timeout_s while every replica is saturated,
then 429 with Retry-After; 503 at once when none is routable), send on a pooled upstream
connection (upstream.py: one that ever held bytes nobody asked for is never reused), relay the
answer as it arrives. A request whose replica fails before any byte reached the client
(connection refused or reset, or a 503 from a draining engine) is sent once more, to another
replica; an answer that is not valid HTTP/1.1 is answered 502 and not re-sent (as nginx does: the
engine may have run it). A client that goes away cancels its handler, which closes the upstream
connection, which makes the engine abort the request.

With a prefill pool (`set_prefill_endpoints`), a completions or chat request whose uncached prompt
is long goes first to a prefill replica (max_tokens 1), and its decode replica then pulls the KV
(disagg.py decides and shapes the bodies); a prefill that fails or times out falls back to the
decode replica prefilling locally. The client sees one ordinary answer from the decode replica.

`drain` (SIGTERM): stop accepting, let requests in flight finish for a grace period, then end a
cut stream with an SSE error event (no `[DONE]`: the OpenAI SDK reads EOF after `[DONE]` as a
finished answer) and answer a cut non-streamed request 503.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

from iterserve.engine import metrics as names
from iterserve.router import disagg, upstream
from iterserve.router.activator import Activator, ActivatorOptions
from iterserve.router.body import BadBody, rewrite, tenant_salt
from iterserve.router.endpoints import (
    CONNECTION_ERRORS,
    Endpoint,
    ScrapeFailed,
    scrape_models,
    scrape_once,
)
from iterserve.router.http import HOP_BY_HOP, BodyRefused, FrontDoor, error_response, read_body
from iterserve.router.metrics import RouterMetrics
from iterserve.router.picking import NONE_READY, PickPolicy, pick, pick_round_robin, unknown_model
from iterserve.router.prefix import CHARS_PER_TOKEN, PrefixTable, block_hashes, prompt_keys

logger = logging.getLogger("iterserve.router")
SSE = "text/event-stream"
_HOP_BY_HOP = frozenset(name.encode() for name in HOP_BY_HOP)


def _forwarded(request: web.BaseRequest) -> bytes:
    """The client's header lines to send upstream, as received (llhttp refused CR, LF and NUL in
    them): all but hop-by-hop ones and those its Connection header names."""
    skip = _HOP_BY_HOP
    named = request.headers.get("connection")
    if named:
        skip = skip | {t.strip().lower().encode("utf-8", "surrogateescape") for t in named.split(",")}
    return b"".join([b"%s: %s\r\n" % (name, value) for name, value in request.raw_headers
                     if name.lower() not in skip])


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
    max_body_bytes: int = 8 * 1024**2  # the engines' --max-request-body default: no larger body helps
    head_timeout_s: float = 15.0  # a request head must arrive within this of the connection's last answer
    body_timeout_s: float = 60.0  # a request body must arrive within this
    max_connections: int = 4096  # concurrent client connections; beyond: 503 and close
    drain_grace_s: float = 30.0  # SIGTERM: requests in flight get this long to finish
    tenant_salt_header: str | None = None  # the header naming the tenant: cache_salt per tenant
    tenant_salt_key: bytes = b""  # the key of the tenant salt's HMAC
    policy: PickPolicy = field(default_factory=PickPolicy)
    prefix_affinity: bool = False
    prefix_tokens: int = 256  # affinity looks at the first this many prompt tokens
    block_size: int = 16  # the engines' KV block size
    seed: int | None = None
    round_robin: bool = False  # the comparison baseline instead of least load
    pd: disagg.PdPolicy = field(default_factory=disagg.PdPolicy)  # with a prefill pool only
    pd_prefill_timeout_s: float = 30.0  # a remote prefill slower than this falls back to local
    pd_tokenize_timeout_s: float = 2.0  # counting a long text prompt's tokens on the decode replica
    activator: ActivatorOptions = field(default_factory=ActivatorOptions)  # hold while no replica is ready


class _Retry(Exception):
    """This replica failed before the client saw a byte; try another."""


class _Relay:
    """One request's answer to the client, once its head is sent (None before)."""

    __slots__ = ("response", "at_event_end")

    def __init__(self):
        self.response: web.StreamResponse | None = None
        self.at_event_end = True  # the last bytes relayed ended an SSE event


class _Relayed(web.StreamResponse):
    """A relayed answer whose head goes out with its first body bytes, in one write (aiohttp's
    StreamResponse sends it alone; its Response, which knows the whole body, waits)."""

    _send_headers_immediately = False


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
        self.activator = Activator(options.activator)
        self.metrics = RouterMetrics(lambda: list({**self.prefills, **self.endpoints}.values()), self.clock,
                                     options.stale_after_s, lambda: self.activator.held)
        self._fallback_logged: dict[str, float] = {}
        self.door: FrontDoor | None = None
        self.pool: upstream.Pool | None = None  # connections for requests
        self._counted: dict[int, object] = {}  # status -> its requests-counter child
        self.scrape_session: aiohttp.ClientSession | None = None
        self._in_flight: set[asyncio.Task] = set()  # proxied requests' handler tasks
        self._all_done = asyncio.Event()
        self.draining = False
        self._cutting = False

    # -- endpoints ------------------------------------------------------------------------------
    def set_endpoints(self, urls: Iterable[str]) -> None:
        """The replicas requests are sent to (decode and aggregated ones). After start()."""
        self._sync(self.endpoints, urls, "endpoint")

    def set_prefill_endpoints(self, urls: Iterable[str]) -> None:
        """The prefill pool of the P/D path; empty turns the P/D path off. After start()."""
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
        failing: str | None = None
        while not endpoint.removed:
            started = self.clock()
            try:
                try:
                    await scrape_once(endpoint, self.scrape_session, o.scrape_timeout_s)
                except aiohttp.ServerDisconnectedError:  # a pooled connection the engine had just closed
                    await scrape_once(endpoint, self.scrape_session, o.scrape_timeout_s)
                if endpoint.models_due(self.clock()):
                    # A failed read leaves the list to go stale (no 404s, no narrowing from it); the
                    # /metrics scrape alone decides whether the replica is reachable.
                    try:
                        await scrape_models(endpoint, self.scrape_session, o.scrape_timeout_s)
                    except (ScrapeFailed, *CONNECTION_ERRORS) as error:
                        logger.debug("model list of %s: %s", endpoint.url, error)
                if failing:
                    logger.info("scrapes of %s work again", endpoint.url)
                failing = None
                endpoint.connected()
            except CONNECTION_ERRORS as error:
                self._eject(endpoint, f"scrape: {type(error).__name__}: {error}")
            except ScrapeFailed as error:
                if failing is None:
                    logger.warning("scrape of %s failed (%s): routing on local counts", endpoint.url, error)
                failing = str(error)
                endpoint.connected()  # it answered: it is reachable
            except Exception:  # noqa: BLE001 - the scraper must outlive any one bad answer
                logger.exception("scrape of %s", endpoint.url)
            self._changed()
            await asyncio.sleep(max(0.0, o.scrape_interval_s - (self.clock() - started)))

    # -- the process ----------------------------------------------------------------------------
    async def start(self) -> None:
        o = self.options
        self.pool = upstream.Pool(o.connect_timeout_s, o.max_idle_conn_s)
        # Scrapes keep a connection per replica of their own: a scrape never waits for a free
        # request connection, and a replica that answers scrapes but fails requests still fails them.
        self.scrape_session = upstream.session(o.connect_timeout_s, o.max_idle_conn_s, per_host=1)
        self.door = FrontDoor(self._handle, o.max_connections, o.head_timeout_s)
        await self.door.listen(o.host, o.port)

    @property
    def port(self) -> int:
        return self.door.port

    async def drain(self) -> None:
        """Stop accepting; wait up to drain_grace_s for requests in flight; cut the rest."""
        self.draining = True
        self.door.stop_listening()
        if self._in_flight:
            logger.info("draining: %d request(s) in flight, up to %g s", len(self._in_flight),
                        self.options.drain_grace_s)
            self._all_done.clear()
            try:
                await asyncio.wait_for(self._all_done.wait(), self.options.drain_grace_s)
            except TimeoutError:
                pass
        if self._in_flight:
            logger.warning("drain grace over: cutting %d request(s) (--drain-grace)", len(self._in_flight))
            self._cutting = True
            tasks = list(self._in_flight)
            for task in tasks:
                task.cancel()
            await asyncio.wait(tasks, timeout=5.0)

    async def close(self) -> None:
        if self.door is not None:
            await self.door.close()
        for task in self._scrapers.values():
            task.cancel()
        for endpoint in [*self.endpoints.values(), *self.prefills.values()]:
            endpoint.removed = True
        if self.pool is not None:
            self.pool.close()
        if self.scrape_session is not None:
            await self.scrape_session.close()

    def ready(self) -> bool:
        """With the activator on, ready with no replica too: the router is where requests wait."""
        return not self.draining and (self.activator.enabled
                                      or any(e.ejected_until is None for e in self.endpoints.values()))

    # -- serving --------------------------------------------------------------------------------
    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        self.door.busy(request.protocol)
        try:
            path = request.raw_path.split("?", 1)[0]
            if not path.startswith("/v1/"):
                return self._local(path)  # a body sent here is not read (aiohttp drains it, time-bounded)
            return await self._proxy(request, path)
        finally:
            self.door.idle(request.protocol)

    def _local(self, path: str) -> web.Response:
        if path == "/metrics":
            return web.Response(body=self.metrics.exposition(),
                                headers={"content-type": "text/plain; version=0.0.4; charset=utf-8"})
        if path == "/health":
            return web.Response(body=b'{"status":"ok"}', content_type="application/json")
        if path == "/ready":
            ok = self.ready()
            return web.Response(status=200 if ok else 503, body=b'{"ready":%s}' % (b"true" if ok else b"false"),
                                content_type="application/json")
        return error_response(404, "not found: the router serves /v1/..., /metrics, /health and /ready",
                              "invalid_request_error", "not_found")

    def _count(self, status: int) -> None:
        counter = self._counted.get(status)
        if counter is None:
            counter = self._counted[status] = self.metrics.requests.labels(str(status))
        counter.inc()

    def _reply(self, response: web.Response) -> web.Response:
        self._count(response.status)
        if self.draining:
            response.force_close()
        return response

    async def _proxy(self, request: web.BaseRequest, path: str) -> web.StreamResponse:
        task = asyncio.current_task()
        self._in_flight.add(task)
        relay = _Relay()
        try:
            return await self._proxy_request(request, path, relay)
        except asyncio.CancelledError:
            if not self._cutting or request.transport is None or request.transport.is_closing():
                raise  # the client went away: nothing to answer
            task.uncancel()
            return await self._cut(request, relay)
        except ConnectionResetError:  # the client went away; the upstream call is closed
            return relay.response if relay.response is not None else web.Response(status=400)
        finally:
            self._in_flight.discard(task)
            if not self._in_flight:
                self._all_done.set()

    async def _cut(self, request: web.BaseRequest, relay: _Relay) -> web.StreamResponse:
        """The answer to a request still in flight when the drain grace ran out."""
        grace = self.options.drain_grace_s
        response = relay.response
        if response is None or not response.prepared:
            return self._reply(error_response(503, f"the router shut down (drain grace {grace:g} s) before the "
                                              "replica answered; retry", "service_unavailable", "router_draining",
                                              retry_after=self.options.retry_after_s, close=True))
        if response.content_type == SSE:
            event = {"error": {"message": f"the router shut down (drain grace {grace:g} s) before the answer "
                               "ended; it is incomplete", "type": "service_unavailable", "param": None,
                               "code": "router_draining"}}
            ending = b"" if relay.at_event_end else b"\n\n"
            await response.write(ending + b"data: " + json.dumps(event).encode() + b"\n\n")
            await response.write_eof()
            return response
        request.transport.abort()  # a cut answer must not look complete
        return response

    async def _proxy_request(self, request: web.BaseRequest, path: str, relay: _Relay) -> web.StreamResponse:
        o = self.options
        try:
            body = await read_body(request, o.max_body_bytes, o.body_timeout_s)
            fields: dict = {}
            if request.method == "POST" and body:
                body, fields = rewrite(path, body, self._salt(request))
        except BodyRefused as refused:
            return self._reply(error_response(refused.status, str(refused), "invalid_request_error",
                                              refused.code, close=True))
        except BadBody as error:
            return self._reply(error_response(400, str(error), "invalid_request_error", "bad_body"))
        headers = _forwarded(request)
        model = fields.get("model") if path.encode() in disagg.GENERATION_PATHS else None
        model = model if isinstance(model, str) else None
        if model is not None and unknown_model([e.load(self.clock(), o.stale_after_s) for e in self.endpoints.values()],
                                               model):
            return self._reply(error_response(404, self._unknown_model(model), "invalid_request_error",
                                              "model_not_found"))
        keys = prompt_keys(body, o.block_size, o.prefix_tokens) if o.prefix_affinity and body else []
        affinity = self.prefixes.lookup(keys) if keys else None
        pd = bool(self.prefills) and request.method == "POST" and path.encode() in disagg.GENERATION_PATHS
        send, decode_keys, tried = body, [], set()
        for attempt in range(2):
            endpoint = await self._choose(tried, affinity, model)
            if isinstance(endpoint, web.Response):
                return endpoint
            endpoint.in_flight += 1
            try:
                if pd:
                    pd = False  # decided once: a retry re-sends the same body to another decode replica
                    send, decode_keys = await self._disaggregate(endpoint, path, headers, body)
                response = await self._exchange(endpoint, request, headers, send, relay)
            except _Retry:
                tried.add(endpoint.url)
                if attempt == 0:
                    self.metrics.retries.inc()
                continue
            finally:
                endpoint.in_flight -= 1
                self._changed()
            if keys:
                self.prefixes.record(keys, endpoint.url)
            if decode_keys:
                self.decode_prefixes.record(decode_keys, endpoint.url)
            return response
        return self._reply(error_response(502, "the replica failed before answering, and so did the retry",
                                          "service_unavailable", "upstream_failed"))

    def _salt(self, request: web.BaseRequest) -> str | None:
        name = self.options.tenant_salt_header
        if name is None:
            return None
        tenant = request.headers.get(name)
        if not tenant:
            raise BadBody(f"the request has no {name} header naming its tenant (the router runs with "
                          f"--tenant-salt-header {name}: every request must carry one)")
        return tenant_salt(self.options.tenant_salt_key, tenant)

    def _unknown_model(self, model: str) -> str:
        served = sorted({m for e in self.endpoints.values() for m in e.models or ()})
        shown = ", ".join(repr(m) for m in served[:20]) + (f" and {len(served) - 20} more" if len(served) > 20 else "")
        return (f"model {model!r} does not exist: no replica serves it (they serve {shown}; GET /v1/models); "
                "a LoRA adapter must be loaded first (spec.adapters, or POST /v1/load_lora_adapter)")

    async def _choose(self, tried: set[str], affinity: str | None, model: str | None = None) -> Endpoint | web.Response:
        """The endpoint to send to, or the 429/503 answer when there is none."""
        o = self.options
        deadline = self.clock() + o.queue_timeout_s
        while True:
            now = self.clock()
            loads = [e.load(now, o.stale_after_s) for url, e in self.endpoints.items() if url not in tried]
            if o.round_robin:
                choice = pick_round_robin(loads, self._turn, o.policy)
                self._turn += choice.url is not None
            else:
                choice = pick(loads, self.rng, o.policy, affinity, model)
            if choice.url is not None:
                self.metrics.picks[choice.reason].inc()
                self._picks += 1
                self.endpoints[choice.url].last_picked = self._picks
                return self.endpoints[choice.url]
            if choice.reason == NONE_READY and not tried and self.activator.enabled:
                held = await self._hold()
                if held is not None:
                    return held
                deadline = self.clock() + o.queue_timeout_s
                continue
            if choice.reason == NONE_READY or now >= deadline:
                self.metrics.picks[choice.reason].inc()
            if choice.reason == NONE_READY:
                why = "the replica failed before answering and no other is ready" if tried else "no replica is ready"
                return self._reply(error_response(503, why, "service_unavailable", "no_ready_replica",
                                                  retry_after=o.retry_after_s))
            if now >= deadline:
                return self._reply(error_response(
                    429, f"every replica is saturated (waited {o.queue_timeout_s:g} s); retry later",
                    "rate_limit_error", "saturated", retry_after=o.retry_after_s))
            try:
                await asyncio.wait_for(self._changed_event.wait(), deadline - now)
            except TimeoutError:
                pass

    async def _hold(self) -> web.Response | None:
        """The activator (activator.py): wait, bounded, until a replica is routable; None when one
        is, else the 503 to send."""
        o, activator = self.options, self.activator
        if not activator.take():
            self.metrics.holds["refused_full"].inc()
            return self._reply(error_response(503, activator.full_message(), "service_unavailable",
                                              "hold_queue_full", retry_after=o.retry_after_s))
        try:
            deadline = self.clock() + activator.options.hold_timeout_s
            while True:
                now = self.clock()
                if any(e.load(now, o.stale_after_s).routable for e in self.endpoints.values()):
                    self.metrics.holds["forwarded"].inc()
                    return None
                if now >= deadline:
                    self.metrics.holds["timed_out"].inc()
                    self.metrics.picks[NONE_READY].inc()
                    return self._reply(error_response(503, activator.timeout_message(), "service_unavailable",
                                                      "no_ready_replica", retry_after=o.retry_after_s))
                try:
                    await asyncio.wait_for(self._changed_event.wait(), deadline - now)
                except TimeoutError:
                    pass
        finally:
            activator.release()

    async def _exchange(self, endpoint: Endpoint, request: web.BaseRequest, headers: bytes, body: bytes,
                        relay: _Relay) -> web.StreamResponse:
        """One request to one endpoint; raises _Retry if it failed before the client saw a byte."""
        method = request.method.encode()
        target = request.raw_path.encode("utf-8", "surrogateescape")
        data = upstream.request_bytes(method, target, self.pool.host(endpoint.url), headers, body)
        for again in (True, False):
            try:
                conn = await self.pool.connection(endpoint.url)
            except upstream.ConnectFailed as error:
                self._eject(endpoint, f"request: {error}")
                raise _Retry from None
            try:
                conn.send(data, head_only=method == b"HEAD")
                try:
                    await conn.head()
                except upstream.Malformed as error:  # as nginx: 502, not re-sent (the engine may have run it)
                    logger.warning("%s sent a malformed answer to %s %s: %s", endpoint.url, request.method,
                                   request.path, error)
                    return self._reply(error_response(502, f"the replica sent a malformed answer: {error}",
                                                      "server_error", "upstream_malformed"))
                except upstream.UpstreamError as error:
                    if again and isinstance(error, upstream.Stale):
                        continue  # a pooled connection the engine had just closed: open a new one
                    self._eject(endpoint, f"request: {type(error).__name__}: {error}")
                    raise _Retry from None
                return await self._relay(endpoint, request, conn, relay)
            finally:
                self.pool.release(conn)  # kept only if its answer ended cleanly; else closed (the engine aborts)
        raise AssertionError("unreachable")

    async def _relay(self, endpoint: Endpoint, request: web.BaseRequest, conn: upstream.Connection,
                     relay: _Relay) -> web.StreamResponse:
        """Sends upstream's answer to the client as it arrives."""
        status = conn.status
        if status == 503:
            raise _Retry  # a draining or loading engine: nothing reached the client yet, so try another
        self._count(status)
        response = _Relayed(status=status, reason=conn.reason.decode("latin-1") or None)
        out = response.headers
        for name, value in conn.headers:
            if name.lower() not in _HOP_BY_HOP:
                out.add(name.decode("latin-1"), value.decode("utf-8", "replace"))
        if conn.content_length is not None and request.method != "HEAD":
            response.content_length = conn.content_length
        if self.draining:
            response.force_close()
        relay.response = response
        await response.prepare(request)
        try:
            data = conn.take()  # what came with the head goes out with it
        except upstream.UpstreamError as error:
            return self._cut_upstream(endpoint, request, response, error)
        if not data and not conn.done:
            await response.write(b"")  # no body yet: the head goes now, as the engine sent it
        while True:
            if not data:
                try:
                    data = await conn.read()
                except upstream.UpstreamError as error:
                    return self._cut_upstream(endpoint, request, response, error)
                if not data:
                    break
            relay.at_event_end = data.endswith(b"\n\n")
            if conn.finished:  # the last bytes: one write with the end of the body
                await response.write_eof(data)
                return response
            await response.write(data)
            data = b""
        await response.write_eof()
        return response

    def _cut_upstream(self, endpoint: Endpoint, request: web.BaseRequest, response: web.StreamResponse,
                      error: BaseException) -> web.StreamResponse:
        """The replica failed mid-answer: the client's connection is aborted, so a cut answer
        cannot look complete."""
        self._eject(endpoint, f"mid-answer: {type(error).__name__}: {error}")
        if request.transport is not None:
            request.transport.abort()
        return response

    # -- the P/D path ---------------------------------------------------------------------------
    async def _disaggregate(self, decode: Endpoint, path: str, headers: bytes, body: bytes) -> tuple[bytes, list[int]]:
        """The body to send to the decode replica (with the prefill's kv_transfer_params when a
        prefill replica ran the prompt; unchanged otherwise), and the prompt's block keys (to
        remember what that decode replica now has cached)."""
        o = self.options
        parsed = disagg.parse_request(path.encode(), body)
        if parsed is None:
            self.metrics.pd_decisions[disagg.UNSUPPORTED].inc()
            return body, []
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
            return body, keys
        prefill = self.prefills[decision.prefill]
        self._picks += 1
        prefill.last_picked = self._picks  # ties among prefill replicas rotate too
        prefill.in_flight += 1
        started = self.clock()
        try:
            params = await self._remote_prefill(prefill, path, headers, disagg.prefill_body(fields, o.pd))
        finally:
            prefill.in_flight -= 1
            self._changed()
        if isinstance(params, str):  # a fallback reason
            self.metrics.pd_fallbacks[params].inc()
            return body, keys
        self.metrics.pd_prefill_seconds.observe(self.clock() - started)
        return disagg.decode_body(fields, params), keys

    async def _tokenize(self, decode: Endpoint, headers: bytes, fields: dict, prompt: disagg.Prompt) -> list[int] | None:
        """The prompt's token ids from the decode replica's /tokenize (the engine's own tokenizer and
        chat template), or None if it cannot say in time."""
        try:
            status, answer = await asyncio.wait_for(
                self._call(decode, "/tokenize", headers, disagg.tokenize_body(fields, prompt)),
                self.options.pd_tokenize_timeout_s)
            tokens = json.loads(answer)["tokens"] if status == 200 else None
        except (*CONNECTION_ERRORS, TimeoutError, ValueError, KeyError, TypeError) as error:
            logger.debug("P/D: /tokenize on %s failed (%s); estimating the prompt's length", decode.url, error)
            return None
        return tokens if isinstance(tokens, list) else None

    async def _remote_prefill(self, prefill: Endpoint, path: str, headers: bytes, body: bytes) -> dict | str:
        """Runs the prompt on the prefill replica: its kv_transfer_params, or why not (a fallback
        reason). A client that leaves meanwhile cancels this, which closes the prefill call, so
        the prefill replica aborts the request."""
        o = self.options
        try:
            status, answer = await asyncio.wait_for(self._call(prefill, path, headers, body), o.pd_prefill_timeout_s)
        except TimeoutError:
            return self._fallback(disagg.FALLBACK_TIMEOUT, prefill, f"no answer within {o.pd_prefill_timeout_s:g} s "
                                  "(--pd-prefill-timeout)")
        except (*CONNECTION_ERRORS, ValueError) as error:
            self._eject(prefill, f"prefill: {type(error).__name__}: {error}")
            return self._fallback(disagg.FALLBACK_CONNECT, prefill, f"{type(error).__name__}: {error}")
        if status != 200:
            return self._fallback(disagg.FALLBACK_STATUS, prefill, f"it answered {status}: {answer[:200]!r}")
        params = disagg.kv_params_of(answer)
        if params is None:
            return self._fallback(disagg.FALLBACK_NO_PARAMS, prefill, "its answer has no kv_transfer_params "
                                  "(is it an iterserve engine started with --role prefill or both?)")
        return params

    def _fallback(self, reason: str, prefill: Endpoint, why: str) -> str:
        now = self.clock()
        if now - self._fallback_logged.get(reason, -1e9) >= 10.0:  # one line per reason per 10 s
            self._fallback_logged[reason] = now
            logger.warning("P/D: remote prefill on %s failed (%s); the decode replica prefills locally "
                           "%s{reason=%r} counts every one)", prefill.url, why,
                           names.ROUTER_PD_FALLBACKS_TOTAL, reason)
        return reason

    async def _call(self, endpoint: Endpoint, path: str, headers: bytes, body: bytes) -> tuple[int, bytes]:
        """POST body to endpoint's path on a pooled connection: (status, body, at most
        max_body_bytes; ValueError beyond). Cancelling it closes the connection (so the engine
        aborts the request)."""
        limit = self.options.max_body_bytes
        data = upstream.request_bytes(b"POST", path.encode(), self.pool.host(endpoint.url), headers, body)
        for again in (True, False):
            conn = await self.pool.connection(endpoint.url)
            try:
                conn.send(data)
                try:
                    await conn.head()
                except upstream.Stale:
                    if again:
                        continue  # a pooled connection the engine had just closed: open a new one
                    raise
                if conn.content_length is not None and conn.content_length > limit:
                    raise ValueError(f"{path} answered {conn.content_length} bytes, over {limit}")
                parts, total = [], 0
                while chunk := await conn.read():
                    total += len(chunk)
                    if total > limit:
                        raise ValueError(f"{path} answered over {limit} bytes")
                    parts.append(chunk)
                return conn.status, b"".join(parts)
            finally:
                self.pool.release(conn)
        raise AssertionError("unreachable")
