"""Scheduler behaviour with the fake executor: budgets, caps, chunking, preemption, static mode."""

from __future__ import annotations

import pytest

from iterserve.engine.sampling_params import SamplingParams
from tests.unit.engine_helpers import fake_engine, run_to_completion

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


def prompts(n: int, length: int = 30) -> list[list[int]]:
    return [[97 + (i + j) % 26 for j in range(length + i)] for i in range(n)]


def test_token_budget_and_sequence_cap_hold_every_step():
    engine = fake_engine(max_num_seqs=4, max_num_batched_tokens=24)
    steps = []  # (tokens computed, sequences in the batch) per step, as the executor saw them
    execute = engine.executor.execute

    def recording_execute(out):
        steps.append((out.num_batched_tokens, len(out.chunks)))
        return execute(out)

    engine.executor.execute = recording_execute
    for p in prompts(10):
        engine.add_request(prompt_token_ids=p, params=GREEDY)
    tokens = run_to_completion(engine)
    assert len(tokens) == 10 and all(len(t) == 20 for t in tokens.values())
    assert max(n for n, _ in steps) == 24  # prompts of 30+ tokens fill the budget exactly, never beyond
    assert max(k for _, k in steps) == 4
    # Every prompt and generated token was computed once (no preemption here), within the budget.
    assert sum(n for n, _ in steps) == sum(len(p) + 20 - 1 for p in prompts(10))
    assert engine.block_manager.usage() == 0.0


def test_chunked_prefill_splits_a_long_prompt_and_shares_the_step_with_decodes():
    engine = fake_engine(max_num_seqs=8, max_num_batched_tokens=16)
    engine.add_request(prompt_token_ids=[97] * 5, params=GREEDY, request_id="short")
    engine.step()  # short prompt prefilled
    engine.add_request(prompt_token_ids=[98] * 100, params=GREEDY, request_id="long")
    engine._drain_inbox([])
    out = engine.scheduler.schedule()
    by_id = {chunk.seq.request_id: chunk for chunk in out.chunks}
    assert by_id["short"].num_tokens == 1 and by_id["short"].is_decode
    assert by_id["long"].num_tokens == 15 and not by_id["long"].sample
    assert out.num_batched_tokens == 16


def test_a_long_prompt_shares_the_budget_only_while_others_wait():
    engine = fake_engine(max_num_seqs=8, max_num_batched_tokens=64, long_prefill_token_threshold=16)
    engine.add_request(prompt_token_ids=[98] * 200, params=GREEDY, request_id="long")
    engine._drain_inbox([])
    alone = engine.scheduler.schedule()
    assert [c.num_tokens for c in alone.chunks] == [64]  # nobody waits: the whole budget
    engine.scheduler.update(alone, engine.executor.execute(alone))
    for i in range(3):
        engine.add_request(prompt_token_ids=[97] * 10, params=GREEDY, request_id=f"short{i}")
    engine._drain_inbox([])
    shared = engine.scheduler.schedule()
    assert [(c.seq.request_id, c.num_tokens) for c in shared.chunks] == [
        ("long", 16), ("short0", 10), ("short1", 10), ("short2", 10)]


def test_without_chunked_prefill_a_prompt_waits_for_a_step_with_room():
    engine = fake_engine(max_num_seqs=8, max_num_batched_tokens=256, chunked_prefill=False)
    for p in prompts(3, length=100):
        engine.add_request(prompt_token_ids=p, params=GREEDY)
    engine._drain_inbox([])
    out = engine.scheduler.schedule()
    assert [c.num_tokens for c in out.chunks] == [100, 101]  # the third (102) does not fit this step


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_sequences_produce_the_same_tokens(mode):
    reference = fake_engine(num_blocks=200, max_num_seqs=8, max_num_batched_tokens=64)
    tight = fake_engine(num_blocks=20, num_cpu_blocks=40, max_num_seqs=8, max_num_batched_tokens=64,
                        preemption_mode=mode)
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    for engine in (reference, tight):
        for i, p in enumerate(prompts(6, length=20)):
            engine.add_request(prompt_token_ids=p, params=params, request_id=f"r{i}")
    expected, got = run_to_completion(reference), run_to_completion(tight)
    assert tight.scheduler.num_preemptions > 0
    assert reference.scheduler.num_preemptions == 0
    assert got == expected
    assert tight.block_manager.usage() == 0.0
    assert tight.block_manager.cpu.num_used == 0


def test_swap_mode_actually_swaps():
    engine = fake_engine(num_blocks=20, num_cpu_blocks=40, max_num_seqs=8, max_num_batched_tokens=64,
                         preemption_mode="swap")
    for p in prompts(6, length=20):
        engine.add_request(prompt_token_ids=p, params=SamplingParams(max_tokens=60, ignore_eos=True))
    swapped_out = swapped_in = 0
    while engine.has_unfinished_requests():
        engine._drain_inbox([])
        out = engine.scheduler.schedule()
        swapped_out += len(out.swap_out)
        swapped_in += len(out.swap_in)
        engine.scheduler.update(out, engine.executor.execute(out))
    assert swapped_out > 0 and swapped_in == swapped_out


def test_lowering_max_num_seqs_keeps_running_sequences_and_caps_admission():
    engine = fake_engine(max_num_seqs=8, max_num_batched_tokens=64)
    for p in prompts(12, length=4):
        engine.add_request(prompt_token_ids=p, params=SamplingParams(max_tokens=30, ignore_eos=True))
    engine.step()
    assert len(engine.scheduler.running) == 8
    engine.set_max_num_seqs(3)
    finished_early = []
    seen_running = []
    while engine.has_unfinished_requests():
        outputs = engine.step()
        finished_early += [o for o in outputs if o.finished and o.outputs[0].finish_reason != "length"]
        seen_running.append(len(engine.scheduler.running))
    assert not finished_early  # nothing killed
    first_admission_after = seen_running.index(next(n for n in seen_running if n < 8))
    assert max(seen_running[first_admission_after:]) <= 3


def test_static_mode_admits_nothing_until_the_batch_finishes():
    engine = fake_engine(max_num_seqs=4, max_num_batched_tokens=64, scheduling="static")
    lengths = [2, 10, 3, 4, 5, 6]
    for i, n in enumerate(lengths):
        engine.add_request(prompt_token_ids=[97, 98], request_id=f"r{i}",
                           params=SamplingParams(max_tokens=n, ignore_eos=True))
    admitted_while_busy = False
    batch = set()
    while engine.has_unfinished_requests():
        before = {s.request_id for s in engine.scheduler.running}
        engine.step()
        after = {s.request_id for s in engine.scheduler.running}
        if before and (after - before):
            admitted_while_busy = True
        batch |= after
    assert not admitted_while_busy


def test_abort_frees_blocks_and_reports_abort():
    engine = fake_engine()
    engine.add_request(prompt_token_ids=[97] * 40, params=SamplingParams(max_tokens=100), request_id="x")
    engine.step()
    assert engine.block_manager.usage() > 0
    engine.abort_request("x")
    outputs = engine.step()
    assert [(o.request_id, o.finished, o.outputs[0].finish_reason) for o in outputs] == [("x", True, "abort")]
    assert engine.block_manager.usage() == 0.0
    assert not engine.has_unfinished_requests()


def test_stop_token_and_stop_string_end_a_request():
    engine = fake_engine()
    engine.add_request(prompt_token_ids=[97, 98, 99], request_id="free",
                       params=SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    text = "".join(chr(t) for t in run_to_completion(engine)["free"])
    stop_char = text[5]
    engine.add_request(prompt_token_ids=[97, 98, 99], request_id="tok",
                       params=SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[ord(stop_char)]))
    engine.add_request(prompt_token_ids=[97, 98, 99], request_id="str",
                       params=SamplingParams(temperature=0, max_tokens=40, stop=[text[6:9]]))
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o for o in engine.step() if o.finished})
    assert outputs["tok"].outputs[0].finish_reason == "stop"
    assert chr(outputs["tok"].outputs[0].token_ids[-1]) == stop_char
    assert outputs["str"].outputs[0].finish_reason == "stop"
    assert outputs["str"].outputs[0].text == text[:6]


def test_max_model_len_ends_generation_with_length():
    engine = fake_engine(max_model_len=64, max_num_batched_tokens=64)
    engine.add_request(prompt_token_ids=[97] * 60, request_id="x",
                       params=SamplingParams(max_tokens=100, ignore_eos=True))
    assert len(run_to_completion(engine)["x"]) == 4


def test_step_log_records_each_step(tmp_path):
    import json

    log = tmp_path / "steps.jsonl"
    engine = fake_engine(step_log=str(log))
    engine.add_request(prompt_token_ids=[97] * 20, params=SamplingParams(max_tokens=3, ignore_eos=True))
    run_to_completion(engine)
    engine.close()
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["prefill_tokens"] for r in records] == [20, 0, 0]
    assert [r["decode_tokens"] for r in records] == [0, 1, 1]
    assert {"duration_s", "schedule_s", "model_s", "kv_blocks_used", "preemptions"} <= set(records[0])


def test_a_new_max_num_seqs_is_queued_and_applied_at_the_next_step():
    engine = fake_engine(max_num_seqs=8, max_num_batched_tokens=64)
    for p in prompts(4, length=4):
        engine.add_request(prompt_token_ids=p, params=GREEDY)
    engine.step()
    assert len(engine.scheduler.running) == 4
    assert engine.set_max_num_seqs(2) == 8
    assert engine.set_max_num_seqs(3) == 2  # the latest request wins; nothing applied yet
    assert engine.scheduler._max_num_seqs == 8 and engine.stats().max_num_seqs == 3
    for p in prompts(4, length=4):
        engine.add_request(prompt_token_ids=p, params=GREEDY)
    engine.step()
    assert engine.scheduler._max_num_seqs == 3
    assert len(engine.scheduler.running) == 4  # running sequences are kept, none admitted above the cap
    run_to_completion(engine)
    assert engine.block_manager.usage() == 0.0
