"""Framed messages of the TCP KV transport.

A frame is a 20-byte header, then the payload:

    magic b"ISKV" | version u16 | type u16 | payload length u64 | CRC-32 of the payload u32

(network byte order). Control messages carry UTF-8 JSON; LAYER frames carry one layer's K bytes
then V bytes for the requested blocks. A reader refuses a wrong magic, another protocol version,
an unknown type, a length above MAX_PAYLOAD and a checksum that does not match, each with an
error that says which.
"""

from __future__ import annotations

import json
import socket
import struct
import zlib
from collections.abc import Sequence

MAGIC = b"ISKV"
VERSION = 1
HEADER = struct.Struct("!4sHHQI")
MAX_PAYLOAD = 1 << 31  # one layer of a max-length prompt is far below this

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


def send_frame(sock: socket.socket, msg_type: int, *payload_parts: bytes | memoryview) -> int:
    """Send one frame whose payload is the parts concatenated; returns the bytes sent."""
    header = frame_header(msg_type, payload_parts)
    sock.sendall(header)
    for part in payload_parts:
        sock.sendall(part)
    return len(header) + sum(len(p) for p in payload_parts)


def send_json(sock: socket.socket, msg_type: int, body: dict) -> int:
    return send_frame(sock, msg_type, json.dumps(body, separators=(",", ":")).encode())


def recv_exact(sock: socket.socket, size: int) -> bytearray:
    buffer = bytearray(size)
    view = memoryview(buffer)
    got = 0
    while got < size:
        n = sock.recv_into(view[got:], size - got)
        if n == 0:
            raise FrameError(f"the peer closed the connection after {got} of {size} bytes")
        got += n
    return buffer


def recv_frame(sock: socket.socket, expect: Sequence[int] | None = None) -> tuple[int, bytearray]:
    """One frame's (type, payload), checked; `expect` lists the types allowed here (ERROR and
    REFUSED always are: they raise KVTransferError with the peer's message)."""
    magic, version, msg_type, length, crc = HEADER.unpack(recv_exact(sock, HEADER.size))
    if magic != MAGIC:
        raise FrameError(f"bad frame magic {bytes(magic)!r} (expected {MAGIC!r}): the peer is not an iterserve "
                         "KV transfer listener, or the stream is corrupt")
    if version != VERSION:
        raise FrameError(f"the peer speaks KV transfer protocol version {version}, this engine speaks {VERSION}; "
                         "run the same iterserve version on prefill and decode")
    if msg_type not in TYPE_NAMES:
        raise FrameError(f"unknown frame type {msg_type}")
    if length > MAX_PAYLOAD:
        raise FrameError(f"frame of {length} bytes exceeds the {MAX_PAYLOAD}-byte limit")
    payload = recv_exact(sock, length)
    if zlib.crc32(payload) != crc:
        raise FrameError(f"checksum mismatch on a {TYPE_NAMES[msg_type]} frame of {length} bytes: the data "
                         "was corrupted in transit")
    if msg_type in (ERROR, REFUSED) and (expect is None or msg_type not in expect):
        raise KVTransferError(f"the prefill engine answered {TYPE_NAMES[msg_type]}: "
                              f"{decode_json(payload).get('error', '?')}")
    if expect is not None and msg_type not in expect:
        raise FrameError(f"expected {' or '.join(TYPE_NAMES[t] for t in expect)}, got {TYPE_NAMES[msg_type]}")
    return msg_type, payload


def decode_json(payload: bytes | bytearray) -> dict:
    try:
        value = json.loads(payload)
    except ValueError as error:
        raise FrameError(f"a control frame is not valid JSON: {error}") from None
    if not isinstance(value, dict):
        raise FrameError("a control frame is not a JSON object")
    return value


def recv_json(sock: socket.socket, expect: Sequence[int]) -> tuple[int, dict]:
    msg_type, payload = recv_frame(sock, expect)
    return msg_type, decode_json(payload)
