"""Reading a tenant's pod over HTTP without letting it hurt the operator.

An engine pod's /metrics and admin API are written by whoever controls that pod, and one operator
serves every namespace: a body of gigabytes would OOM-kill it, and a body trickled a byte a second
would keep each per-read timeout happy forever and stall every autoscaler tick. So every read here
has a byte cap (checked on the declared Content-Length first, then while streaming) and one total
deadline for connect + head + body, and asks for an uncompressed body (a compressed one is
refused: a small gzip can inflate past any cap before the cap is checked).

In: a method, a URL, the caps. Out: the status code and the body bytes, or BoundedReadError
saying which limit was hit.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import httpx

METRICS_MAX_BYTES = 4 * 1024 * 1024  # an engine's /metrics is ~30 KiB; room for many adapters' series
ADMIN_MAX_BYTES = 64 * 1024  # an admin answer is a small JSON object


# BoundedReadError.kind: which limit was hit, for callers and tests (the message is for people).
TIMEOUT = "timeout"  # the total deadline, or httpx's per-read timeout, passed
TOO_LARGE = "too_large"  # the body (declared or streamed) is over the cap
ENCODING = "encoding"  # a compressed body
TRANSPORT = "transport"  # refused, reset, not HTTP


class BoundedReadError(RuntimeError):
    """A limit was hit or the read failed; the message names the limit (not the URL)."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class Answer:
    status: int
    body: bytes
    content_type: str

    def text(self) -> str:
        return self.body.decode("utf-8", errors="replace")


async def bounded_request(client: httpx.AsyncClient, method: str, url: str, *, max_bytes: int,
                          deadline_s: float, **kwargs) -> Answer:
    """One request whose whole answer must arrive within `deadline_s` and fit in `max_bytes`."""
    headers = {**(kwargs.pop("headers", None) or {}), "Accept-Encoding": "identity"}
    try:
        async with asyncio.timeout(deadline_s):
            async with client.stream(method, url, headers=headers, **kwargs) as response:
                return Answer(response.status_code, await _read_capped(response, max_bytes),
                              response.headers.get("content-type", ""))
    except TimeoutError:
        raise BoundedReadError(TIMEOUT, f"timeout: no complete answer within {deadline_s:g} s") from None
    except httpx.TimeoutException as error:
        raise BoundedReadError(TIMEOUT, f"timeout ({type(error).__name__})") from None
    except httpx.HTTPError as error:
        detail = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
        raise BoundedReadError(TRANSPORT, detail) from None


async def _read_capped(response: httpx.Response, max_bytes: int) -> bytes:
    encoding = response.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise BoundedReadError(ENCODING, f"Content-Encoding {encoding!r} refused (asked for identity)")
    declared = response.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise BoundedReadError(TOO_LARGE, f"body of {int(declared)} bytes is over the {max_bytes}-byte cap")
    body = bytearray()
    async for chunk in response.aiter_raw():
        body += chunk
        if len(body) > max_bytes:
            raise BoundedReadError(TOO_LARGE, f"body over the {max_bytes}-byte cap")
    return bytes(body)
