"""KV transfer of a tensor- and pipeline-parallel engine's sharded cache: rank r of a decode group
pulls shard r (the KV of rank r's heads in rank r's pipeline stage's layers) from rank r of a
prefill group of the same tensor and pipeline sizes, each over its own authenticated TCP
connection, all ranks at once. Rank r is pipeline stage r // T, tensor rank r % T (T the
tensor-parallel size); with one stage the ranks are the tensor ranks.

Rank 0 runs the engine and its connector; `ShardedTransport` is that connector's transport. It
reaches the other ranks through `RankLinks` (engine/distributed/tensor_parallel.py: the local
connection each rank of its node reads its step plans from; the rendezvous store for the ranks of
other nodes, engine/distributed/multinode.py), and each other rank runs a `ShardServer`:

    rank 0 -> listen {host, port, engine_id}     rank i -> listening {port} | {error}   (prefill)
    rank 0 -> lease {transfer_id, secret, blocks, seconds}, unlease {transfer_id}      (prefill)
    rank 0 -> pull {key, host, port, transfer_id, secret, first_block, num_blocks, seconds}
                                                 rank i -> pulled {key, error, bytes}   (decode)

Prefill: rank 0 listens on --kv-transfer-port, rank i on that port + i (0: any free port each),
and the lease answer names the other ranks' listeners (kv_transfer_params.shards: the leader's
advertised host, or the address a rank of another node advertises for itself, which is also the
address it binds unless the leader binds every interface: `listen_host`). Every rank
serves a lease's block ids from its own pool (rank 0's scheduler gives every rank the same block
tables), with the lease's secret. Under pipeline parallelism every stage has written its layers'
KV of a prompt before rank 0 can lease it: rank 0 samples only once the last stage's logits have
arrived, and a stage sends its output on only after its layers ran. A rank's copy of a lease expires LEASE_MARGIN_S before rank 0's,
and rank 0 alone frees the blocks, so no rank serves a block that a later step writes.

Decode: the pull on rank 0 orders every rank's pull, pulls its own shard, then waits for every
rank's answer. It succeeds only when every rank holds its shard, and only then releases the lease
(at the prefill engine's rank 0: the other ranks' pulls hang up without releasing). Any rank's
failure fails the whole pull: the scheduler, on rank 0, recomputes the prompt (or fails the
request) and every rank follows its step plans, so no two ranks disagree about which blocks hold
valid KV. The other ranks keep a pulled shard in staging until a step plan loads it into the blocks
rank 0 chose (StepPlan.kv_loads) or drops it (kv_forget: the pull failed, the request was aborted,
or its sequence was preempted before the load).
"""

from __future__ import annotations

import dataclasses
import hmac
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

from iterserve.engine.kv_transfer.layout import KVLayout
from iterserve.engine.kv_transfer.transport import (
    KVSource,
    KVTransport,
    LeaseRead,
    PulledKV,
    PullRequest,
    TcpTransport,
)
from iterserve.engine.kv_transfer.wire import KVTransferError

logger = logging.getLogger(__name__)

KV = "kv"  # the first element of every message between ranks about KV transfer
LEASE_MARGIN_S = 1.0  # a rank's copy of a lease ends this much before rank 0's
LEASE_WAIT_S = 2.0  # a rank's listener waits this long for a lease rank 0 announced, not yet heard of
REPLY_TIMEOUT_S = 30.0  # the other ranks' answer to `listen`


class RankLinks(Protocol):
    """Rank 0's connections to the other ranks of its group (tp x stages ranks, rank 0 included)."""

    tp: int  # tensor-parallel size
    stages: int  # pipeline-parallel size

    def send(self, rank: int, message: tuple) -> None: ...


def rank_name(rank: int, tp: int, stages: int) -> str:
    """How errors and logs name a rank: its tensor rank with one stage, else its stage and tensor rank too."""
    if stages == 1:
        return f"tensor rank {rank}"
    stage, tensor_rank = divmod(rank, tp)
    return f"rank {rank} (pipeline stage {stage}, tensor rank {tensor_rank})"


def listen_host(leader_host: str, advertise: str | None) -> str:
    """Where a rank binds its KV listener, given the leader's bind address: a rank of the leader's
    node binds it too (advertise None: the lease names the leader's advertised host). A rank of
    another node binds the address it advertises, because the leader's address may be bindable
    there and still be the wrong machine's: where nodes share one loopback (the local pod runtime,
    each pod on its own 127.x address) binding it succeeds, and the decode rank dialing the
    advertised address is refused. A wildcard stays a wildcard (of the advertised family): the
    listener is reachable at the advertised address, as the leader's is at its advertised one."""
    if advertise is None:
        return leader_host
    if leader_host in ("0.0.0.0", "::", ""):
        return "::" if ":" in advertise else "0.0.0.0"
    return advertise


class ShardedTransport(KVTransport):
    """Rank 0's transport: its own shard over `inner`, the other ranks' through `links`;
    `deliver` is called with their answers (on rank 0's threads reading the links)."""

    def __init__(self, links: RankLinks, clock: Callable[[], float] = time.monotonic,
                 inner: TcpTransport | None = None):
        self.links = links
        self.clock = clock
        self.inner = inner or TcpTransport(clock=clock)
        self._cond = threading.Condition()
        self._replies: dict[tuple[str, str], dict[int, dict]] = {}  # (kind, key) -> rank -> answer
        self._listeners: list[tuple[str | None, int]] = []  # ranks 1..N-1's (None: the leader's host)
        self._order_keys: dict[str, str] = {}  # request id -> its pull's key on the other ranks
        self._settled: dict[str, str] = {}  # request id -> key, settled since the last step plan
        self._numbers = itertools.count()

    @property
    def ranks(self) -> range:
        return range(1, self.links.tp * self.links.stages)

    def _name(self, rank: int) -> str:
        return rank_name(rank, self.links.tp, self.links.stages)

    def deliver(self, rank: int, message: tuple) -> None:
        _, kind, body = message
        with self._cond:
            slot = self._replies.get((kind, str(body.get("key", ""))))
            if slot is not None:
                slot[rank] = body
                self._cond.notify_all()

    def _await(self, kind: str, key: str, deadline: float, cancel: threading.Event | None = None) -> dict[int, dict]:
        with self._cond:
            slot = self._replies[(kind, key)]
            while (len(slot) < len(self.ranks) and not any(answer.get("error") for answer in slot.values())
                   and not (cancel is not None and cancel.is_set())):
                left = deadline - self.clock()
                if left <= 0:
                    break
                self._cond.wait(min(left, 0.05))
            return self._replies.pop((kind, key))

    # -- prefill ------------------------------------------------------------------------------------
    def listen(self, source: KVSource, host: str, port: int) -> int:
        bound = self.inner.listen(source, host, port)
        with self._cond:
            self._replies[("listening", "")] = {}
        for rank in self.ranks:
            self.links.send(rank, (KV, "listen", {"host": host, "port": port + rank if port else 0,
                                                  "engine_id": source.engine_id}))
        replies = self._await("listening", "", self.clock() + REPLY_TIMEOUT_S)
        listeners = []
        for rank in self.ranks:
            answer = replies.get(rank)
            if answer is None:
                raise KVTransferError(f"{self._name(rank)} opened no KV transfer listener within {REPLY_TIMEOUT_S:.0f} s")
            if answer.get("error"):
                raise KVTransferError(f"{self._name(rank)} (which listens on --kv-transfer-port + {rank}): "
                                      f"{answer['error']}")
            listeners.append((answer.get("host"), int(answer["port"])))
        self._listeners = listeners
        return bound

    def shard_addresses(self, advertise_host: str) -> list[tuple[str, int]]:
        return [(host or advertise_host, port) for host, port in self._listeners]

    def lease_opened(self, transfer_id: str, secret: str, blocks: list[int], seconds: float) -> None:
        self._tell_all((KV, "lease", {"transfer_id": transfer_id, "secret": secret, "blocks": blocks,
                                      "seconds": seconds}))

    def lease_closed(self, transfer_id: str) -> None:
        self._tell_all((KV, "unlease", {"transfer_id": transfer_id}))

    def _tell_all(self, message: tuple) -> None:
        """On the engine thread: a rank that is gone ends the group (the runner reports it); a lease
        it did not hear of fails that lease's pulls, which recompute their prompts."""
        for rank in self.ranks:
            try:
                self.links.send(rank, message)
            except KVTransferError as error:
                logger.warning("KV transfer: %s; %s of %s not sent", error, message[1], message[2]["transfer_id"])

    # -- decode -------------------------------------------------------------------------------------
    def pull(self, request: PullRequest, layout: KVLayout, engine_id: str) -> PulledKV:
        started = self.clock()
        if len(request.shards) != len(self.ranks):  # the connector compared the sizes already
            raise KVTransferError(f"the lease names {len(request.shards)} other ranks, this engine has "
                                  f"{len(self.ranks)}")
        with self._cond:  # settled() cannot slip between the abort check and the orders
            if request.cancel.is_set():
                raise KVTransferError("the request was aborted while its KV was in flight")
            key = f"{request.key}#{next(self._numbers)}"
            self._order_keys[request.key] = key
            self._replies[("pulled", key)] = {}
            for rank, (host, port) in zip(self.ranks, request.shards, strict=True):
                self.links.send(rank, (KV, "pull", {
                    "key": key, "host": host, "port": port, "transfer_id": request.transfer_id,
                    "secret": request.lease_secret, "first_block": request.first_block,
                    "num_blocks": request.num_blocks, "seconds": max(0.0, request.deadline - self.clock())}))
        try:
            own = self.inner.pull(dataclasses.replace(request, release=False), layout, engine_id)
            replies = self._await("pulled", key, request.deadline, request.cancel)
            if request.cancel.is_set():
                raise KVTransferError("the request was aborted while its KV was in flight")
            # A failure first: the wait ends at the first one, before the other ranks have answered.
            for rank, answer in sorted(replies.items()):
                if answer.get("error"):
                    raise KVTransferError(f"{self._name(rank)}: {answer['error']}")
            for rank in self.ranks:
                if rank not in replies:
                    raise KVTransferError(f"{self._name(rank)} had no KV shard within --kv-transfer-timeout")
        except BaseException:
            with self._cond:
                self._replies.pop(("pulled", key), None)
            self.inner.release(request.host, request.port, request.transfer_id, request.lease_secret)
            raise
        released = self.inner.release(request.host, request.port, request.transfer_id, request.lease_secret)
        num_bytes = own.num_bytes + sum(int(replies[rank].get("bytes", 0)) for rank in self.ranks)
        return PulledKV(own.layers, num_bytes, self.clock() - started, released)

    def settled(self, request: PullRequest) -> None:
        with self._cond:
            key = self._order_keys.pop(request.key, None)
            if key is not None:
                self._settled[request.key] = key

    def take_settled(self) -> dict[str, str]:
        """Request id -> the other ranks' key of each pull settled since the last call (each step plan)."""
        with self._cond:
            settled, self._settled = self._settled, {}
            return settled

    def release(self, host: str, port: int, transfer_id: str, secret: str, timeout: float = 2.0) -> bool:
        return self.inner.release(host, port, transfer_id, secret, timeout)

    def close(self) -> None:
        self.inner.close()


@dataclass
class _ShardLease:
    secret: str
    blocks: list[int]
    expires_at: float


@dataclass
class _Staged:
    request: PullRequest
    layers: list[bytearray] | None = None


@dataclass
class ShardLoad:
    """A staged shard to copy into block_ids (what ModelRunner._load_kv reads)."""

    block_ids: list[int]
    layers: list[bytearray]


class ShardServer:
    """Rank r > 0's side: serves its shard of rank 0's leases, and pulls its shard of a decode
    request's KV into staging. `handle` takes rank 0's messages (on the rank's thread reading them);
    `reply` sends an answer to rank 0; `forget` and `take` run on the rank's step thread."""

    def __init__(self, rank: int, layout: KVLayout, read_layers: Callable[[list[int]], Iterator],
                 reply: Callable[[tuple], None], clock: Callable[[], float] = time.monotonic,
                 advertise: str | None = None):
        self.rank = rank
        self.advertise = advertise  # a rank of another node: its own address (None: the leader's)
        self.layout = layout
        # The layout names the group's shape ("tensor rank/size", "stage/stages").
        self.name = rank_name(rank, int(layout.shard.split("/")[1]), int(layout.stage.split("/")[1]))
        self.engine_id = f"rank{rank}"
        self._read_layers = read_layers
        self.reply = reply
        self.clock = clock
        self.transport = TcpTransport(clock=clock)
        self._cond = threading.Condition()
        self._leases: dict[str, _ShardLease] = {}
        self._staged: dict[str, _Staged] = {}

    def handle(self, message: tuple) -> None:
        _, kind, body = message
        if kind == "listen":
            self._listen(body)
        elif kind == "lease":
            now = self.clock()
            with self._cond:
                for transfer_id in [t for t, lease in self._leases.items() if lease.expires_at <= now]:
                    del self._leases[transfer_id]
                self._leases[body["transfer_id"]] = _ShardLease(body["secret"], list(body["blocks"]),
                                                                now + body["seconds"] - LEASE_MARGIN_S)
                self._cond.notify_all()
        elif kind == "unlease":
            with self._cond:
                self._leases.pop(body["transfer_id"], None)
        elif kind == "pull":
            self._start_pull(body)
        else:
            logger.warning("%s: unknown KV transfer message %r", self.name, kind)

    def _listen(self, body: dict) -> None:
        self.engine_id = f"{body['engine_id']}/rank{self.rank}"
        host = listen_host(body["host"], self.advertise)
        try:
            port = self.transport.listen(self, host, body["port"])
        except KVTransferError as error:
            self.reply((KV, "listening", {"error": str(error)}))
            return
        logger.info("%s: KV transfer listener on %s:%d (layout %s)", self.name, host, port, self.layout)
        self.reply((KV, "listening", {"port": port, "host": self.advertise}))

    # KVSource: called on the transport's threads.
    def open_read(self, transfer_id: str, secret: str, first_block: int, num_blocks: int) -> LeaseRead:
        deadline = self.clock() + LEASE_WAIT_S
        with self._cond:
            while (lease := self._leases.get(transfer_id)) is None and self.clock() < deadline:
                self._cond.wait(0.05)
            if lease is None or not hmac.compare_digest(lease.secret.encode(), secret.encode()):
                raise KVTransferError(f"no lease {transfer_id[:64]} with that secret on {self.name} "
                                      "(expired, released, or never made)")
            if self.clock() >= lease.expires_at:
                raise KVTransferError(f"lease {transfer_id} expired")
            if first_block < 0 or num_blocks < 1 or first_block + num_blocks > len(lease.blocks):
                raise KVTransferError(f"blocks [{first_block}, {first_block + num_blocks}) are outside lease "
                                      f"{transfer_id}, which holds {len(lease.blocks)}")
            return LeaseRead(lease.blocks[first_block : first_block + num_blocks], lease.expires_at)

    def read_layers(self, block_ids: list[int]) -> Iterator[tuple[memoryview, memoryview]]:
        return self._read_layers(block_ids)

    def close_read(self, transfer_id: str) -> None:
        pass  # rank 0 frees the blocks, never before this rank's copy of the lease has ended

    def release(self, transfer_id: str, secret: str) -> bool:
        return False  # the lease is rank 0's: decode engines release it there

    # -- decode -------------------------------------------------------------------------------------
    def _start_pull(self, body: dict) -> None:
        key = str(body["key"])
        request = PullRequest(str(body["host"]), int(body["port"]), str(body["transfer_id"]), str(body["secret"]),
                              int(body["first_block"]), int(body["num_blocks"]), self.clock() + float(body["seconds"]),
                              key=key, release=False)
        staged = _Staged(request)
        with self._cond:
            self._staged[key] = staged
        threading.Thread(target=self._run_pull, args=(staged,), name="kv-shard-pull", daemon=True).start()

    def _run_pull(self, staged: _Staged) -> None:
        request, error, num_bytes = staged.request, None, 0
        try:
            result = self.transport.pull(request, self.layout, self.engine_id)
            num_bytes = result.num_bytes
        except KVTransferError as failure:
            error = str(failure)
        except Exception as failure:  # noqa: BLE001 - reported as this pull's failure
            logger.exception("%s: KV pull %s failed unexpectedly", self.name, request.transfer_id)
            error = f"{type(failure).__name__}: {failure}"
        with self._cond:
            if error is None and self._staged.get(request.key) is staged:
                staged.layers = result.layers
            elif error is None:
                error = "dropped: rank 0 gave the pull up"
        self.reply((KV, "pulled", {"key": request.key, "error": error, "bytes": num_bytes}))

    def forget(self, key: str) -> None:
        with self._cond:
            staged = self._staged.pop(key, None)
        if staged is not None:
            staged.request.cancel.set()

    def take(self, key: str, block_ids: list[int]) -> ShardLoad:
        with self._cond:
            staged = self._staged.pop(key, None)
        if staged is None or staged.layers is None:
            raise RuntimeError(f"{self.name}: the step plan loads KV {key!r}, which this rank has not "
                               "pulled")
        return ShardLoad(block_ids, staged.layers)

    def close(self) -> None:
        self.transport.close()
