"""The scheduler side of KV transfer: leases on a prefill engine, pulls on a decode engine.

Prefill: when a request that asked for do_remote_decode finishes, `pin` takes one more reference
on its prompt blocks (so they outlive the sequence and no preemption can take them) under a
lease. The transport's threads read leased blocks; a lease being read is never freed. `collect`,
on the engine thread each step, frees leases the decode engine released and leases past their
expiry.

Decode: the scheduler gives a sequence its blocks, parks it "waiting for KV" and calls
`start_pull`; a pull thread fetches the blocks into staging buffers (never into the pool) and
wakes the engine; the scheduler then `poll`s the result and loads it at the start of a step.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from iterserve.engine.block_manager import BlockManager
from iterserve.engine.config import EngineConfig
from iterserve.engine.kv_transfer.layout import KVLayout
from iterserve.engine.kv_transfer.params import KVTransferState
from iterserve.engine.kv_transfer.transport import KVTransport, PulledKV, PullRequest, TcpTransport
from iterserve.engine.kv_transfer.wire import KVTransferError
from iterserve.engine.sequence import Sequence

logger = logging.getLogger(__name__)


@dataclass
class Lease:
    transfer_id: str
    blocks: list[int]
    num_tokens: int
    expires_at: float  # engine clock
    readers: int = 0
    released: bool = False


@dataclass
class Pull:
    request: PullRequest
    started: float
    finished: threading.Event = field(default_factory=threading.Event)
    result: PulledKV | None = None
    error: str | None = None


@dataclass
class TransferCounts:
    pulls_ok: int = 0
    pulls_failed: int = 0
    leases_created: int = 0
    leases_released: int = 0
    leases_expired: int = 0
    blocks_pulled: int = 0  # decode side: blocks received by successful pulls
    blocks_from_cache: int = 0  # decode side: lease blocks not pulled, found in the local prefix cache


class KVConnector:
    def __init__(self, config: EngineConfig, block_manager: BlockManager, layout: KVLayout,
                 read_layers: Callable[[list[int]], Iterator[tuple[memoryview, memoryview]]],
                 clock: Callable[[], float] = time.monotonic, transport: KVTransport | None = None):
        self.config = config
        self.block_manager = block_manager
        self.layout = layout
        self._read_layers = read_layers
        self.clock = clock
        self.transport = transport or TcpTransport()
        self.engine_id = uuid.uuid4().hex[:16]
        self.compat_hash = layout.compat_hash
        self.host: str | None = None  # advertised in kv_transfer_params, once listening
        self.port: int | None = None
        self.counts = TransferCounts()
        self.wake: Callable[[], None] = lambda: None  # the engine loop's wake-up (AsyncEngine)
        self.on_transfer: Callable[[float, int], None] | None = None  # (seconds, bytes) per finished pull
        self._leases: dict[str, Lease] = {}
        self._lock = threading.Lock()
        self._pulls: dict[str, Pull] = {}  # request id -> its pull

    # -- prefill side ------------------------------------------------------------------------
    def listen(self, host: str, port: int, advertise_host: str | None = None) -> int:
        self.port = self.transport.listen(self, host, port)
        self.host = advertise_host or host
        logger.info("KV transfer listener on %s:%d (advertised as %s), engine id %s, layout %s, compat hash %s",
                    host, self.port, self.host, self.engine_id, self.layout, self.compat_hash)
        return self.port

    def pin(self, seq: Sequence) -> dict:
        """Lease seq's prompt blocks (seq is finishing); returns the kv_transfer_params to answer."""
        num_tokens = seq.num_prompt_tokens
        blocks = list(seq.block_table[: self.block_manager.blocks_for(num_tokens)])
        self.block_manager.pin(blocks)
        transfer_id = uuid.uuid4().hex
        lease_s = self.config.kv_lease_seconds
        with self._lock:
            self._leases[transfer_id] = Lease(transfer_id, blocks, num_tokens, self.clock() + lease_s)
        self.counts.leases_created += 1
        logger.debug("pinned %d blocks of request %s under transfer %s for %.0f s", len(blocks), seq.request_id,
                     transfer_id, lease_s)
        return {
            "transfer_id": transfer_id, "engine_id": self.engine_id, "host": self.host, "port": self.port,
            "block_ids": blocks, "num_tokens": num_tokens, "block_size": self.block_manager.block_size,
            "compat_hash": self.compat_hash, "lease_expires_at": round(time.time() + lease_s, 3),
        }

    def collect(self) -> int:
        """On the engine thread: free released and expired leases nobody is reading. Returns the
        number of blocks given back."""
        if not self._leases:
            return 0
        now = self.clock()
        done: list[Lease] = []
        with self._lock:
            for lease in list(self._leases.values()):
                if lease.readers == 0 and (lease.released or now >= lease.expires_at):
                    done.append(self._leases.pop(lease.transfer_id))
        freed = 0
        for lease in done:
            if lease.released:
                self.counts.leases_released += 1
            else:
                self.counts.leases_expired += 1
                logger.warning("KV transfer %s expired unreleased after %.0f s (no decode engine pulled it); its "
                               "%d blocks are freed", lease.transfer_id, self.config.kv_lease_seconds,
                               len(lease.blocks))
            self.block_manager.unpin(lease.blocks)
            freed += len(lease.blocks)
        return freed

    def release_all(self) -> None:
        """On the engine thread, at shutdown or in tests: free every lease nobody is reading."""
        with self._lock:
            for lease in self._leases.values():
                lease.released = True
        self.collect()

    @property
    def num_leases(self) -> int:
        return len(self._leases)

    @property
    def num_pinned_blocks(self) -> int:
        with self._lock:
            return len({block for lease in self._leases.values() for block in lease.blocks})

    # KVSource: called on the transport's threads.
    def open_read(self, transfer_id: str, first_block: int, num_blocks: int) -> list[int]:
        with self._lock:
            lease = self._leases.get(transfer_id)
            if lease is None or lease.released:
                raise KVTransferError(f"no lease {transfer_id} here (expired after --kv-lease-seconds "
                                      f"{self.config.kv_lease_seconds:g}, released, or never made on engine "
                                      f"{self.engine_id})")
            if self.clock() >= lease.expires_at:
                raise KVTransferError(f"lease {transfer_id} expired")
            if first_block < 0 or num_blocks < 1 or first_block + num_blocks > len(lease.blocks):
                raise KVTransferError(f"blocks [{first_block}, {first_block + num_blocks}) are outside lease "
                                      f"{transfer_id}, which holds {len(lease.blocks)}")
            lease.readers += 1
            return lease.blocks[first_block : first_block + num_blocks]

    def read_layers(self, block_ids: list[int]) -> Iterator[tuple[memoryview, memoryview]]:
        return self._read_layers(block_ids)

    def close_read(self, transfer_id: str) -> None:
        with self._lock:
            lease = self._leases.get(transfer_id)
            if lease is not None:
                lease.readers -= 1

    def release(self, transfer_id: str) -> bool:
        with self._lock:
            lease = self._leases.get(transfer_id)
            if lease is None:
                return False
            lease.released = True
        self.wake()
        return True

    # -- decode side -------------------------------------------------------------------------
    def start_pull(self, seq: Sequence, first_block: int = 0) -> None:
        """Begin fetching seq's prompt KV into staging (seq already has its blocks), from the lease's
        block first_block on (the earlier ones are in this engine's prefix cache)."""
        kv: KVTransferState = seq.kv_transfer
        remote = kv.remote_prefill
        request = PullRequest(remote.host, remote.port, remote.transfer_id, first_block,
                              len(remote.block_ids) - first_block, time.monotonic() + self.config.kv_transfer_timeout)
        self.counts.blocks_from_cache += first_block
        pull = Pull(request, time.monotonic())
        self._pulls[seq.request_id] = pull
        problem = self._check_remote(seq)
        if problem:
            pull.error = problem
            pull.finished.set()
            return
        threading.Thread(target=self._run_pull, args=(pull,), name="kv-pull", daemon=True).start()

    def _check_remote(self, seq: Sequence) -> str | None:
        remote = seq.kv_transfer.remote_prefill
        if remote.compat_hash != self.compat_hash:
            return (f"compat_hash {remote.compat_hash} differs from this engine's {self.compat_hash} (another model, "
                    "dtype or block size on the prefill engine)")
        if remote.block_size != self.block_manager.block_size:
            return f"block_size {remote.block_size} differs from this engine's {self.block_manager.block_size}"
        if remote.num_tokens != seq.num_prompt_tokens:
            return (f"the prefill engine computed {remote.num_tokens} prompt tokens, this request has "
                    f"{seq.num_prompt_tokens} (a different prompt or tokenizer)")
        if len(remote.block_ids) != self.block_manager.blocks_for(remote.num_tokens):
            return f"{len(remote.block_ids)} block ids for {remote.num_tokens} tokens"
        if remote.lease_expires_at < time.time():
            return f"the lease expired {time.time() - remote.lease_expires_at:.1f} s before the pull started"
        return None

    def _run_pull(self, pull: Pull) -> None:
        try:
            pull.result = self.transport.pull(pull.request, self.layout, self.engine_id)
        except KVTransferError as error:
            pull.error = str(error)
        except Exception as error:  # noqa: BLE001 - reported as this request's transfer failure
            logger.exception("KV pull %s failed unexpectedly", pull.request.transfer_id)
            pull.error = f"{type(error).__name__}: {error}"
        pull.finished.set()
        self.wake()

    def poll(self, seq: Sequence) -> Pull | None:
        """seq's pull once it has finished (ok, failed or past the timeout), else None."""
        pull = self._pulls.get(seq.request_id)
        if pull is None:
            return None
        if not pull.finished.is_set():
            if time.monotonic() < pull.request.deadline + 1.0:
                return None
            pull.error = f"no answer within --kv-transfer-timeout {self.config.kv_transfer_timeout:g} s"
            pull.request.cancel.set()
        del self._pulls[seq.request_id]
        if pull.error is None:
            self.counts.pulls_ok += 1
            self.counts.blocks_pulled += pull.request.num_blocks
            if self.on_transfer is not None:
                self.on_transfer(pull.result.seconds, pull.result.num_bytes)
        else:
            self.counts.pulls_failed += 1
        return pull

    def cancel(self, seq: Sequence) -> None:
        """seq was aborted while waiting for KV: stop its pull; the lease is released at once."""
        pull = self._pulls.pop(seq.request_id, None)
        if pull is None:
            return
        pull.request.cancel.set()
        remote = seq.kv_transfer.remote_prefill
        release = getattr(self.transport, "release", None)
        if release is not None:
            threading.Thread(target=release, args=(remote.host, remote.port, remote.transfer_id), daemon=True,
                             name="kv-release").start()

    @property
    def num_pulls(self) -> int:
        return len(self._pulls)

    def close(self) -> None:
        for pull in self._pulls.values():
            pull.request.cancel.set()
        self.transport.close()
