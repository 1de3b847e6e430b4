"""Just enough HTTP/1.1 for a streaming proxy, on asyncio streams: read a request or response
head, read a body by Content-Length or chunks, relay a response body byte for byte (chunked
server-sent events pass through unchanged), write a small response. No parsing beyond framing.
"""

from __future__ import annotations

import asyncio
import json

MAX_HEAD_BYTES = 64 * 1024
READ_SIZE = 64 * 1024
# Headers that describe one connection, not the message: never forwarded.
HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"proxy-connection", b"te", b"trailer",
                        b"transfer-encoding", b"upgrade", b"host", b"content-length", b"expect"})
REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
           411: "Length Required", 413: "Payload Too Large", 429: "Too Many Requests",
           500: "Internal Server Error", 502: "Bad Gateway", 503: "Service Unavailable"}


class ProtocolError(Exception):
    """The peer sent something that is not HTTP/1.1 framing we accept."""


class Conn:
    """A stream with its own read buffer, so a background reader (the disconnect watcher) never
    loses bytes the next request needs."""

    __slots__ = ("reader", "writer", "buf", "idle_since")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader, self.writer = reader, writer
        self.buf = bytearray()
        self.idle_since = 0.0

    async def fill(self) -> bool:
        data = await self.reader.read(READ_SIZE)
        if not data:
            return False
        self.buf += data
        return True

    async def wait_eof(self) -> None:
        """Returns when the peer closes; bytes it sends meanwhile stay buffered."""
        while await self.fill():
            if len(self.buf) > MAX_HEAD_BYTES:
                await asyncio.sleep(0.05)  # a pipelining client: stop reading, keep watching

    async def read_head(self) -> bytes | None:
        """A head up to and including the blank line; None if the peer closed before a byte."""
        return await self._read_through(b"\r\n\r\n", "head too large", none_at_clean_eof=True)

    async def read_exactly(self, n: int) -> bytes:
        while len(self.buf) < n:
            if not await self.fill():
                raise asyncio.IncompleteReadError(bytes(self.buf), n)
        data = bytes(self.buf[:n])
        del self.buf[:n]
        return data

    async def read_line(self) -> bytes:
        return await self._read_through(b"\r\n", "line too long", none_at_clean_eof=False)

    async def _read_through(self, separator: bytes, too_large: str, none_at_clean_eof: bool) -> bytes | None:
        start = 0
        while True:
            i = self.buf.find(separator, start)
            if i >= 0:
                end = i + len(separator)
                data = bytes(self.buf[:end])
                del self.buf[:end]
                return data
            if len(self.buf) > MAX_HEAD_BYTES:
                raise ProtocolError(too_large)
            start = max(0, len(self.buf) - len(separator) + 1)
            if not await self.fill():
                if none_at_clean_eof and not self.buf:
                    return None
                raise asyncio.IncompleteReadError(bytes(self.buf), None)

    async def read_to_eof(self) -> bytes:
        while await self.fill():
            pass
        data = bytes(self.buf)
        self.buf.clear()
        return data

    def abort(self) -> None:
        self.writer.transport.abort()

    @property
    def closing(self) -> bool:
        return self.writer.transport.is_closing() or self.reader.at_eof()


def parse_head(head: bytes) -> tuple[list[bytes], list[tuple[bytes, bytes]]]:
    """(the start line's three parts, [(lower-case name, value)])."""
    lines = head[:-4].split(b"\r\n")
    start = lines[0].split(b" ", 2)
    if len(start) < 2:
        raise ProtocolError(f"bad start line {lines[0][:80]!r}")
    headers = []
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep:
            raise ProtocolError(f"bad header line {line[:80]!r}")
        headers.append((name.strip().lower(), value.strip()))
    return start, headers


def header(headers: list[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    for key, value in headers:
        if key == name:
            return value
    return None


def is_chunked(headers: list[tuple[bytes, bytes]]) -> bool:
    value = header(headers, b"transfer-encoding")
    return value is not None and b"chunked" in value.lower()


def wants_close(version: bytes, headers: list[tuple[bytes, bytes]]) -> bool:
    value = (header(headers, b"connection") or b"").lower()
    return b"close" in value or (version == b"HTTP/1.0" and b"keep-alive" not in value)


async def read_body(conn: Conn, headers: list[tuple[bytes, bytes]], max_bytes: int) -> bytes:
    """A request body by Content-Length or chunks (de-chunked)."""
    if is_chunked(headers):
        parts, total = [], 0
        while True:
            size = int((await conn.read_line()).split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while await conn.read_line() != b"\r\n":
                    pass
                return b"".join(parts)
            total += size
            if total > max_bytes:
                raise ProtocolError("body too large")
            parts.append((await conn.read_exactly(size + 2))[:-2])
    length = header(headers, b"content-length")
    if length is None:
        return b""
    n = int(length)
    if n > max_bytes:
        raise ProtocolError("body too large")
    return await conn.read_exactly(n)


def _complete_chunks(buf: bytearray) -> tuple[int, bool]:
    """How many leading bytes of buf are whole chunks, and whether they end with the last one
    (the zero-size chunk and its trailer)."""
    at = 0
    while True:
        eol = buf.find(b"\r\n", at)
        if eol < 0:
            return at, False
        size = int(bytes(buf[at:eol]).split(b";")[0].strip() or b"0", 16)
        if size == 0:
            end = buf.find(b"\r\n\r\n", eol)
            if end < 0:
                return at, False
            return end + 4, True
        end = eol + 2 + size + 2
        if len(buf) < end:
            return at, False
        at = end


async def relay_body(upstream: Conn, client: asyncio.StreamWriter, head: bytes, headers, status: int,
                     head_only: bool, before_last) -> bool:
    """Sends head, then copies the response body from upstream to client as it arrives, framing
    unchanged; whatever has arrived goes out in one write (one event of a stream, usually).
    Calls before_last() just before the last bytes go out (so the caller can stop its disconnect
    watcher before the client can send its next request). Returns whether the upstream
    connection can be reused (False: the body ran to EOF)."""
    if head_only or status in (204, 304) or 100 <= status < 200:
        before_last()
        client.write(head)
        return True
    if is_chunked(headers):
        out = bytearray(head)
        while True:
            n, last = _complete_chunks(upstream.buf)
            out += upstream.buf[:n]
            del upstream.buf[:n]
            if last:
                before_last()
                client.write(bytes(out))
                await client.drain()
                return True
            if out:
                client.write(bytes(out))
                out.clear()
                await client.drain()
            if not await upstream.fill():
                raise asyncio.IncompleteReadError(bytes(upstream.buf), None)
    length = header(headers, b"content-length")
    if length is not None:
        remaining = int(length)
        out = bytearray(head)
        while True:
            chunk = upstream.buf[:remaining]
            del upstream.buf[:remaining]
            remaining -= len(chunk)
            out += chunk
            if remaining == 0:
                before_last()
                client.write(bytes(out))
                await client.drain()
                return True
            if out:
                client.write(bytes(out))
                out.clear()
                await client.drain()
            if not await upstream.fill():
                raise asyncio.IncompleteReadError(b"", remaining)
    client.write(head)
    while True:
        if upstream.buf:
            client.write(bytes(upstream.buf))
            upstream.buf.clear()
            await client.drain()
        if not await upstream.fill():
            before_last()
            return False


def response_head(status: int, headers: list[tuple[bytes, bytes]], close: bool) -> bytes:
    """A response head from upstream's headers, minus the connection ones."""
    lines = [f"HTTP/1.1 {status} {REASONS.get(status, 'Status')}".encode()]
    for name, value in headers:
        if name not in (b"connection", b"keep-alive"):
            lines.append(name + b": " + value)
    if close:
        lines.append(b"connection: close")
    return b"\r\n".join(lines) + b"\r\n\r\n"


def simple_response(status: int, body: bytes, content_type: bytes = b"application/json",
                    extra: dict[str, str] | None = None, close: bool = False) -> bytes:
    lines = [f"HTTP/1.1 {status} {REASONS.get(status, 'Status')}".encode(),
             b"content-type: " + content_type, b"content-length: " + str(len(body)).encode()]
    lines += [f"{k}: {v}".encode() for k, v in (extra or {}).items()]
    if close:
        lines.append(b"connection: close")
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


def error_json(status: int, message: str, type_: str, code: str, retry_after: int | None = None,
               close: bool = False) -> bytes:
    """OpenAI's error body, as the engine answers (engine/server/errors.py)."""
    body = json.dumps({"error": {"message": message, "type": type_, "param": None, "code": code}}).encode()
    extra = {"retry-after": str(retry_after)} if retry_after is not None else None
    return simple_response(status, body, extra=extra, close=close)
