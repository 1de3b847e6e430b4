"""Pipeline micro-batches: a step's flat batch is split into micro-batches that flow through the
stages one after another, so stage s computes micro-batch i while stage s + 1 computes i - 1
(GPipe's schedule within one step; --pipeline-micro-batches, default the number of stages).

Only a step with enough work is cut (MicroBatchPolicy): each micro-batch pays its own sends and
its own pass through every layer's fixed costs, which a step of a few decode rows does not earn
back, so a step of fewer than --pipeline-micro-batch-min-tokens query tokens runs as one
micro-batch. The rule counts tokens, not prefill: a prompt's last few tokens are no more work than
as many decode rows, and a large decode batch gains like a prompt chunk of its size.

The split is by rows (tokens), in the batch's order, into runs of near-equal size. A chunk that
crosses a boundary is cut in two: its second part attends to the first part's KV, which the same
stage wrote one micro-batch earlier (a stage runs the micro-batches in order), exactly as chunked
prefill continues a prompt in the next step. Every rank derives the same split from the step plan,
(the policy reads the plan's query lengths and the config every rank loads with), so the
point-to-point transfers (hidden and residual per micro-batch, tagged with its index) meet.
Sends are asynchronous: a stage starts its next micro-batch while the previous one's output travels.
The last stage joins the micro-batches' hidden states, so the logits calls are those of one batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from iterserve.engine.attention.backend import AttentionMetadata
from iterserve.engine.model import parallel


@dataclass(frozen=True)
class MicroBatch:
    start: int  # rows [start, end) of the flat batch
    end: int
    chunks: list[int]  # the step's chunks (indices) it holds a part of
    query_lens: list[int]
    seq_lens: list[int]


@dataclass(frozen=True)
class MicroBatchPolicy:
    """How many micro-batches a step is cut into: `count` when the step carries at least
    `min_tokens` query tokens, else one (0: every step is cut). A function of the step plan alone."""

    count: int
    min_tokens: int

    @classmethod
    def from_config(cls, config) -> MicroBatchPolicy:
        """--pipeline-micro-batches (default: one per stage) and --pipeline-micro-batch-min-tokens."""
        return cls(config.pipeline_micro_batches or config.pipeline_parallel_size,
                   config.pipeline_micro_batch_min_tokens)

    def count_for(self, query_lens: list[int]) -> int:
        return self.count if sum(query_lens) >= self.min_tokens else 1


def micro_batches(query_lens: list[int], seq_lens: list[int], count: int) -> list[MicroBatch]:
    """The flat batch (chunk i: query_lens[i] rows ending at sequence length seq_lens[i]) as at most
    `count` contiguous runs of rows of near-equal size; a chunk across a boundary is cut."""
    total = sum(query_lens)
    count = max(1, min(count, total))
    bounds = [round(i * total / count) for i in range(count + 1)]
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    batches = []
    for start, end in zip(bounds, bounds[1:], strict=False):
        chunks, queries, seqs = [], [], []
        for i, (c0, c1) in enumerate(zip(starts, starts[1:], strict=False)):
            lo, hi = max(start, c0), min(end, c1)
            if lo < hi:
                chunks.append(i)
                queries.append(hi - lo)
                seqs.append(seq_lens[i] - (c1 - hi))
        batches.append(MicroBatch(start, end, chunks, queries, seqs))
    return batches


def pipeline_forward(runner, model, input_ids: torch.Tensor, positions: torch.Tensor, query_lens: list[int],
                     seq_lens: list[int], block_tables: list[list[int]],
                     policy: MicroBatchPolicy) -> torch.Tensor | None:
    """This rank's stage over the step's micro-batches: receives each from the previous stage's rank
    of the same tensor-parallel share, computes, sends it on. Returns the final hidden states of the
    whole batch on the last stage, None on the others (once every send is delivered)."""
    group, tp = runner.group, runner.tp
    stage, last = runner.stage, runner.stage == runner.stages - 1
    shape_width = runner.hidden_size
    sends, outputs = [], []
    for index, batch in enumerate(micro_batches(query_lens, seq_lens, policy.count_for(query_lens))):
        meta = AttentionMetadata.build(batch.query_lens, batch.seq_lens, [block_tables[i] for i in batch.chunks],
                                       runner.block_size, runner.device)
        carry = None
        if stage > 0:
            shape, source = (batch.end - batch.start, shape_width), group.rank - tp
            carry = (group.recv(shape, runner.dtype, source, tag=2 * index),
                     group.recv(shape, runner.dtype, source, tag=2 * index + 1))
        out = parallel.stage_forward(model, input_ids[batch.start : batch.end], positions[batch.start : batch.end],
                                     runner.kv_caches, meta, carry, last)
        if last:
            outputs.append(out)
        else:
            sends += [group.isend(tensor, group.rank + tp, tag=2 * index + part) for part, tensor in enumerate(out)]
    for send in sends:
        send.wait()
    if not last:
        return None
    return torch.cat(outputs) if len(outputs) > 1 else outputs[0]
