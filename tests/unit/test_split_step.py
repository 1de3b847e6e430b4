"""Split execution's decisions (engine/model/split_step.py): the balanced partition, the cost model
and the row order that puts the groups' logits back in chunk order. The real model runs split in
tests/integration/test_split_step_real_model.py."""

from __future__ import annotations

import pytest
import torch

from iterserve.engine.model import cpu_w8a8
from iterserve.engine.model.split_step import (
    MAX_GROUP_SHARE,
    StepSplit,
    chunk_cost,
    original_order,
    plan_split,
)


def test_plan_split_balances_and_keeps_each_group_in_chunk_order():
    costs = [1.0] * 64
    first, second = plan_split(costs)
    assert sorted(first + second) == list(range(64)) and len(first) == len(second) == 32
    assert first == sorted(first) and second == sorted(second)
    # a big prefill with many decodes: the prefill alone on one side, the decodes fill the other
    costs = [40.0] + [1.0] * 40
    first, second = plan_split(costs)
    assert first == [0] and second == list(range(1, 41))
    # the heavier group comes first
    first, second = plan_split([5.0, 3.0, 3.0])
    assert sum([5.0, 3.0, 3.0][i] for i in first) == 6.0 and first == [1, 2] and second == [0]


@pytest.mark.parametrize("costs", [[10.0], [], [100.0, 1.0, 1.0], [8.0, 1.0, 1.0]])
def test_plan_split_refuses_one_chunk_or_a_dominant_one(costs):
    assert plan_split(costs) is None


def test_plan_split_share_limit_is_the_boundary():
    costs = [MAX_GROUP_SHARE * 10, (1 - MAX_GROUP_SHARE) * 10]  # heavier group exactly at the limit
    assert plan_split(costs) == ([0], [1])
    assert plan_split([costs[0] + 0.01, costs[1]]) is None


def test_step_split_threshold_on_tokens():
    split = StepSplit(min_tokens=48)
    assert split.plan([1.0] * 47, 47) is None
    assert split.plan([1.0] * 48, 48) is not None


def test_chunk_cost_counts_tokens_attention_and_lm_head():
    decode_short, decode_long = chunk_cost(10, 1, True), chunk_cost(1000, 1, True)
    assert decode_long > decode_short > 1.0
    assert chunk_cost(10, 1, False) < decode_short
    prefill = chunk_cost(0, 400, True)
    assert 400 < prefill < 500 and chunk_cost(400, 400, True) > prefill  # a later chunk attends more


def test_original_order_undoes_the_grouping():
    # chunks 0..6; 2 and 5 do not sample (prefill chunks short of the prompt's end)
    sampled = [True, True, False, True, True, False, True]
    groups = ([0, 2, 3, 5], [1, 4, 6])
    # concatenated rows: group 0's sampled chunks 0, 3, then group 1's 1, 4, 6
    assert original_order(groups, sampled) == [0, 2, 1, 3, 4]
    rows = torch.tensor([[0.0], [3.0], [1.0], [4.0], [6.0]])  # each row tagged with its chunk
    back = rows.index_select(0, torch.tensor(original_order(groups, sampled))).flatten().tolist()
    assert back == [0.0, 1.0, 3.0, 4.0, 6.0]


def test_step_split_runs_both_at_once_on_one_torch_thread_each():
    import threading

    split = StepSplit()
    barrier = threading.Barrier(2, timeout=10)  # both must be running at the same time to pass it

    def work(tag):
        barrier.wait()
        return (tag, torch.get_num_threads(), torch.is_inference_mode_enabled(), threading.current_thread().name,
                cpu_w8a8.kernel_threads())

    cpu_w8a8.set_threads(2)  # as a server does: its kernels on every CPU outside a split
    try:
        results = split.run([lambda: work("a"), lambda: work("b")])
    finally:
        split.close()
        cpu_w8a8.set_threads(None)
    assert [r[0] for r in results] == ["a", "b"]
    assert all(r[1] == 1 and r[2] for r in results)
    assert all(r[4] == 1 for r in results)  # the w8a8 kernel too: each half has one core
    assert results[0][3] != results[1][3] and all(r[3].startswith("iterserve-split") for r in results)
