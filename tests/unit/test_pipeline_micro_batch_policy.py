"""engine/distributed/pipeline.py's MicroBatchPolicy: which pipeline steps are cut into micro-batches
(those of at least --pipeline-micro-batch-min-tokens query tokens) and which run whole, derived from
the step plan and the config alone, so that every rank cuts a step the same way."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from iterserve.engine.config import ConfigError, EngineConfig
from iterserve.engine.distributed.multinode import config_from_json, config_json
from iterserve.engine.distributed.pipeline import MicroBatchPolicy, micro_batches
from iterserve.engine.distributed.tensor_parallel import StepPlan

# (query_lens, seq_lens) of steps a scheduler makes, and the micro-batches each gets at two per step
# from 64 tokens up.
STEPS = [
    ("one decode", [1], [40], 1),
    ("sixteen decodes", [1] * 16, list(range(20, 36)), 1),
    ("sixty-three decodes, one short", [1] * 63, [30] * 63, 1),
    ("sixty-four decodes", [1] * 64, [30] * 64, 2),
    ("a prompt's last three tokens beside four decodes", [3, 1, 1, 1, 1], [67, 9, 9, 9, 9], 1),
    ("a 256-token prompt chunk", [256], [256], 2),
    ("a 48-token chunk mid-prompt and sixteen decodes", [48] + [1] * 16, [96] + [12] * 16, 2),
    ("sixteen speculative verifies of 1 + 3 tokens", [4] * 16, [50] * 16, 2),
]


@pytest.mark.parametrize("name,query_lens,seq_lens,expected", STEPS, ids=[s[0] for s in STEPS])
def test_a_step_is_cut_only_when_it_carries_the_minimum_of_query_tokens(name, query_lens, seq_lens, expected):
    policy = MicroBatchPolicy(count=2, min_tokens=64)
    batches = micro_batches(query_lens, seq_lens, policy.count_for(query_lens))
    assert len(batches) == expected
    assert batches[0].start == 0 and batches[-1].end == sum(query_lens)


def test_zero_cuts_every_step_as_before_the_policy():
    policy = MicroBatchPolicy(count=3, min_tokens=0)
    assert [policy.count_for(q) for q, _ in [([1], [9]), ([1] * 4, [9] * 4), ([256], [256])]] == [3, 3, 3]
    # a one-row step is still one micro-batch: there is nothing to overlap
    assert len(micro_batches([1], [9], policy.count_for([1]))) == 1


def test_the_count_defaults_to_the_stages_and_the_threshold_to_the_flag():
    config = EngineConfig(pipeline_parallel_size=3)
    assert MicroBatchPolicy.from_config(config) == MicroBatchPolicy(3, config.pipeline_micro_batch_min_tokens)
    config = EngineConfig(pipeline_parallel_size=2, pipeline_micro_batches=4, pipeline_micro_batch_min_tokens=8)
    assert MicroBatchPolicy.from_config(config) == MicroBatchPolicy(4, 8)


def test_every_rank_cuts_each_step_as_rank_zero_does():
    """Rank 0 holds the config and the plan as objects; a worker node reads both as JSON from the
    rendezvous store (engine/distributed/multinode.py). Their cuts must meet, or the tagged
    point-to-point transfers of the micro-batches do not."""
    config = EngineConfig(pipeline_parallel_size=2, pipeline_micro_batch_min_tokens=20)
    leader = MicroBatchPolicy.from_config(config)
    worker = MicroBatchPolicy.from_config(config_from_json(config_json(config).encode()))
    assert worker == leader
    cut = set()
    for _, query_lens, seq_lens, _ in STEPS:
        plan = StepPlan([], [], [7] * sum(query_lens), list(range(sum(query_lens))), query_lens, seq_lens,
                        [[0]] * len(query_lens), [])
        read = StepPlan(**json.loads(json.dumps(asdict(plan))))
        ours = micro_batches(plan.query_lens, plan.seq_lens, leader.count_for(plan.query_lens))
        theirs = micro_batches(read.query_lens, read.seq_lens, worker.count_for(read.query_lens))
        assert theirs == ours
        cut.add(len(ours))
    assert cut == {1, 2}  # the steps above include both kinds at this threshold


@pytest.mark.parametrize("value", [-1, 2.5, "64"])
def test_a_negative_or_non_integer_threshold_is_refused_naming_the_flag(value):
    with pytest.raises(ConfigError, match="--pipeline-micro-batch-min-tokens must be a non-negative integer"):
        EngineConfig(pipeline_parallel_size=2, pipeline_micro_batch_min_tokens=value).validate_nodes()
