"""engine/distributed/pipeline.py's split of a step into micro-batches: contiguous runs of rows of
near-equal size, a chunk across a boundary cut so that its second part continues where the first
ended (the same stage wrote the first part's KV one micro-batch earlier)."""

from __future__ import annotations

from iterserve.engine.distributed.pipeline import micro_batches


def test_a_prompt_chunk_is_cut_and_its_second_part_continues_the_first():
    # one 16-token chunk from position 32 (seq len 48) and two decodes
    batches = micro_batches([16, 1, 1], [48, 20, 7], 2)
    assert [(b.start, b.end) for b in batches] == [(0, 9), (9, 18)]
    assert (batches[0].chunks, batches[0].query_lens, batches[0].seq_lens) == ([0], [9], [41])
    assert (batches[1].chunks, batches[1].query_lens, batches[1].seq_lens) == ([0, 1, 2], [7, 1, 1], [48, 20, 7])


def test_every_row_is_in_exactly_one_micro_batch_and_counts_are_bounded():
    query_lens, seq_lens = [5, 1, 1, 30, 2], [5, 9, 100, 60, 12]
    for count in (1, 2, 3, 4, 7, 39, 100):
        batches = micro_batches(query_lens, seq_lens, count)
        assert len(batches) == min(count, sum(query_lens))
        assert batches[0].start == 0 and batches[-1].end == sum(query_lens)
        assert all(a.end == b.start for a, b in zip(batches, batches[1:], strict=False))
        assert all(sum(b.query_lens) == b.end - b.start for b in batches)
        for chunk, (q, s) in enumerate(zip(query_lens, seq_lens, strict=True)):
            parts = [(b.query_lens[b.chunks.index(chunk)], b.seq_lens[b.chunks.index(chunk)])
                     for b in batches if chunk in b.chunks]
            assert sum(p for p, _ in parts) == q
            assert parts[-1][1] == s  # the last part ends where the chunk ends
            ends = [end for _, end in parts]
            assert ends == sorted(ends) and all(end - p >= s - q for p, end in parts)


def test_one_decode_is_one_micro_batch():
    assert [(b.chunks, b.query_lens, b.seq_lens) for b in micro_batches([1], [10], 4)] == [([0], [1], [10])]


def test_a_later_stage_keeps_its_own_layers_renumbered():
    """Stage 1 of 30 layers in 2 holds 15..29 as 0..14; renaming 17 to 2 must not lose (or take) layer 2."""
    from iterserve.engine.model.parallel import stage_layers, stage_weights

    weights = {f"model.layers.{i}.w": i for i in range(30)} | {"model.norm.weight": -1}
    stage_weights(weights, stage_layers(30, 1, 2))
    assert weights == {f"model.layers.{i}.w": 15 + i for i in range(15)} | {"model.norm.weight": -1}
