"""Property tests: random arrivals, lengths, aborts and cap changes against the real scheduler."""

from __future__ import annotations

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
)


def check_block_invariants(engine) -> None:
    bm = engine.block_manager
    sched = engine.scheduler
    seqs = list(sched.waiting) + list(sched.running) + list(sched.swapped)
    gpu = [b for s in seqs for b in s.block_table]
    cpu = [b for s in seqs for b in s.cpu_block_table]
    assert len(gpu) == len(set(gpu)), "a GPU block is owned twice"
    assert len(cpu) == len(set(cpu)), "a CPU block is owned twice"
    assert len(gpu) == bm.gpu.num_used, "a GPU block leaked"
    assert len(cpu) == bm.cpu.num_used, "a CPU block leaked"
    assert all(0 <= b < bm.num_blocks for b in gpu)
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
)
def test_random_workloads_keep_every_invariant(requests, num_blocks, max_num_seqs, budget, chunked, mode,
                                               scheduling, cap_change, prefill_cap):
    max_model_len = min(num_blocks * 16, 128)
    if not chunked:
        budget = max(budget, max_model_len)
    budget = max(budget, max_num_seqs)
    engine = fake_engine(num_blocks=num_blocks, num_cpu_blocks=num_blocks, max_num_seqs=max_num_seqs,
                         max_num_batched_tokens=budget, chunked_prefill=chunked, preemption_mode=mode,
                         scheduling=scheduling, max_model_len=max_model_len,
                         long_prefill_token_threshold=prefill_cap)
    pending = sorted(enumerate(requests), key=lambda item: item[1][0])
    aborts = {}
    admitted, finished = set(), {}
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][1][0] <= step:
            i, (_, prompt_len, max_tokens, abort_at) = pending.pop(0)
            prompt = [97 + (i + j) % 26 for j in range(min(prompt_len, max_model_len - 1))]
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
        step += 1
        assert step < 5000, "no progress"

    assert set(finished) == admitted
    assert engine.block_manager.usage() == 0.0
    assert engine.block_manager.cpu.num_used == 0
