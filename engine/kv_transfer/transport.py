"""Moving KV bytes between engines: the transport interface and its TCP implementation.

A transport has two halves. The listening half serves a `KVSource` (the prefill engine's
connector): it answers a handshake, then pulls of leased blocks, then releases. The pulling half
(on a decode engine) fetches a lease's blocks from an endpoint into staging buffers and releases
the lease. An RDMA, NCCL or NIXL transport would implement the same two halves; nothing above
this module knows it is TCP.

TCP conversation (frames in wire.py), one connection per pull:

    decode -> HELLO {layout, engine_id}        prefill -> HELLO_OK {layout, engine_id} | REFUSED {error}
    decode -> PULL {transfer_id, lease_secret, first_block, num_blocks}
                                               prefill -> LAYER x num_layers, PULL_DONE {bytes} | ERROR {error}
    decode -> RELEASE {transfer_id, lease_secret}
                                               prefill -> RELEASED {}

The lease_secret is a random value the prefill engine made for this lease and put into its signed
kv_transfer_params: only the decode engine the router handed them to knows it, so another pod
that can reach the port can neither read a lease's KV nor free it.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
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

    def open_read(self, transfer_id: str, secret: str, first_block: int, num_blocks: int) -> LeaseRead:
        """The lease's blocks [first, first+num) for one read; keeps the lease alive until
        close_read. Raises KVTransferError (unknown/expired transfer, wrong secret, out of range)."""

    def read_layers(self, block_ids: list[int]) -> Iterator[tuple[memoryview, memoryview]]:
        """Per layer, the K bytes and V bytes of these blocks."""

    def close_read(self, transfer_id: str) -> None: ...

    def release(self, transfer_id: str, secret: str) -> bool:
        """The decode engine has the blocks: free the lease. False if it was unknown or the secret
        was wrong."""


@dataclass(frozen=True)
class LeaseRead:
    """One read of a lease: its blocks, and the lease's expiry on the transport's clock, which
    bounds the connection serving it."""

    blocks: list[int]
    deadline: float


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
    lease_secret: str
    first_block: int
    num_blocks: int
    deadline: float  # on the transport's clock (the connector's), by which the pull must be done
    cancel: threading.Event = field(default_factory=threading.Event)
    key: str = ""  # the pulling engine's name for it (the request id)
    shards: tuple[tuple[str, int], ...] = ()  # a tensor-parallel prefill engine's ranks 1..N-1 (params.py)
    release: bool = True  # release the lease once pulled; False: another pull releases it (kv_transfer/sharded.py)


class KVTransport(ABC):
    @abstractmethod
    def listen(self, source: KVSource, host: str, port: int) -> int:
        """Start serving source on host:port (0: any free port); returns the bound port."""

    @abstractmethod
    def pull(self, request: PullRequest, layout: KVLayout, engine_id: str) -> PulledKV:
        """Fetch the blocks, verify them, release the lease; raises KVTransferError."""

    @abstractmethod
    def release(self, host: str, port: int, transfer_id: str, secret: str, timeout: float = 2.0) -> bool:
        """Best effort: free a lease whose blocks will not be pulled; False if that failed."""

    @abstractmethod
    def close(self) -> None: ...

    # A transport whose KV lives in several processes (kv_transfer/sharded.py: a tensor-parallel
    # engine's ranks) hears of leases and settled pulls; one process's transport needs neither.
    def shard_addresses(self, advertise_host: str) -> list[tuple[str, int]]:
        """Where the other ranks serve their KV shards (ranks 1..N-1), for kv_transfer_params."""
        return []

    def lease_opened(self, transfer_id: str, secret: str, blocks: list[int], seconds: float) -> None:
        """The connector leased these blocks for `seconds` (the listening half's other processes serve them too)."""
        return None

    def lease_closed(self, transfer_id: str) -> None:
        """The connector freed the lease's blocks."""
        return None

    def settled(self, request: PullRequest) -> None:
        """The connector took the pull's outcome (the scheduler loads it this step, or never)."""
        return None


class TcpTransport(KVTransport):
    """Every bound the listener keeps is on a peer that may be hostile (any pod that reaches the
    port): at most max_connections served at once (one thread each; more are closed at accept), a
    handshake_timeout to get from connect to PULL, then the lease's own expiry as the deadline for
    the rest (a slow reader cannot extend it), one PULL per connection, and PULL and RELEASE honoured
    only with the lease's secret."""

    def __init__(self, connect_timeout: float = 5.0, io_timeout: float = 30.0, handshake_timeout: float = 5.0,
                 max_connections: int = 64, clock: Callable[[], float] = time.monotonic):
        self.connect_timeout = connect_timeout
        self.io_timeout = io_timeout  # a served connection idle this long is closed
        self.handshake_timeout = handshake_timeout
        self.max_connections = max_connections
        self.clock = clock  # the connector's: leases' deadlines and pulls' deadlines are read on it
        self.refused_connections = 0  # closed at accept: max_connections were being served
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
        """Runs until close(); no error on one connection (or a full file table) stops it."""
        while not self._closing.is_set():
            try:
                conn, peer = self._listener.accept()
            except OSError as error:
                if self._closing.is_set():
                    return
                logger.warning("KV transfer listener: accept failed (%s); retrying", error)
                time.sleep(0.1)  # EMFILE and the like: do not spin
                continue
            try:
                self._start_serving(source, conn, peer)
            except Exception:  # noqa: BLE001 - this connection is dropped, the listener goes on
                logger.exception("KV transfer listener: could not serve a connection from %s", peer[0])
                self._forget(conn)

    def _start_serving(self, source: KVSource, conn: socket.socket, peer) -> None:
        with self._lock:
            full = len(self._connections) >= self.max_connections
            if not full:
                self._connections.add(conn)
        if full:
            self.refused_connections += 1
            conn.close()
            return
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=self._serve, args=(source, conn, peer), name="kv-serve", daemon=True).start()

    def _forget(self, conn: socket.socket) -> None:
        with self._lock:
            self._connections.discard(conn)
        conn.close()

    def _serve(self, source: KVSource, conn: socket.socket, peer) -> None:
        try:
            self._converse(source, conn)
        except (OSError, KVTransferError) as error:
            if not self._closing.is_set():
                logger.warning("KV transfer connection from %s ended: %s", peer[0], error)
        finally:
            self._forget(conn)

    def _converse(self, source: KVSource, conn: socket.socket) -> None:
        deadline = [self.clock() + self.handshake_timeout]

        def left() -> float:
            seconds = deadline[0] - self.clock()
            if seconds <= 0:
                raise KVTransferError("the connection passed its deadline (handshake timeout or lease expiry)")
            return min(seconds, self.io_timeout)

        msg_type, hello = wire.recv_json(conn, [wire.HELLO, wire.RELEASE], left)
        if msg_type == wire.RELEASE:  # a lease nobody will pull (the decode request was aborted)
            self._release(source, conn, hello, left)
            return
        if not self._handshake(source, conn, hello, left):
            return
        msg_type, body = wire.recv_json(conn, [wire.PULL, wire.RELEASE], left)
        if msg_type == wire.RELEASE:
            self._release(source, conn, body, left)
            return
        transfer_id = str(body.get("transfer_id"))
        try:
            read = source.open_read(transfer_id, str(body.get("lease_secret")), int(body.get("first_block", 0)),
                                    int(body["num_blocks"]))
        except (KVTransferError, KeyError, TypeError, ValueError) as error:
            wire.send_json(conn, wire.ERROR, {"error": str(error)}, left)
            return
        deadline[0] = read.deadline  # from here on the lease's expiry bounds the connection
        try:
            sent = 0
            for k, v in source.read_layers(read.blocks):
                sent += wire.send_frame(conn, wire.LAYER, k, v, timeout=left)
            wire.send_json(conn, wire.PULL_DONE, {"bytes": sent}, left)
        finally:
            source.close_read(transfer_id)
        try:
            msg_type, body = wire.recv_json(conn, [wire.RELEASE], left)
        except FrameError as error:
            if "closed the connection after 0 of" in str(error):
                return  # the puller hung up without releasing: the lease expires on its own
            raise
        self._release(source, conn, body, left)

    def _handshake(self, source: KVSource, conn: socket.socket, hello: dict, left) -> bool:
        try:
            theirs = KVLayout.from_dict(hello.get("layout") or {})
        except (TypeError, ValueError) as error:
            wire.send_json(conn, wire.REFUSED, {"error": f"bad HELLO: {error}"}, left)
            return False
        differences = source.layout.mismatch(theirs)
        if differences:
            message = ("the KV layouts differ, blocks cannot be exchanged (" + "; ".join(differences)
                       + "): run the same model, dtype, --block-size and --tensor-parallel-size on prefill and decode "
                       "(tensor rank i pulls from tensor rank i)")
            logger.warning("refused a KV transfer handshake from engine %s: %s", hello.get("engine_id"), message)
            wire.send_json(conn, wire.REFUSED, {"error": message, "fields": [d.split(":")[0] for d in differences]},
                           left)
            return False
        wire.send_json(conn, wire.HELLO_OK, {"layout": source.layout.as_dict(), "engine_id": source.engine_id}, left)
        return True

    @staticmethod
    def _release(source: KVSource, conn: socket.socket, body: dict, left) -> None:
        source.release(str(body.get("transfer_id")), str(body.get("lease_secret")))
        wire.send_json(conn, wire.RELEASED, {}, left)  # the same answer either way: it tells nothing

    # -- the pulling half (decode) --------------------------------------------------------------
    def pull(self, request: PullRequest, layout: KVLayout, engine_id: str) -> PulledKV:
        started = self.clock()

        def remaining() -> float:
            if request.cancel.is_set():
                raise KVTransferError("the request was aborted while its KV was in flight")
            left = request.deadline - self.clock()
            if left <= 0:
                raise KVTransferError(f"timed out after {self.clock() - started:.1f} s pulling KV from "
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
        wire.send_json(sock, wire.HELLO, {"layout": layout.as_dict(), "engine_id": engine_id}, remaining)
        wire.recv_json(sock, [wire.HELLO_OK], remaining)
        wire.send_json(sock, wire.PULL, {"transfer_id": request.transfer_id, "lease_secret": request.lease_secret,
                                         "first_block": request.first_block, "num_blocks": request.num_blocks},
                       remaining)
        expected = request.num_blocks * layout.block_bytes_per_layer
        layers: list[bytearray] = []
        received = 0
        while True:
            if len(layers) > layout.num_layers:
                raise FrameError(f"got more than {layout.num_layers} layers of KV")
            msg_type, payload = wire.recv_frame(sock, [wire.LAYER, wire.PULL_DONE], expected, remaining)
            received += wire.HEADER.size + len(payload)
            if msg_type == wire.PULL_DONE:
                break
            layers.append(payload)
        if len(layers) != layout.num_layers:
            raise FrameError(f"got {len(layers)} layers of KV, expected {layout.num_layers}")
        seconds = self.clock() - started
        released = False
        if not request.release:  # hang up: the lease stays for the pull that releases it
            return PulledKV(layers, received, seconds, released)
        release_by = self.clock() + min(2.0, max(0.1, request.deadline - self.clock()))
        try:  # the blocks are here; a failed release only leaves the lease to expire on its own
            self._send_release(sock, request.transfer_id, request.lease_secret, release_by)
            released = True
        except (OSError, KVTransferError) as error:
            logger.warning("KV transfer %s pulled, but releasing its lease failed (%s); it expires on its own",
                           request.transfer_id, error)
        return PulledKV(layers, received, seconds, released)

    def _send_release(self, sock: socket.socket, transfer_id: str, secret: str, deadline: float) -> None:
        def left() -> float:
            seconds = deadline - self.clock()
            if seconds <= 0:
                raise KVTransferError("no RELEASED answer in time")
            return seconds

        wire.send_json(sock, wire.RELEASE, {"transfer_id": transfer_id, "lease_secret": secret}, left)
        wire.recv_json(sock, [wire.RELEASED], left)

    def release(self, host: str, port: int, transfer_id: str, secret: str, timeout: float = 2.0) -> bool:
        """Best effort: free a lease whose blocks will not be pulled (an aborted request)."""
        try:
            with socket.create_connection((host, port), timeout=timeout) as sock:
                self._send_release(sock, transfer_id, secret, self.clock() + timeout)
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
