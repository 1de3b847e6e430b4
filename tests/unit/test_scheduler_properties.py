"""Property tests: random arrivals, lengths, shared prefixes, aborts and cap changes against the real
scheduler, with and without prefix caching. A shadow of the KV pool records which token history
each slot was computed from, so a step that reads a slot holding someone else's KV fails."""

from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from iterserve.engine.sampling_params import SamplingParams
from iterserve.engine.sequence import SequenceStatus
from tests.unit.engine_helpers import fake_engine

request = st.tuples(
    st.integers(min_value=0, max_value=30),  # arrival step
    st.integers(min_value=1, max_value=90),  # prompt length
    st.integers(min_value=1, max_value=40),  # max tokens
    st.one_of(st.none(), st.integers(min_value=0, max_value=60)),  # abort at step
    st.sampled_from([0, 0, 15, 16, 17, 32, 33, 48, 90]),  # leading tokens shared by all requests
)
SHARED_PREFIX = [98 + (j * 5) % 23 for j in range(128)]


class KvShadow:
    """Wraps the fake executor: replays the step's swaps on a model of the pools, checks that every
    position a chunk attends to holds KV computed from exactly this sequence's tokens up to there,
    and that no chunk writes into a block another sequence holds."""

    def __init__(self, executor, block_manager):
        self.executor = executor
        self.bm = block_manager
        self.gpu: dict[tuple[int, int], tuple[int, ...]] = {}
        self.cpu: dict[tuple[int, int], tuple[int, ...]] = {}

    def __getattr__(self, name):
        return getattr(self.executor, name)

    def execute(self, out):
        size = self.bm.block_size
        for source, target, pairs in ((self.gpu, self.cpu, out.swap_out), (self.cpu, self.gpu, out.swap_in)):
            copies = {(dst, off): source.get((src, off)) for src, dst in pairs for off in range(size)}
            target.update(copies)
        for chunk in out.chunks:
            seq, history = chunk.seq, tuple(chunk.seq.token_slice(0, chunk.start + chunk.num_tokens))
            for pos in range(chunk.start):
                slot = (seq.block_table[pos // size], pos % size)
                assert self.gpu.get(slot) == history[: pos + 1], f"{seq.request_id} reads stale KV at {pos}"
        for chunk in out.chunks:
            seq, history = chunk.seq, tuple(chunk.seq.token_slice(0, chunk.start + chunk.num_tokens))
            for pos in range(chunk.start, chunk.start + chunk.num_tokens):
                block = seq.block_table[pos // size]
                assert self.bm.gpu.refcount(block) == 1, f"{seq.request_id} writes into shared block {block}"
                self.gpu[(block, pos % size)] = history[: pos + 1]
        return self.executor.execute(out)


def check_block_invariants(engine) -> None:
    bm = engine.block_manager
    sched = engine.scheduler
    seqs = list(sched.waiting) + list(sched.running) + list(sched.swapped)
    gpu = [b for s in seqs for b in s.block_table]
    cpu = [b for s in seqs for b in s.cpu_block_table]
    holders = Counter(gpu)
    if bm.prefix_cache is None:
        assert len(gpu) == len(set(gpu)), "a GPU block is owned twice"
    assert len(cpu) == len(set(cpu)), "a CPU block is owned twice"
    assert len(holders) == bm.gpu.num_used, "a GPU block leaked"
    assert len(cpu) == bm.cpu.num_used, "a CPU block leaked"
    assert all(0 <= b < bm.num_blocks for b in gpu)
    # Every block is exactly one of: held (its count = its holders), cached and unheld, or free.
    free = bm.gpu.free_blocks()
    cached = bm.prefix_cache.evictable_blocks() if bm.prefix_cache else []
    assert all(bm.gpu.refcount(b) == holders[b] for b in range(bm.num_blocks)), "a reference count is off"
    assert sorted([*holders, *free, *cached]) == list(range(bm.num_blocks)), "a block is lost or in two states"
    assert bm.num_free_blocks == len(free) + len(cached)
    for s in seqs:  # a named block holds exactly the tokens its name says
        for i, block in enumerate(s.block_table):
            named = bm.prefix_cache.hash_of(block) if bm.prefix_cache else None
            if named is not None:
                assert i < len(s.block_hashes) and named == s.block_hashes[i], "a block's name lies"
    for s in sched.waiting:
        assert s.status is SequenceStatus.WAITING and not s.block_table and s.num_computed_tokens == 0
    for s in sched.swapped:
        assert s.status is SequenceStatus.SWAPPED and not s.block_table and s.cpu_block_table
    for s in sched.running:
        assert len(s.block_table) >= bm.blocks_for(s.num_computed_tokens)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    requests=st.lists(request, min_size=1, max_size=25),
    num_blocks=st.integers(min_value=8, max_value=40),
    max_num_seqs=st.integers(min_value=1, max_value=12),
    budget=st.integers(min_value=16, max_value=96),
    chunked=st.booleans(),
    mode=st.sampled_from(["recompute", "swap"]),
    scheduling=st.sampled_from(["continuous", "static"]),
    cap_change=st.one_of(st.none(), st.tuples(st.integers(0, 40), st.integers(1, 12))),
    prefill_cap=st.sampled_from([None, 0, 1, 7]),
    caching=st.booleans(),
)
def test_random_workloads_keep_every_invariant(requests, num_blocks, max_num_seqs, budget, chunked, mode,
                                               scheduling, cap_change, prefill_cap, caching):
    max_model_len = min(num_blocks * 16, 128)
    if not chunked:
        budget = max(budget, max_model_len)
    budget = max(budget, max_num_seqs)
    engine = fake_engine(num_blocks=num_blocks, num_cpu_blocks=num_blocks, max_num_seqs=max_num_seqs,
                         max_num_batched_tokens=budget, chunked_prefill=chunked, preemption_mode=mode,
                         scheduling=scheduling, max_model_len=max_model_len,
                         long_prefill_token_threshold=prefill_cap,
                         enable_prefix_caching=caching and scheduling == "continuous")
    engine.executor = KvShadow(engine.executor, engine.block_manager)
    pending = sorted(enumerate(requests), key=lambda item: item[1][0])
    aborts = {}
    admitted, finished = set(), {}
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][1][0] <= step:
            i, (_, prompt_len, max_tokens, abort_at, shared) = pending.pop(0)
            prompt = SHARED_PREFIX[:shared] + [97 + (i + j) % 26 for j in range(prompt_len)]
            prompt = prompt[: max_model_len - 1]
            engine.add_request(prompt_token_ids=prompt, request_id=f"r{i}",
                               params=SamplingParams(max_tokens=max_tokens, ignore_eos=True))
            admitted.add(f"r{i}")
            if abort_at is not None:
                aborts.setdefault(step + abort_at, []).append(f"r{i}")
        for request_id in aborts.pop(step, []):
            engine.abort_request(request_id)
        if cap_change is not None and cap_change[0] == step:
            engine.set_max_num_seqs(min(cap_change[1], budget))
        cap = engine.scheduler.max_num_seqs
        running_before = len(engine.scheduler.running)

        engine._drain_inbox([])
        out = engine.scheduler.schedule()
        assert out.num_batched_tokens <= budget
        assert len(engine.scheduler.running) <= max(cap, running_before)
        assert len({id(c.seq) for c in out.chunks}) == len(out.chunks)
        check_block_invariants(engine)
        sampled = engine.executor.execute(out)
        for seq in engine.scheduler.update(out, sampled):
            if seq.is_finished:
                finished[seq.request_id] = seq.finish_reason
        for seq in list(engine._sequences.values()):
            if seq.is_finished and seq.finish_reason == "abort":
                finished[seq.request_id] = "abort"
        check_block_invariants(engine)
        assert all(engine.block_manager.gpu.refcount(b) >= 0 for b in range(num_blocks)), "a negative count"
        step += 1
        assert step < 5000, "no progress"

    assert set(finished) == admitted
    assert engine.block_manager.usage() == 0.0
    assert engine.block_manager.cpu.num_used == 0
    assert engine.block_manager.num_free_blocks == num_blocks  # cached blocks are free too
