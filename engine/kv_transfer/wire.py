"""Framed messages of the TCP KV transport.

A frame is a 20-byte header, then the payload:

    magic b"ISKV" | version u16 | type u16 | payload length u64 | CRC-32 of the payload u32

(network byte order). Control messages carry UTF-8 JSON; LAYER frames carry one layer's K bytes
then V bytes for the requested blocks. A reader refuses a wrong magic, another protocol version,
an unknown type, a type not expected at this point of the conversation, a control frame above
MAX_CONTROL, a LAYER frame of any length but the one the lease implies, and a checksum that does
not match, each with an error that says which, and all but the checksum before it allocates or
reads the payload: a peer's 20-byte header must never make this process reserve memory.

Deadlines: a `timeout` callable (seconds left) is asked before every socket call, so a peer that
trickles one byte at a time cannot stretch a conversation past its deadline.
"""

from __future__ import annotations

import json
import socket
import struct
import zlib
from collections.abc import Callable, Sequence

MAGIC = b"ISKV"
VERSION = 2  # 2: PULL and RELEASE carry the lease's secret
HEADER = struct.Struct("!4sHHQI")
MAX_CONTROL = 64 * 1024  # every JSON message is a few hundred bytes
Timeout = Callable[[], float] | None

HELLO, HELLO_OK, REFUSED, PULL, LAYER, PULL_DONE, RELEASE, RELEASED, ERROR = range(1, 10)
TYPE_NAMES = {HELLO: "HELLO", HELLO_OK: "HELLO_OK", REFUSED: "REFUSED", PULL: "PULL", LAYER: "LAYER",
              PULL_DONE: "PULL_DONE", RELEASE: "RELEASE", RELEASED: "RELEASED", ERROR: "ERROR"}


class KVTransferError(Exception):
    """A transfer failed; the message says where and why."""


class FrameError(KVTransferError):
    """The bytes on the connection are not a valid frame (corrupt, truncated, another protocol)."""


def frame_header(msg_type: int, payload_parts: Sequence[bytes | memoryview]) -> bytes:
    crc = 0
    length = 0
    for part in payload_parts:
        crc = zlib.crc32(part, crc)
        length += len(part)
    return HEADER.pack(MAGIC, VERSION, msg_type, length, crc)


def _arm(sock: socket.socket, timeout: Timeout) -> None:
    if timeout is not None:
        sock.settimeout(timeout())  # raises when the deadline has passed


def send_frame(sock: socket.socket, msg_type: int, *payload_parts: bytes | memoryview, timeout: Timeout = None) -> int:
    """Send one frame whose payload is the parts concatenated; returns the bytes sent."""
    header = frame_header(msg_type, payload_parts)
    for part in (header, *payload_parts):
        _arm(sock, timeout)  # sendall's timeout bounds the whole call
        sock.sendall(part)
    return len(header) + sum(len(p) for p in payload_parts)


def send_json(sock: socket.socket, msg_type: int, body: dict, timeout: Timeout = None) -> int:
    return send_frame(sock, msg_type, json.dumps(body, separators=(",", ":")).encode(), timeout=timeout)


def recv_exact(sock: socket.socket, size: int, timeout: Timeout = None) -> bytearray:
    buffer = bytearray(size)
    view = memoryview(buffer)
    got = 0
    while got < size:
        _arm(sock, timeout)
        n = sock.recv_into(view[got:], size - got)
        if n == 0:
            raise FrameError(f"the peer closed the connection after {got} of {size} bytes")
        got += n
    return buffer


def recv_frame(sock: socket.socket, expect: Sequence[int], layer_bytes: int | None = None,
               timeout: Timeout = None) -> tuple[int, bytearray]:
    """One frame's (type, payload), checked; `expect` lists the types allowed here (ERROR and
    REFUSED always are: they raise KVTransferError with the peer's message). A LAYER frame must
    hold exactly layer_bytes."""
    magic, version, msg_type, length, crc = HEADER.unpack(recv_exact(sock, HEADER.size, timeout))
    if magic != MAGIC:
        raise FrameError(f"bad frame magic {bytes(magic)!r} (expected {MAGIC!r}): the peer is not an iterserve "
                         "KV transfer listener, or the stream is corrupt")
    if version != VERSION:
        raise FrameError(f"the peer speaks KV transfer protocol version {version}, this engine speaks {VERSION}; "
                         "run the same iterserve version on prefill and decode")
    if msg_type not in TYPE_NAMES:
        raise FrameError(f"unknown frame type {msg_type}")
    if msg_type not in expect and msg_type not in (ERROR, REFUSED):
        raise FrameError(f"expected {' or '.join(TYPE_NAMES[t] for t in expect)}, got {TYPE_NAMES[msg_type]}")
    if msg_type == LAYER:
        if length != layer_bytes:
            raise FrameError(f"a LAYER frame declares {length} bytes, the lease's blocks hold {layer_bytes} per layer")
    elif length > MAX_CONTROL:
        raise FrameError(f"a {TYPE_NAMES[msg_type]} frame declares {length} bytes, above the {MAX_CONTROL}-byte "
                         "limit of control frames")
    payload = recv_exact(sock, length, timeout)
    if zlib.crc32(payload) != crc:
        raise FrameError(f"checksum mismatch on a {TYPE_NAMES[msg_type]} frame of {length} bytes: the data "
                         "was corrupted in transit")
    if msg_type in (ERROR, REFUSED) and msg_type not in expect:
        raise KVTransferError(f"the prefill engine answered {TYPE_NAMES[msg_type]}: "
                              f"{decode_json(payload).get('error', '?')}")
    return msg_type, payload


def decode_json(payload: bytes | bytearray) -> dict:
    try:
        value = json.loads(payload)
    except ValueError as error:
        raise FrameError(f"a control frame is not valid JSON: {error}") from None
    if not isinstance(value, dict):
        raise FrameError("a control frame is not a JSON object")
    return value


def recv_json(sock: socket.socket, expect: Sequence[int], timeout: Timeout = None) -> tuple[int, dict]:
    msg_type, payload = recv_frame(sock, expect, timeout=timeout)
    return msg_type, decode_json(payload)
