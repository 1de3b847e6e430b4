"""The router's front door: aiohttp's HTTP/1.1 server, whose request parser is llhttp (Node's),
run strict, plus the limits aiohttp leaves to its user. Client bytes flow in; aiohttp requests
flow out to the proxy, and the OpenAI-shaped error answers flow back.

llhttp refuses with 400, before the proxy sees the request: a bare CR or LF, a NUL or another
control byte in the request line or a header value, obs-fold, whitespace in or before a header
name, a Content-Length that is not digits only, two Content-Lengths, Content-Length beside
Transfer-Encoding, and chunk sizes that are not hex digits (`-1`, `0x10`, `1_0`). On top:

- a cap on concurrent client connections: one over it gets a 503 and is closed at once (a
  flood queues nothing, and the kernel backlog never hides a hang);
- a head deadline: a connection must deliver a whole request head within head_timeout_s of
  opening or of its previous answer, else it is closed (nginx's client_header_timeout; it also
  bounds an idle kept-alive connection);
- `read_body`: a body cap (413) and a deadline for the whole body (408).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from http import HTTPStatus

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler

logger = logging.getLogger("iterserve.router")

# Headers that describe one connection, not the message: never forwarded, either way.
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding",
                        "upgrade", "host", "content-length", "expect", "proxy-authorization"})
# Request heads: the same bounds as uvicorn/h11 in front of the engine, so a head the router takes
# is one the engine takes.
MAX_LINE_BYTES = 8190
MAX_FIELD_BYTES = 8190
MAX_HEADERS = 100
OVERLOADED = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n"
              b"connection: close\r\ncontent-length: %d\r\n\r\n%s")


class BodyRefused(Exception):
    """The request body cannot be taken: status (408, 413, 400) and why."""

    def __init__(self, status: int, code: str, message: str):
        super().__init__(message)
        self.status, self.code = status, code


def error_response(status: int, message: str, type_: str, code: str, retry_after: int | None = None,
                   close: bool = False) -> web.Response:
    """OpenAI's error body, as the engine answers (engine/server/errors.py)."""
    body = json.dumps({"error": {"message": message, "type": type_, "param": None, "code": code}}).encode()
    response = web.Response(status=status, body=body, content_type="application/json")
    if retry_after is not None:
        response.headers["retry-after"] = str(retry_after)
    if close:
        response.force_close()
    return response


async def read_body(request: web.BaseRequest, max_bytes: int, timeout_s: float) -> bytes:
    """The whole request body (de-chunked), or BodyRefused. A declared length over the cap is
    refused before a byte of it is read; a chunked one as soon as the running total passes it."""
    if request.content_length is not None and request.content_length > max_bytes:
        raise BodyRefused(413, "request_too_large", f"the body is {request.content_length} bytes; the "
                          f"limit is {max_bytes} (--max-request-body)")
    if request.content.is_eof():  # the whole body came with the head (a small request): no wait
        body = request.content.read_nowait()
        if len(body) > max_bytes:
            raise BodyRefused(413, "request_too_large", f"the body is over {max_bytes} bytes (--max-request-body)")
        return body
    if request.headers.get("expect", "").lower() == "100-continue":
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")  # curl waits 1 s for this before a big body
    parts, total = [], 0
    try:
        async with asyncio.timeout(timeout_s):
            while chunk := await request.content.readany():
                total += len(chunk)
                if total > max_bytes:
                    raise BodyRefused(413, "request_too_large", f"the body is over {max_bytes} bytes "
                                      "(--max-request-body)")
                parts.append(chunk)
    except TimeoutError:
        raise BodyRefused(408, "body_timeout", f"the body did not arrive within {timeout_s:g} s "
                          "(--client-body-timeout)") from None
    except HttpProcessingError as error:  # bad chunk framing, found by llhttp as the body streams in
        raise BodyRefused(400, "bad_body", f"malformed request body: {error.message}") from None
    return b"".join(parts)


class FrontDoor:
    """The listening server: aiohttp's low-level server with a connection cap and head deadline."""

    def __init__(self, handler: Callable[[web.BaseRequest], Awaitable[web.StreamResponse]],
                 max_connections: int, head_timeout_s: float):
        self.max_connections, self.head_timeout_s = max_connections, head_timeout_s
        self.refused = 0  # connections turned away at the cap
        self._head_timers: dict[RequestHandler, asyncio.TimerHandle | None] = {}
        self.web = _Server(self, handler, handler_cancellation=True, max_line_size=MAX_LINE_BYTES,
                           max_field_size=MAX_FIELD_BYTES, max_headers=MAX_HEADERS,
                           keepalive_timeout=head_timeout_s, access_log=None)
        self.server: asyncio.Server | None = None

    async def listen(self, host: str, port: int) -> None:
        loop = asyncio.get_running_loop()
        self.server = await loop.create_server(self.web, host, port, backlog=4096, reuse_address=True)

    @property
    def port(self) -> int:
        return self.server.sockets[0].getsockname()[1]

    @property
    def connections(self) -> int:
        return len(self._head_timers)

    def stop_listening(self) -> None:
        if self.server is not None:
            self.server.close()

    async def close(self, timeout_s: float = 1.0) -> None:
        self.stop_listening()
        await self.web.shutdown(timeout_s)

    # -- called by _Server and the proxy --------------------------------------------------------
    def opened(self, handler: RequestHandler, transport: asyncio.Transport) -> None:
        if len(self._head_timers) >= self.max_connections:
            self.refused += 1
            body = json.dumps({"error": {"message": f"the router is at its {self.max_connections} client "
                                         "connections (--max-connections); retry later", "type":
                                         "service_unavailable", "param": None, "code": "too_many_connections"}})
            transport.write(OVERLOADED % (len(body), body.encode()))
            transport.close()
            return
        self._head_timers[handler] = None
        self.idle(handler)

    def lost(self, handler: RequestHandler) -> None:
        timer = self._head_timers.pop(handler, None)
        if timer is not None:
            timer.cancel()

    def busy(self, handler: RequestHandler) -> None:
        """A whole head arrived: the head deadline stops until the answer is done."""
        timer = self._head_timers.get(handler)
        if timer is not None:
            timer.cancel()
            self._head_timers[handler] = None

    def idle(self, handler: RequestHandler) -> None:
        """The connection waits for a (next) request head: the head deadline runs."""
        if handler in self._head_timers:
            loop = asyncio.get_running_loop()
            self._head_timers[handler] = loop.call_later(self.head_timeout_s, self._head_late, handler)

    def _head_late(self, handler: RequestHandler) -> None:
        self._head_timers[handler] = None
        if handler.transport is not None:
            handler.transport.abort()  # slow loris: nothing owed to a peer that never sent a request


class _Handler(RequestHandler):
    """aiohttp's connection handler, answering its own errors (a malformed request, the proxy
    failing) in OpenAI's error shape like every other answer of the router, instead of plain text."""

    def handle_error(self, request: web.BaseRequest, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if request.writer.output_size > 0:  # an answer is under way: aiohttp logs and drops the connection
            return super().handle_error(request, status, exc, message)
        if status >= 500:
            logger.error("error handling a request from %s", request.remote, exc_info=exc)
            return error_response(status, "the router failed to handle the request; see its log",
                                  "server_error", "internal_error", close=True)
        reason = message or HTTPStatus(status).phrase
        logger.info("refused a malformed request from %s: %s", request.remote, reason)
        return error_response(status, f"malformed HTTP request: {reason}", "invalid_request_error",
                              "bad_request", close=True)


class _Server(web.Server):
    def __init__(self, door: FrontDoor, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.door = door

    def __call__(self) -> RequestHandler:
        return _Handler(self, loop=self._loop, **self._kwargs)

    def connection_made(self, handler: RequestHandler, transport: asyncio.Transport) -> None:
        super().connection_made(handler, transport)
        self.door.opened(handler, transport)

    def connection_lost(self, handler: RequestHandler, exc: BaseException | None = None) -> None:
        self.door.lost(handler)
        super().connection_lost(handler, exc)
