"""The scheduler side of KV transfer: leases on a prefill engine, pulls on a decode engine.

Prefill: when a request that asked for do_remote_decode finishes, `pin` takes one more reference
on its prompt blocks (so they outlive the sequence and no preemption can take them) under a
lease. The transport's threads read leased blocks; a lease being read is never freed. `collect`,
on the engine thread each step, frees leases the decode engine released and leases past their
expiry.

Decode: the scheduler gives a sequence its blocks, parks it "waiting for KV" and calls
`start_pull`; a pull thread fetches the blocks into staging buffers (never into the pool) and
wakes the engine; the scheduler then `poll`s the result and loads it at the start of a step.

Clocks: leases, pulls and the transport's deadlines all read the injected `clock` (monotonic by
default), so a test's fake clock drives every one of them. Only what crosses machines (a lease's
expiry as written into kv_transfer_params, the MAC's expires_at) is in unix seconds, read from
`wall_clock`: two pods' monotonic clocks cannot be compared.

Tensor and pipeline parallelism (kv_transfer/sharded.py): on an engine of several ranks this
connector runs on rank 0 and its transport reaches the others. The lease answer adds
tensor_parallel_size, pipeline_parallel_size and the other ranks' listeners (shards); a pull
fetches every rank's shard (its heads of its stage's layers), rank r's from the prefill engine's
rank r, and finishes only when all have theirs: one outcome, decided here, for every rank. A pull
from an engine of another tensor- or pipeline-parallel size is refused before any dial, naming
both sizes.

Trust: with a KV key (--kv-auth-key-file), `pin` signs the lease it answers (auth.py) and gives it
a random secret that the transport asks for on PULL and RELEASE. Leases hold at most
--kv-max-leased-fraction of the pool: beyond it a prefill call is answered without a lease (the
router then prefills on the decode replica), so do_remote_decode calls cannot pin the pool.
"""

from __future__ import annotations

import hmac
import logging
import secrets
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from iterserve.engine.block_manager import BlockManager
from iterserve.engine.config import EngineConfig
from iterserve.engine.kv_transfer import auth
from iterserve.engine.kv_transfer.layout import KVLayout
from iterserve.engine.kv_transfer.params import KVTransferState
from iterserve.engine.kv_transfer.transport import (
    KVTransport,
    LeaseRead,
    PulledKV,
    PullRequest,
    TcpTransport,
)
from iterserve.engine.kv_transfer.wire import KVTransferError
from iterserve.engine.sequence import Sequence

logger = logging.getLogger(__name__)
SIGNATURE_GRACE_SECONDS = 60.0


@dataclass
class Lease:
    transfer_id: str
    blocks: list[int]
    num_tokens: int
    expires_at: float  # engine clock
    secret: str
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
    leases_released: int = 0
    leases_expired: int = 0
    leases_refused: int = 0  # prefill calls answered without a lease: the leased-blocks cap was reached
    blocks_pulled: int = 0  # decode side: blocks received by successful pulls
    blocks_from_cache: int = 0  # decode side: lease blocks not pulled, found in the local prefix cache


class KVConnector:
    def __init__(self, config: EngineConfig, block_manager: BlockManager, layout: KVLayout,
                 read_layers: Callable[[list[int]], Iterator[tuple[memoryview, memoryview]]],
                 clock: Callable[[], float] = time.monotonic, transport: KVTransport | None = None,
                 wall_clock: Callable[[], float] = time.time):
        self.config = config
        self.block_manager = block_manager
        self.layout = layout
        self._read_layers = read_layers
        self.clock = clock
        self.wall_clock = wall_clock
        self.transport = transport or TcpTransport(clock=clock)
        # Roles prefill and decode need the key (EngineConfig.validate); role both takes no
        # kv_transfer_params, so it has none.
        self.auth_key = auth.load_key(config.kv_auth_key_file) if config.kv_auth_key_file else None
        self.max_leased_blocks = int(block_manager.num_blocks * config.kv_max_leased_fraction)
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

    def pin(self, seq: Sequence) -> dict | None:
        """Lease seq's prompt blocks (seq is finishing); returns the signed kv_transfer_params to
        answer, or None when leased blocks would pass --kv-max-leased-fraction of the pool."""
        num_tokens = seq.num_prompt_tokens
        blocks = list(seq.block_table[: self.block_manager.blocks_for(num_tokens)])
        if self.num_pinned_blocks + len(blocks) > self.max_leased_blocks:
            self.counts.leases_refused += 1
            logger.warning("request %s: answered without a KV lease, leased blocks would pass %d "
                           "(--kv-max-leased-fraction %g of %d)", seq.request_id, self.max_leased_blocks,
                           self.config.kv_max_leased_fraction, self.block_manager.num_blocks)
            return None
        self.block_manager.pin(blocks)
        transfer_id, secret = uuid.uuid4().hex, secrets.token_urlsafe(24)
        lease_s = self.config.kv_lease_seconds
        with self._lock:
            self._leases[transfer_id] = Lease(transfer_id, blocks, num_tokens, self.clock() + lease_s, secret)
        self.transport.lease_opened(transfer_id, secret, blocks, lease_s)
        logger.debug("pinned %d blocks of request %s under transfer %s for %.0f s", len(blocks), seq.request_id,
                     transfer_id, lease_s)
        expires_at = self.wall_clock() + lease_s
        params = {
            "transfer_id": transfer_id, "engine_id": self.engine_id, "host": self.host, "port": self.port,
            "block_ids": blocks, "num_tokens": num_tokens, "block_size": self.block_manager.block_size,
            "compat_hash": self.compat_hash, "lease_expires_at": round(expires_at, 3), "lease_secret": secret,
        }
        tp, pp = self.config.tensor_parallel_size, self.config.pipeline_parallel_size
        if tp * pp > 1:
            params["tensor_parallel_size"] = tp
            if pp > 1:  # absent means 1, so a lease of one stage reads as it did before stages
                params["pipeline_parallel_size"] = pp
            params["shards"] = [list(address) for address in self.transport.shard_addresses(self.host)]
        if self.auth_key is None:
            return params
        # The MAC outlives the lease by a grace: a decode call that arrives just late is answered by
        # recomputing the prompt (the pull finds no lease), not with a 400 to the user.
        return auth.sign(params, self.auth_key, auth.REMOTE_PREFILL, expires_at + SIGNATURE_GRACE_SECONDS)

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
            self.transport.lease_closed(lease.transfer_id)
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

    def _lease(self, transfer_id: str, secret: str) -> Lease | None:
        """The lease, if secret is its own (compared in constant time); under self._lock."""
        lease = self._leases.get(transfer_id)
        if lease is None or not hmac.compare_digest(lease.secret.encode(), secret.encode()):
            return None
        return lease

    # KVSource: called on the transport's threads.
    def open_read(self, transfer_id: str, secret: str, first_block: int, num_blocks: int) -> LeaseRead:
        with self._lock:
            lease = self._lease(transfer_id, secret)
            if lease is None or lease.released:
                # One message for unknown, released and wrong-secret leases: it tells a prober nothing.
                raise KVTransferError(f"no lease {transfer_id[:64]} with that secret here (expired after "
                                      f"--kv-lease-seconds {self.config.kv_lease_seconds:g}, released, or never made "
                                      f"on engine {self.engine_id})")
            if self.clock() >= lease.expires_at:
                raise KVTransferError(f"lease {transfer_id} expired")
            if first_block < 0 or num_blocks < 1 or first_block + num_blocks > len(lease.blocks):
                raise KVTransferError(f"blocks [{first_block}, {first_block + num_blocks}) are outside lease "
                                      f"{transfer_id}, which holds {len(lease.blocks)}")
            lease.readers += 1
            return LeaseRead(lease.blocks[first_block : first_block + num_blocks], lease.expires_at)

    def read_layers(self, block_ids: list[int]) -> Iterator[tuple[memoryview, memoryview]]:
        return self._read_layers(block_ids)

    def close_read(self, transfer_id: str) -> None:
        with self._lock:
            lease = self._leases.get(transfer_id)
            if lease is not None:
                lease.readers -= 1

    def release(self, transfer_id: str, secret: str) -> bool:
        with self._lock:
            lease = self._lease(transfer_id, secret)
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
        request = PullRequest(remote.host, remote.port, remote.transfer_id, remote.lease_secret, first_block,
                              len(remote.block_ids) - first_block, self.clock() + self.config.kv_transfer_timeout,
                              key=seq.request_id, shards=remote.shards)
        self.counts.blocks_from_cache += first_block
        pull = Pull(request, self.clock())
        self._pulls[seq.request_id] = pull
        problem = self._check_remote(seq)
        if problem:
            pull.error = problem
            pull.finished.set()
            if remote.authenticated:  # a peer's lease that will never be pulled: free it now, not at its expiry
                self._release_later(remote)
            return
        threading.Thread(target=self._run_pull, args=(pull,), name="kv-pull", daemon=True).start()

    def _check_remote(self, seq: Sequence) -> str | None:
        remote = seq.kv_transfer.remote_prefill
        if not remote.authenticated:  # never dial an address a client chose (params.accept signs them)
            return "the kv_transfer_params were not authenticated"
        if remote.tensor_parallel_size != self.config.tensor_parallel_size:
            return (f"the prefill engine runs --tensor-parallel-size {remote.tensor_parallel_size}, this decode engine "
                    f"{self.config.tensor_parallel_size}: each rank holds the KV of its own heads, so a sharded cache "
                    "moves only between groups of one size; run both pools with the same --tensor-parallel-size")
        if remote.pipeline_parallel_size != self.config.pipeline_parallel_size:
            return (f"the prefill engine runs --pipeline-parallel-size {remote.pipeline_parallel_size}, this decode "
                    f"engine {self.config.pipeline_parallel_size}: each rank holds the KV of its own stage's layers, "
                    "so a staged cache moves only between groups of one stage split; run both pools with the same "
                    "--pipeline-parallel-size")
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
        now = self.wall_clock()
        if remote.lease_expires_at < now:
            return f"the lease expired {now - remote.lease_expires_at:.1f} s before the pull started"
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
            if self.clock() < pull.request.deadline + 1.0:
                return None
            pull.error = f"no answer within --kv-transfer-timeout {self.config.kv_transfer_timeout:g} s"
            pull.request.cancel.set()
        del self._pulls[seq.request_id]
        self.transport.settled(pull.request)
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
        self.transport.settled(pull.request)
        self._release_later(seq.kv_transfer.remote_prefill)

    def _release_later(self, remote) -> None:
        threading.Thread(target=self.transport.release,
                         args=(remote.host, remote.port, remote.transfer_id, remote.lease_secret), daemon=True,
                         name="kv-release").start()

    def close(self) -> None:
        for pull in self._pulls.values():
            pull.request.cancel.set()
        self.transport.close()
