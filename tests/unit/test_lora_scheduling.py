"""Scheduling with LoRA adapters (--max-loras): never more adapters running than slots, and a
request waiting for a slot blocks neither the base model's requests nor a running adapter's."""

from __future__ import annotations

from iterserve.engine.sampling_params import SamplingParams
from tests.unit.engine_helpers import fake_engine


class AnyAdapter:
    """Stands in for engine/lora's manager: every adapter name is served."""

    def is_registered(self, name: str) -> bool:
        return True


def test_a_request_waiting_for_an_adapter_slot_lets_others_pass_and_slots_are_never_exceeded():
    engine = fake_engine(max_loras=1, max_num_seqs=8)
    engine.lora = AnyAdapter()
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    order = [("a1", "a"), ("b1", "b"), ("base1", None), ("a2", "a"), ("base2", None)]
    for request_id, lora in order:
        engine.add_request(None, params, [1, 2, 3, 4], request_id=request_id, lora_name=lora)
    first_scheduled: dict[str, int] = {}
    finished: set[str] = set()
    for step in range(200):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                finished.add(out.request_id)
        running = engine.scheduler.running
        assert len({s.lora_name for s in running if s.lora_name is not None}) <= 1
        for seq in running:
            first_scheduled.setdefault(seq.request_id, step)
    assert finished == {request_id for request_id, _ in order}
    # b waits until a's requests are done; the base and a's second request went ahead of it
    assert first_scheduled["base1"] == first_scheduled["a2"] == first_scheduled["base2"] == first_scheduled["a1"]
    assert first_scheduled["b1"] > first_scheduled["a2"]
