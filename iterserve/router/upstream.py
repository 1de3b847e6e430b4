"""The router's connections to engines: aiohttp client pools that never hand out a connection
holding bytes nobody asked for.

aiohttp returns a connection to its pool once its answer was read to the end (one with unread
bytes at that moment is closed), but it does not look again before reusing it. Bytes an engine
sends while the connection sits idle (a second answer, as a request split in two by a lenient
parser would produce) would be read as the answer to the next request, another user's. Here a
connection that received anything between the end of one answer and the next request is never
reused.

In: engine base URLs and the router's timeouts. Out: `ClientSession`s with no cookie jar (one
user's Set-Cookie must never ride on another's request), no decompression (bytes pass through as
sent) and no headers of aiohttp's own beyond Host and Content-Length.
"""

from __future__ import annotations

import functools

import aiohttp
from aiohttp.client_proto import ResponseHandler


class _Protocol(ResponseHandler):
    """Knows whether an answer is awaited; bytes that arrive when none is mark it unusable."""

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


class _Connector(aiohttp.TCPConnector):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._factory = functools.partial(_Protocol, loop=self._loop)


def session(connect_timeout_s: float, max_idle_s: float, per_host: int = 0) -> aiohttp.ClientSession:
    """A pool for every engine (per_host 0: no cap on connections to one engine)."""
    return aiohttp.ClientSession(
        connector=_Connector(limit=0, limit_per_host=per_host, keepalive_timeout=max_idle_s),
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_s),
        cookie_jar=aiohttp.DummyCookieJar(), auto_decompress=False,
        skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"))
