"""Iteration-level scheduling: one decision per model step.

Each step has a token budget (max_num_batched_tokens). Running sequences are served first, in
arrival order, each advancing toward its token count (a decode token, or the next prefill chunk).
When the KV pool runs out, the most recently admitted sequence is preempted: its blocks are freed
(recompute) or copied to the CPU pool (swap). In a step without preemption, swapped sequences are
resumed and then waiting requests admitted while the budget and max_num_seqs allow.

With prefix caching, an admitted request starts with the cached blocks of its longest cached
prefix and prefills only the rest; blocks become shareable once a step has computed them.

Prefill/decode disaggregation (engine/kv_transfer): a request whose prompt KV comes from a
prefill engine is admitted without using the step's token budget: it gets its blocks and waits
for KV (WAITING_FOR_KV) outside the running list, so preemption never picks it mid-transfer. It
counts toward max_num_seqs. Once its pull has finished, the step that follows loads the KV into
its blocks (SchedulerOutput.kv_loads, before the model runs) and computes its last prompt token;
a failed pull recomputes the prompt locally (policy recompute) or fails the request (policy fail).
On a prefill engine, a request that asked for do_remote_decode has its prompt blocks leased
(pinned) by the connector when it finishes.

Speculative decoding (engine/spec_decode): a decoding sequence the engine gave proposals
(seq.spec_token_ids) is scheduled as 1 + k query tokens, its last token and the proposals; the
proposals count against the token budget, and leave the budget's prefill share
(long_prefill_token_threshold) to prompts while any wait or prefill. They are trimmed to what the
budget and the KV pool allow, and dropped before anyone is preempted for them. After the step the
sampler's accepted tokens and the one it sampled after them are appended; the KV of rejected
positions is rolled back (BlockManager.truncate) and only full blocks of accepted tokens are named
in the prefix cache.

The scheduler knows nothing of time, torch or HTTP.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass, field

from iterserve.engine.block_manager import BlockManager
from iterserve.engine.config import EngineConfig
from iterserve.engine.sequence import Sequence, SequenceStatus
from iterserve.engine.stop import token_stop_reason

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ScheduledChunk:
    seq: Sequence
    start: int  # first position computed this step
    num_tokens: int
    sample: bool  # the chunk reaches the sequence's last token, so the step samples a new one
    num_spec: int = 0  # proposed tokens at the chunk's end, verified by this step (spec decoding)

    @property
    def is_decode(self) -> bool:
        return self.num_tokens == 1 + self.num_spec and self.start >= self.seq.num_prompt_tokens


@dataclass(slots=True)
class KVLoad:
    """Pulled KV to copy into seq's blocks before this step's model run: per layer, K then V bytes."""

    seq: Sequence
    block_ids: list[int]
    layers: list
    first_block: int = 0  # the prompt block block_ids[0] holds (earlier ones came from the prefix cache)


@dataclass(slots=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (gpu_block, cpu_block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu_block, gpu_block)
    preempted: list[Sequence] = field(default_factory=list)
    kv_loads: list[KVLoad] = field(default_factory=list)
    # Requests whose KV pull failed under --kv-failure-policy fail: (seq, why); already finished.
    kv_failed: list[tuple[Sequence, str]] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(chunk.num_tokens for chunk in self.chunks)

    @property
    def num_decode_tokens(self) -> int:
        return sum(chunk.num_tokens for chunk in self.chunks if chunk.is_decode)

    @property
    def num_prefill_tokens(self) -> int:
        return self.num_batched_tokens - self.num_decode_tokens

    @property
    def is_empty(self) -> bool:
        return not self.chunks and not self.swap_out and not self.swap_in and not self.kv_loads


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager):
        self.config = config
        self.block_manager = block_manager
        self._max_num_seqs = config.max_num_seqs
        self._pending_max_num_seqs: int | None = None  # set from any thread, applied by schedule()
        self._pending_lock = threading.Lock()
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped: deque[Sequence] = deque()
        self.waiting_for_kv: list[Sequence] = []  # decode role: blocks held, prompt KV in flight
        self.connector = None  # engine/kv_transfer/connector.KVConnector, when KV transfer is on
        self.num_preemptions = 0
        self.spec_stats = None  # engine/spec_decode/policy.SpecDecodeStats while speculation is on
        self.spec_policy = None

    # -- the running-sequence cap ------------------------------------------------------------
    @property
    def max_num_seqs(self) -> int:
        """The cap the next schedule() applies (including a change requested since the last one)."""
        with self._pending_lock:
            pending = self._pending_max_num_seqs
        return self._max_num_seqs if pending is None else pending

    def request_max_num_seqs(self, value: int) -> None:
        """Queue a new cap, from any thread: schedule() applies it at its start, between steps, so
        a step never sees the cap change under it. Running sequences are never preempted for it."""
        with self._pending_lock:
            self._pending_max_num_seqs = value

    def _apply_max_num_seqs(self) -> None:
        with self._pending_lock:
            pending, self._pending_max_num_seqs = self._pending_max_num_seqs, None
        if pending is not None:
            self._max_num_seqs = pending

    # -- queue membership -------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped or self.waiting_for_kv)

    def queued_prompt_tokens(self, arriving: tuple[Sequence, ...] = ()) -> int:
        """Prompt tokens still to compute here: of waiting requests, and of running ones still
        prefilling (a preempted-by-recompute request counts its prompt again), and of `arriving`
        ones not added yet (the engine's inbox). Prompts whose KV is pulled from a prefill engine
        are not computed here and do not count. Safe to call from any thread: it reads copies of
        the queues."""
        total = 0
        for seq in (*arriving, *tuple(self.waiting), *tuple(self.running)):
            if seq.kv_transfer is not None and seq.kv_transfer.wants_pull:
                continue
            total += max(0, seq.num_prompt_tokens - seq.num_computed_tokens)
        return total

    def finish(self, seq: Sequence, reason: str) -> None:
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status is SequenceStatus.SWAPPED:
            self.swapped.remove(seq)
        elif seq.status is SequenceStatus.WAITING_FOR_KV:
            # Aborted mid-transfer: the pull writes only its own staging buffers, so the blocks can
            # go back at once; the connector stops the pull and releases the prefill engine's lease.
            self.waiting_for_kv.remove(seq)
            self.connector.cancel(seq)
        else:
            self.running.remove(seq)
        kv = seq.kv_transfer
        if kv is not None and kv.remote_decode and reason in ("stop", "length") and self.connector is not None:
            kv.params_out = self.connector.pin(seq)  # before free: the lease's hold keeps the blocks
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    # -- one step ----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        self._apply_max_num_seqs()
        out = SchedulerOutput()
        if self.waiting_for_kv:
            self._poll_kv_transfers(out)
        if self.config.scheduling == "static" and not self.running and not self.swapped:
            self._admit_static_batch()
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        if not out.preempted:
            budget = self._resume_swapped(out, budget)
            if self.config.scheduling == "continuous":
                self._admit_waiting(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        index = 0
        # Proposals share what the budget has beyond one token per running sequence and the prefill share.
        spec_room = max(0, budget - len(self.running) - self._prefill_reserve())
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            num_new = self._chunk_size(seq, budget, bool(self.waiting))
            if num_new == 0:
                index += 1
                continue
            num_spec = self._spec_tokens(seq, num_new, min(spec_room, budget - 1))
            spec_room -= num_spec
            num_new += num_spec
            while not self.block_manager.can_allocate(seq, num_new):
                if num_spec:  # proposals are never worth a preemption
                    num_new, num_spec = num_new - num_spec, self._drop_proposals(seq)
                    continue
                victim = self.running.pop()
                self._preempt(victim, out)
                if victim is seq:
                    return budget
            self._schedule(seq, num_new, out, num_spec)
            budget -= num_new
            index += 1
        return budget

    def _prefill_reserve(self) -> int:
        """Budget proposals leave to prompts: the prefill share while a prompt waits or prefills."""
        if not any(seq.spec_token_ids for seq in self.running):
            return 0
        if not self.waiting and all(s.num_computed_tokens >= s.num_tokens - 1 for s in self.running):
            return 0
        return self.config.long_prefill_token_threshold or max(16, self.config.max_num_batched_tokens // 8)

    def _spec_tokens(self, seq: Sequence, num_new: int, room: int) -> int:
        """How many of seq's proposals this step verifies: only a decode step, within the room left."""
        proposals = seq.spec_token_ids
        if not proposals:
            return 0
        if num_new != 1 or seq.num_computed_tokens != seq.num_tokens - 1:
            return self._drop_proposals(seq)
        keep = max(0, min(len(proposals), room))
        if keep < len(proposals):
            del proposals[keep:]
            if seq.spec_draft_probs is not None:
                seq.spec_draft_probs = seq.spec_draft_probs[:keep] if keep else None
        return keep

    @staticmethod
    def _drop_proposals(seq: Sequence) -> int:
        seq.spec_token_ids = []
        seq.spec_draft_probs = None
        return 0

    def _resume_swapped(self, out: SchedulerOutput, budget: int) -> int:
        while self.swapped and budget > 0 and len(self.running) < self._max_num_seqs:
            seq = self.swapped[0]
            if not self.block_manager.can_swap_in(seq):
                break
            self.swapped.popleft()
            out.swap_in.extend(self.block_manager.swap_in(seq))
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            num_new = self._chunk_size(seq, budget, bool(self.waiting))
            if num_new and self.block_manager.can_allocate(seq, num_new):
                self._schedule(seq, num_new, out)
                budget -= num_new
        return budget

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) + len(self.waiting_for_kv) < self._max_num_seqs:
            if not self._lora_fits(self.waiting[0]) and not self._admissible_to_front():
                break
            seq = self.waiting[0]
            if seq.kv_transfer is not None and seq.kv_transfer.wants_pull and self.connector is not None:
                if not self._admit_for_kv(seq):
                    break
                continue
            prefix = self.block_manager.match_prefix(seq)
            num_cached = len(prefix) * self.block_manager.block_size
            num_new = self._chunk_size(seq, budget, len(self.waiting) > 1, num_cached)
            if num_new == 0 or not self.block_manager.can_allocate(seq, num_new, keep_watermark=True, prefix=prefix):
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self.block_manager.start_with_prefix(seq, prefix)
            self._schedule(seq, num_new, out)
            budget -= num_new

    def _lora_fits(self, seq: Sequence) -> bool:
        """--max-loras: at most that many adapters run at once (each step's adapters need device slots)."""
        if seq.lora_name is None:
            return True
        active = {s.lora_name for s in (*self.running, *self.waiting_for_kv, *self.swapped) if s.lora_name is not None}
        return seq.lora_name in active or len(active) < self.config.max_loras

    def _admissible_to_front(self) -> bool:
        """The head waits for an adapter slot: move the first request that fits to the front instead,
        so a busy adapter set does not block the base model's or running adapters' requests."""
        for i, seq in enumerate(self.waiting):
            if self._lora_fits(seq):
                del self.waiting[i]
                self.waiting.appendleft(seq)
                return True
        return False

    def _admit_for_kv(self, seq: Sequence) -> bool:
        """Give seq blocks for its whole prompt and start pulling its KV; no token budget is used.
        Blocks of a locally cached prefix are shared, not pulled."""
        prefix = self.block_manager.match_prefix(seq)
        num_cached = len(prefix) * self.block_manager.block_size
        if not self.block_manager.can_allocate(seq, seq.num_prompt_tokens - num_cached, keep_watermark=True,
                                               prefix=prefix):
            return False
        self.waiting.popleft()
        self.block_manager.start_with_prefix(seq, prefix)
        self.block_manager.allocate(seq, seq.num_prompt_tokens - num_cached)
        seq.status = SequenceStatus.WAITING_FOR_KV
        self.waiting_for_kv.append(seq)
        seq.kv_transfer.first_block = len(prefix)
        self.connector.start_pull(seq, first_block=len(prefix))
        return True

    def _poll_kv_transfers(self, out: SchedulerOutput) -> None:
        for seq in list(self.waiting_for_kv):
            pull = self.connector.poll(seq)
            if pull is None:
                continue
            self.waiting_for_kv.remove(seq)
            kv = seq.kv_transfer
            if pull.error is None:
                first, num_blocks = pull.request.first_block, len(kv.remote_prefill.block_ids)
                out.kv_loads.append(KVLoad(seq, seq.block_table[first:num_blocks], pull.result.layers, first))
                kv.loaded = True
                # The prompt's KV is all here, but a step must sample from something: the last prompt
                # token is computed again (as with a full prefix cache hit).
                seq.num_computed_tokens = seq.num_prompt_tokens - 1
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
                continue
            kv.failure = pull.error
            self.block_manager.free(seq)
            seq.num_computed_tokens = 0
            if self.config.kv_failure_policy == "fail":
                logger.warning("request %s: pulling its KV failed (%s); failing it (--kv-failure-policy fail)",
                               seq.request_id, pull.error)
                seq.status = SequenceStatus.FINISHED  # the engine finishes it with the error
                out.kv_failed.append((seq, f"pulling the prompt's KV from the prefill engine failed: {pull.error}"))
            else:
                logger.warning("request %s: pulling its KV failed (%s); computing its prompt here instead "
                               "(--kv-failure-policy recompute)", seq.request_id, pull.error)
                seq.status = SequenceStatus.WAITING
                self.waiting.appendleft(seq)

    def _admit_static_batch(self) -> None:
        """Static batching baseline: a whole batch enters together, nothing joins until it ends."""
        while self.waiting and len(self.running) < self._max_num_seqs:
            seq = self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)

    def _chunk_size(self, seq: Sequence, budget: int, others_waiting: bool, computed: int | None = None) -> int:
        """Tokens seq computes this step; `computed` overrides its progress (a cached prefix)."""
        computed = seq.num_computed_tokens if computed is None else computed
        remaining = seq.num_tokens - computed
        if not self.config.chunked_prefill:
            return remaining if remaining <= budget else 0
        cap = self.config.long_prefill_token_threshold
        if cap and others_waiting and computed < seq.num_prompt_tokens:
            budget = min(budget, cap)
        return min(remaining, budget)

    def _schedule(self, seq: Sequence, num_new: int, out: SchedulerOutput, num_spec: int = 0) -> None:
        if not num_spec and seq.spec_token_ids:
            self._drop_proposals(seq)
        self.block_manager.allocate(seq, num_new)
        start = seq.num_computed_tokens
        out.chunks.append(ScheduledChunk(seq, start, num_new, start + num_new == seq.num_tokens + num_spec, num_spec))

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.num_preemptions += 1
        seq.num_preemptions += 1
        self._drop_proposals(seq)
        out.preempted.append(seq)
        pending_load = any(load.seq is seq for load in out.kv_loads)
        if pending_load:  # its pulled KV never reached its blocks: drop the load, recompute the prompt
            out.kv_loads = [load for load in out.kv_loads if load.seq is not seq]
        if (
            not pending_load
            and self.config.preemption_mode == "swap"
            and seq.block_table
            and self.block_manager.can_swap_out(seq)
        ):
            out.swap_out.extend(self.block_manager.swap_out(seq))
            seq.status = SequenceStatus.SWAPPED
            self.swapped.append(seq)
            return
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    # -- after the model ran -----------------------------------------------------------------
    def update(self, out: SchedulerOutput, sampled: list[int | list[int] | None]) -> list[Sequence]:
        """Advance sequences by what the step computed; returns the ones that got a new token.
        A verified chunk's entry is a list: its accepted proposals, then the token sampled after them."""
        progressed = []
        for chunk, token in zip(out.chunks, sampled, strict=True):
            seq = chunk.seq
            if seq.is_finished:  # aborted while the step ran
                continue
            if chunk.num_spec or isinstance(token, list):
                tokens = token if isinstance(token, list) else [] if token is None else [token]
                if self._update_verified(chunk, tokens):
                    progressed.append(seq)
                continue
            seq.num_computed_tokens += chunk.num_tokens
            self.block_manager.cache_computed_blocks(seq)
            if token is None:
                continue
            seq.output_token_ids.append(token)
            progressed.append(seq)
            reason = token_stop_reason(seq, token, self.config.max_model_len)
            if reason:
                self.finish(seq, reason)
        return progressed

    def _update_verified(self, chunk: ScheduledChunk, tokens: list[int]) -> bool:
        """A speculative chunk: keep the KV of the accepted positions, roll back the rest, append."""
        seq = chunk.seq
        accepted = max(0, min(len(tokens) - 1, chunk.num_spec))
        seq.num_computed_tokens += chunk.num_tokens - chunk.num_spec + accepted
        self._drop_proposals(seq)
        self.block_manager.truncate(seq)
        if self.spec_stats is not None and chunk.num_spec:
            self.spec_stats.record(chunk.num_spec, accepted)
            self.spec_policy.observe(seq, chunk.num_spec, accepted)
        for token in tokens:
            seq.output_token_ids.append(token)
            reason = token_stop_reason(seq, token, self.config.max_model_len)
            if reason:
                self.finish(seq, reason)
                return True
        self.block_manager.cache_computed_blocks(seq)
        return bool(tokens)
