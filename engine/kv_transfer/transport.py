"""Moving KV bytes between engines: the transport interface and its TCP implementation.

A transport has two halves. The listening half serves a `KVSource` (the prefill engine's
connector): it answers a handshake, then pulls of leased blocks, then releases. The pulling half
(on a decode engine) fetches a lease's blocks from an endpoint into staging buffers and releases
the lease. An RDMA, NCCL or NIXL transport would implement the same two halves; nothing above
this module knows it is TCP.

TCP conversation (frames in wire.py), one connection per pull:

    decode -> HELLO {layout, engine_id}        prefill -> HELLO_OK {layout, engine_id} | REFUSED {error}
    decode -> PULL {transfer_id, first_block, num_blocks}
                                               prefill -> LAYER x num_layers, PULL_DONE {bytes} | ERROR {error}
    decode -> RELEASE {transfer_id}            prefill -> RELEASED {}
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

from iterserve.engine.kv_transfer import wire
from iterserve.engine.kv_transfer.layout import KVLayout
from iterserve.engine.kv_transfer.wire import FrameError, KVTransferError

logger = logging.getLogger(__name__)


class KVSource(Protocol):
    """What the listening half serves (the prefill engine's connector)."""

    layout: KVLayout
    engine_id: str

    def open_read(self, transfer_id: str, first_block: int, num_blocks: int) -> list[int]:
        """The lease's blocks [first, first+num) for one read; keeps the lease alive until
        close_read. Raises KVTransferError (unknown/expired transfer, out of range)."""

    def read_layers(self, block_ids: list[int]) -> Iterator[tuple[memoryview, memoryview]]:
        """Per layer, the K bytes and V bytes of these blocks."""

    def close_read(self, transfer_id: str) -> None: ...

    def release(self, transfer_id: str) -> bool:
        """The decode engine has the blocks: free the lease. False if it was unknown."""


@dataclass
class PulledKV:
    """A finished pull: per layer, K bytes then V bytes of the pulled blocks."""

    layers: list[bytearray]
    num_bytes: int
    seconds: float
    released: bool


@dataclass
class PullRequest:
    host: str
    port: int
    transfer_id: str
    first_block: int
    num_blocks: int
    deadline: float  # time.monotonic() by which the pull must be done
    cancel: threading.Event = field(default_factory=threading.Event)


class KVTransport(ABC):
    @abstractmethod
    def listen(self, source: KVSource, host: str, port: int) -> int:
        """Start serving source on host:port (0: any free port); returns the bound port."""

    @abstractmethod
    def pull(self, request: PullRequest, layout: KVLayout, engine_id: str) -> PulledKV:
        """Fetch the blocks, verify them, release the lease; raises KVTransferError."""

    @abstractmethod
    def close(self) -> None: ...


class TcpTransport(KVTransport):
    def __init__(self, connect_timeout: float = 5.0, io_timeout: float = 30.0):
        self.connect_timeout = connect_timeout
        self.io_timeout = io_timeout  # a served connection idle this long is closed
        self._listener: socket.socket | None = None
        self._closing = threading.Event()
        self._connections: set[socket.socket] = set()
        self._lock = threading.Lock()

    # -- the listening half (prefill) -----------------------------------------------------------
    def listen(self, source: KVSource, host: str, port: int) -> int:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind((host, port))
        except OSError as error:
            listener.close()
            raise KVTransferError(f"cannot listen for KV transfers on {host}:{port}: {error}; pick another "
                                  "--kv-transfer-port (0: any free port)") from None
        listener.listen(64)
        self._listener = listener
        threading.Thread(target=self._accept, args=(source,), name="kv-listen", daemon=True).start()
        return listener.getsockname()[1]

    def _accept(self, source: KVSource) -> None:
        while not self._closing.is_set():
            try:
                conn, peer = self._listener.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.settimeout(self.io_timeout)
            with self._lock:
                self._connections.add(conn)
            threading.Thread(target=self._serve, args=(source, conn, peer), name="kv-serve", daemon=True).start()

    def _serve(self, source: KVSource, conn: socket.socket, peer) -> None:
        try:
            self._converse(source, conn)
        except (OSError, KVTransferError) as error:
            if not self._closing.is_set():
                logger.warning("KV transfer connection from %s ended: %s", peer[0], error)
        finally:
            with self._lock:
                self._connections.discard(conn)
            conn.close()

    def _converse(self, source: KVSource, conn: socket.socket) -> None:
        msg_type, hello = wire.recv_json(conn, [wire.HELLO, wire.RELEASE])
        if msg_type == wire.RELEASE:  # a lease nobody will pull (the decode request was aborted)
            source.release(str(hello.get("transfer_id")))
            wire.send_json(conn, wire.RELEASED, {})
            return
        try:
            theirs = KVLayout.from_dict(hello.get("layout") or {})
        except (TypeError, ValueError) as error:
            wire.send_json(conn, wire.REFUSED, {"error": f"bad HELLO: {error}"})
            return
        differences = source.layout.mismatch(theirs)
        if differences:
            message = ("the KV layouts differ, blocks cannot be exchanged (" + "; ".join(differences)
                       + "): run the same model, dtype and --block-size on prefill and decode")
            logger.warning("refused a KV transfer handshake from engine %s: %s", hello.get("engine_id"), message)
            wire.send_json(conn, wire.REFUSED, {"error": message, "fields": [d.split(":")[0] for d in differences]})
            return
        wire.send_json(conn, wire.HELLO_OK, {"layout": source.layout.as_dict(), "engine_id": source.engine_id})
        while True:
            try:
                msg_type, body = wire.recv_json(conn, [wire.PULL, wire.RELEASE])
            except FrameError as error:
                if "closed the connection after 0 of" in str(error):
                    return  # the peer hung up between messages
                raise
            transfer_id = str(body.get("transfer_id"))
            if msg_type == wire.RELEASE:
                source.release(transfer_id)
                wire.send_json(conn, wire.RELEASED, {})
                continue
            try:
                blocks = source.open_read(transfer_id, int(body.get("first_block", 0)), int(body["num_blocks"]))
            except (KVTransferError, KeyError, TypeError, ValueError) as error:
                wire.send_json(conn, wire.ERROR, {"error": str(error)})
                continue
            try:
                sent = 0
                for k, v in source.read_layers(blocks):
                    sent += wire.send_frame(conn, wire.LAYER, k, v)
                wire.send_json(conn, wire.PULL_DONE, {"bytes": sent})
            finally:
                source.close_read(transfer_id)

    # -- the pulling half (decode) --------------------------------------------------------------
    def pull(self, request: PullRequest, layout: KVLayout, engine_id: str) -> PulledKV:
        started = time.monotonic()

        def remaining() -> float:
            if request.cancel.is_set():
                raise KVTransferError("the request was aborted while its KV was in flight")
            left = request.deadline - time.monotonic()
            if left <= 0:
                raise KVTransferError(f"timed out after {time.monotonic() - started:.1f} s pulling KV from "
                                      f"{request.host}:{request.port} (--kv-transfer-timeout)")
            return left

        try:
            sock = socket.create_connection((request.host, request.port), timeout=min(self.connect_timeout, remaining()))
        except OSError as error:
            raise KVTransferError(f"cannot connect to the prefill engine's KV listener {request.host}:{request.port}: "
                                  f"{error}") from None
        with sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            done = threading.Event()
            threading.Thread(target=_close_on_cancel, args=(sock, request.cancel, done), daemon=True).start()
            try:
                return self._pull_on(sock, request, layout, engine_id, remaining, started)
            except TimeoutError:
                remaining()  # raises the timeout (or abort) message
                raise KVTransferError("the KV listener stopped answering") from None
            except OSError as error:
                remaining()
                raise KVTransferError(f"the KV transfer connection to {request.host}:{request.port} failed: "
                                      f"{error}") from None
            finally:
                done.set()

    def _pull_on(self, sock, request: PullRequest, layout: KVLayout, engine_id: str, remaining,
                 started: float) -> PulledKV:
        sock.settimeout(remaining())
        wire.send_json(sock, wire.HELLO, {"layout": layout.as_dict(), "engine_id": engine_id})
        wire.recv_json(sock, [wire.HELLO_OK])
        wire.send_json(sock, wire.PULL, {"transfer_id": request.transfer_id, "first_block": request.first_block,
                                         "num_blocks": request.num_blocks})
        expected = request.num_blocks * layout.block_bytes_per_layer
        layers: list[bytearray] = []
        received = 0
        while True:
            sock.settimeout(remaining())
            msg_type, payload = wire.recv_frame(sock, [wire.LAYER, wire.PULL_DONE])
            received += wire.HEADER.size + len(payload)
            if msg_type == wire.PULL_DONE:
                break
            if len(payload) != expected:
                raise FrameError(f"a LAYER frame holds {len(payload)} bytes, expected {expected} "
                                 f"({request.num_blocks} blocks x {layout.block_bytes_per_layer})")
            layers.append(payload)
        if len(layers) != layout.num_layers:
            raise FrameError(f"got {len(layers)} layers of KV, expected {layout.num_layers}")
        seconds = time.monotonic() - started
        released = False
        try:  # the blocks are here; a failed release only leaves the lease to expire on its own
            sock.settimeout(min(2.0, max(0.1, request.deadline - time.monotonic())))
            wire.send_json(sock, wire.RELEASE, {"transfer_id": request.transfer_id})
            wire.recv_json(sock, [wire.RELEASED])
            released = True
        except (OSError, KVTransferError) as error:
            logger.warning("KV transfer %s pulled, but releasing its lease failed (%s); it expires on its own",
                           request.transfer_id, error)
        return PulledKV(layers, received, seconds, released)

    def release(self, host: str, port: int, transfer_id: str, timeout: float = 2.0) -> bool:
        """Best effort: free a lease whose blocks will not be pulled (an aborted request)."""
        try:
            with socket.create_connection((host, port), timeout=timeout) as sock:
                sock.settimeout(timeout)
                wire.send_json(sock, wire.RELEASE, {"transfer_id": transfer_id})
                wire.recv_json(sock, [wire.RELEASED])
                return True
        except (OSError, KVTransferError):
            return False

    def close(self) -> None:
        self._closing.set()
        if self._listener is not None:
            self._listener.close()
        with self._lock:
            for conn in list(self._connections):
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


def _close_on_cancel(sock: socket.socket, cancel: threading.Event, done: threading.Event) -> None:
    """An abort interrupts a blocked recv by shutting the socket down."""
    while not done.is_set():
        if cancel.wait(0.05):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            return
