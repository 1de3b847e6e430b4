"""The router's connections to engines: a lean HTTP/1.1 client (one asyncio.Protocol per pooled
connection, answers parsed by httptools, the llhttp binding uvicorn uses) that never hands out a
connection holding bytes nobody asked for.

In: a request as bytes (`request_bytes`: the head and body, written in one `write`). Out: the
answer's status, reason and headers (`Connection.head`), then its body as it arrives
(`Connection.read`: bytes as the engine sent them, b"" at the end), or an `UpstreamError`.

- **Unsolicited bytes.** A connection knows whether an answer is awaited; a byte that arrives
  while none is (the engine's second answer to a request a lenient parser split in two, sitting
  on the connection for the next user) closes it, and an answer followed by the start of another
  in the same read is delivered but the connection is not reused. (llhttp skips the empty lines
  RFC 9112 allows between messages; they cannot form an answer.)
- **Strict parsing.** llhttp runs with none of its leniencies: a bare LF or CR, obs-fold, a
  malformed status line, a Content-Length that is not digits, two Content-Lengths, chunk sizes
  that are not hex: `Malformed`, and the connection is closed. Heads are capped (MAX_HEADERS,
  MAX_HEAD_BYTES) because an engine's pod is not trusted with the router's memory either.
- **Nothing added.** The request carries the caller's header lines plus Host and Content-Length;
  no cookies, no decompression (the body passes through as sent), no User-Agent.
- **Pooling.** Idle connections are kept per engine, most recent first; one idle for
  max_idle_s (below the engine's keep-alive) is closed, never reused, so the router never
  sends on a connection the engine is closing. A reused connection that closes before a byte
  of the answer raises `Stale` (the engine closed it as we sent): the caller resends once on a
  new one. A connection goes back to the pool only when its answer ended with keep-alive and
  nothing after it (`Pool.release`); anything else, a cancelled caller included, closes it,
  which makes the engine abort the request.
- **Back-pressure.** Reading pauses while READ_HIGH_WATER bytes wait for the caller.

The router's scrapes stay on an aiohttp ClientSession of their own (`session`), off the
request path.
"""

from __future__ import annotations

import asyncio
import functools
import time
from urllib.parse import urlsplit

import aiohttp
import httptools
from aiohttp.client_proto import ResponseHandler

MAX_HEADERS = 100  # uvicorn's and the router's own request limit
MAX_HEAD_BYTES = 64 * 1024  # status line and headers of one answer
READ_HIGH_WATER = 256 * 1024  # answer bytes buffered for a slow caller before reading pauses


class UpstreamError(ConnectionError):
    """The engine could not be reached or did not give a whole, well-formed answer."""


class ConnectFailed(UpstreamError):
    """No connection: refused, unreachable, or not within the connect timeout."""


class Closed(UpstreamError):
    """The connection closed or reset before the answer ended."""


class Stale(Closed):
    """A pooled connection closed before a byte of the answer: the engine closed it as the
    request went out; resending on a new connection is safe."""


class Malformed(UpstreamError):
    """The engine's answer is not valid HTTP/1.1 (or is over the head limits)."""


class _Unsolicited(Exception):
    """Raised inside the parser: a second answer began after the awaited one ended."""


def request_bytes(method: bytes, target: bytes, host: bytes, fields: bytes, body: bytes) -> bytes:
    """One request, head and body: `fields` are header lines ending in CRLF, from a strict
    parser (no CR, LF or NUL in them); Content-Length is set for a body, or for a POST/PUT/PATCH."""
    if body or method in (b"POST", b"PUT", b"PATCH"):
        return b"%s %s HTTP/1.1\r\nHost: %s\r\n%sContent-Length: %d\r\n\r\n%s" % (
            method, target, host, fields, len(body), body)
    return b"%s %s HTTP/1.1\r\nHost: %s\r\n%s\r\n" % (method, target, host, fields)


class Connection(asyncio.Protocol):
    """One connection to an engine and the answer in flight on it (one at a time)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, key: str):
        self._loop, self.key = loop, key
        self._parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.reused = False
        self.idle_since = 0.0
        self._awaiting = False  # a request was sent and its answer has not ended
        self._reusable = True  # false once anything says this connection must not carry another request
        self._waiter: asyncio.Future | None = None
        self._paused = False
        self._reset(False)

    def _reset(self, head_only: bool) -> None:
        self.status = 0
        self.reason = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.content_length: int | None = None
        self.done = False  # the whole answer was parsed
        self.keep_alive = False
        self._head_only = head_only
        self._has_head = False
        self._head_bytes = 0
        self._got_bytes = False
        self._until_close = False  # no length, not chunked: the body ends when the connection does
        self._informational = False
        self._parts: list[bytes] = []
        self._buffered = 0
        self._error: UpstreamError | None = None

    # -- the caller's side ----------------------------------------------------------------------
    def send(self, data: bytes, head_only: bool = False) -> None:
        """Writes one request (head and body in one write); head_only: a HEAD request, whose
        answer has no body whatever its headers say."""
        self._reset(head_only)
        self._awaiting = True
        self.transport.write(data)

    async def head(self) -> None:
        """Waits for the answer's status line and headers (status, reason, headers)."""
        while not self._has_head:
            if self._error is not None:
                raise self._error
            await self._wait()

    def take(self) -> bytes:
        """The body bytes that have arrived (b"" if none yet; check `finished`), without waiting."""
        parts = self._parts
        if not parts:
            if self._error is not None:
                raise self._error
            return b""
        self._parts = []
        self._buffered = 0
        if self._paused:
            self._paused = False
            self.transport.resume_reading()
        return parts[0] if len(parts) == 1 else b"".join(parts)

    async def read(self) -> bytes:
        """The next body bytes as they arrive; b"" once the answer ended."""
        while True:
            if self._parts:
                return self.take()
            if self._error is not None:
                raise self._error
            if self.done:
                return b""
            await self._wait()

    @property
    def finished(self) -> bool:
        """The whole answer arrived and the caller has taken all of it."""
        return self.done and not self._parts

    @property
    def reusable(self) -> bool:
        return (self.done and self.keep_alive and self._reusable and not self._awaiting and not self.closed
                and not self.transport.is_closing())

    def close(self) -> None:
        self._reusable = False
        if self.transport is not None:
            self.transport.close()

    async def _wait(self) -> None:
        self._waiter = self._loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail(self, error: UpstreamError) -> None:
        if self._error is None:
            self._error = error
        self._awaiting = False
        self.close()
        self._wake()

    # -- asyncio.Protocol -----------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if not self._awaiting:  # nobody asked for these bytes: never reuse this connection
            self.close()
            return
        self._got_bytes = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(Malformed("the engine switched protocols (101 or Upgrade), which the router never asks for"))
            return
        except httptools.HttpParserError as error:
            cause = error.__context__ if isinstance(error.__context__, Malformed) else None
            if self.done:  # bytes after the answer (another answer, or garbage): it stands, the connection goes
                self.close()
                self._wake()
            else:
                self._fail(cause or Malformed(f"malformed answer from the engine: {error}"))
            return
        if self._buffered > READ_HIGH_WATER and not self._paused and not self.done:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        return False  # close: an engine never half-closes mid-conversation

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self._awaiting:
            return
        if self._has_head and self._until_close and exc is None:
            self.done = True  # a body without a length or chunks ends with the connection (not a reset)
            self._awaiting = False
            self._wake()
            return
        why = f": {exc}" if exc else ""
        if not self._got_bytes and self.reused:
            self._fail(Stale(f"the engine closed a pooled connection as the request went out{why}"))
        elif self._has_head:
            self._fail(Closed(f"the engine closed the connection mid-answer{why}"))
        else:
            self._fail(Closed(f"the engine closed the connection before answering{why}"))

    # -- httptools callbacks --------------------------------------------------------------------
    def on_message_begin(self) -> None:
        if self.done:
            raise _Unsolicited  # stops the parser; data_received drops the connection
        self.reason = b""

    def on_status(self, reason: bytes) -> None:
        self.reason += reason
        self._head_bytes += len(reason)
        if self._head_bytes > MAX_HEAD_BYTES:
            raise Malformed(f"the answer's status line is over {MAX_HEAD_BYTES} bytes")

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_bytes += len(name) + len(value) + 4
        if len(self.headers) >= MAX_HEADERS or self._head_bytes > MAX_HEAD_BYTES:
            raise Malformed(f"the answer's head is over {MAX_HEADERS} headers or {MAX_HEAD_BYTES} bytes")
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if 100 <= status < 200:  # 1xx (101 is refused above): the real answer follows
            self._informational = True
            self.headers = []
            self._head_bytes = 0
            return
        chunked = False
        for name, value in self.headers:
            lowered = name.lower()
            if lowered == b"content-length":
                self.content_length = int(value)  # llhttp took digits only, and one value
            elif lowered == b"transfer-encoding":
                chunked = value.rstrip().lower().endswith(b"chunked")
        self.status = status
        self.keep_alive = self._parser.should_keep_alive()
        self._has_head = True
        self._until_close = self.content_length is None and not chunked and status not in (204, 304)
        if self._head_only:  # a HEAD answer has no body; llhttp cannot be told, so this connection ends here
            self._reusable = False
            self._answered()

    def on_body(self, body: bytes) -> None:
        if self.done:
            return  # after a HEAD answer: the connection is already closing
        self._parts.append(body)
        self._buffered += len(body)

    def on_message_complete(self) -> None:
        if self._informational:
            self._informational = False
            return
        if not self.done:
            self._answered()

    def _answered(self) -> None:
        self.done = True
        self._awaiting = False
        if self._head_only and self.transport is not None:
            self.transport.close()


class Pool:
    """Connections to every engine, idle ones kept per engine base URL."""

    def __init__(self, connect_timeout_s: float, max_idle_s: float, clock=time.monotonic):
        self.connect_timeout_s, self.max_idle_s, self.clock = connect_timeout_s, max_idle_s, clock
        self._idle: dict[str, list[Connection]] = {}  # most recently used last
        self._hosts: dict[str, bytes] = {}
        self._sweeper: asyncio.TimerHandle | None = None
        self._closed = False

    def host(self, url: str) -> bytes:
        """The Host header value for an engine base URL (its host:port)."""
        host = self._hosts.get(url)
        if host is None:
            host = self._hosts[url] = urlsplit(url).netloc.encode("idna")
        return host

    async def connection(self, url: str) -> Connection:
        """A pooled connection to url's engine that is still good, else a new one."""
        idle = self._idle.get(url)
        if idle:
            too_old = self.clock() - self.max_idle_s
            while idle:
                conn = idle.pop()
                if conn.idle_since > too_old and not conn.closed and not conn.transport.is_closing():
                    conn.reused = True
                    return conn
                conn.close()
        if self._closed:
            raise ConnectFailed("the router is shutting down")
        loop = asyncio.get_running_loop()
        parts = urlsplit(url)
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await loop.create_connection(lambda: Connection(loop, url),
                                                       parts.hostname, parts.port or 80)
        except TimeoutError:
            raise ConnectFailed(f"no connection to {url} within {self.connect_timeout_s:g} s "
                                "(--connect-timeout)") from None
        except OSError as error:
            raise ConnectFailed(f"cannot connect to {url}: {error}") from error
        return conn

    def release(self, conn: Connection) -> None:
        """Back to the pool if its answer ended cleanly with nothing after it; else closed."""
        if not conn.reusable or self._closed:
            conn.close()
            return
        conn.idle_since = self.clock()
        conn.reused = False
        self._idle.setdefault(conn.key, []).append(conn)
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().call_later(self.max_idle_s, self._sweep)

    def _sweep(self) -> None:
        """Closes connections idle for max_idle_s (the oldest are first in each list)."""
        self._sweeper = None
        too_old = self.clock() - self.max_idle_s
        for url, idle in list(self._idle.items()):
            keep = 0
            while keep < len(idle) and (idle[keep].idle_since <= too_old or idle[keep].closed):
                idle[keep].close()
                keep += 1
            del idle[:keep]
            if not idle:
                del self._idle[url]
        if self._idle:
            self._sweeper = asyncio.get_running_loop().call_later(self.max_idle_s / 2, self._sweep)

    def close(self) -> None:
        self._closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()


# -- the scrape pool (aiohttp: not on the request path) -----------------------------------------

class _ScrapeProtocol(ResponseHandler):
    """aiohttp's protocol, knowing whether an answer is awaited; bytes that arrive when none is
    mark the connection unusable (aiohttp alone does not look again before reusing one)."""

    _awaiting = False
    _unsolicited = False

    def set_response_params(self, *args, **kwargs) -> None:  # called as each request is sent
        self._awaiting = True
        super().set_response_params(*args, **kwargs)

    def data_received(self, data: bytes) -> None:
        if data and not self._awaiting:
            self._unsolicited = True
            if self.transport is not None:
                self.transport.close()
            return
        payload = self._payload
        super().data_received(data)
        if self._payload is not None and self._payload is not payload:
            self._payload.on_eof(self._answered)

    def _answered(self) -> None:
        self._awaiting = False

    def is_connected(self) -> bool:  # what the pool asks before it reuses a connection
        return super().is_connected() and not self._unsolicited


class _ScrapeConnector(aiohttp.TCPConnector):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._factory = functools.partial(_ScrapeProtocol, loop=self._loop)


def session(connect_timeout_s: float, max_idle_s: float, per_host: int = 0) -> aiohttp.ClientSession:
    """The scrapes' pool (per_host 0: no cap on connections to one engine): no cookie jar, no
    decompression, no headers of aiohttp's own beyond Host."""
    return aiohttp.ClientSession(
        connector=_ScrapeConnector(limit=0, limit_per_host=per_host, keepalive_timeout=max_idle_s),
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_s),
        cookie_jar=aiohttp.DummyCookieJar(), auto_decompress=False,
        skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"))
