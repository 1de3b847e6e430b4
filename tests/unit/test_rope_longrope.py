"""LongRoPE tables against transformers' Phi-3 rotary embedding, and which table each token of a
flat batch reads."""

import pytest
import torch

from iterserve.engine.attention.backend import AttentionMetadata
from iterserve.engine.model.rope_longrope import LongRope, LongRopeConfigError

HEAD_DIM, ORIGINAL, MAX_POSITIONS = 16, 32, 128


def phi3_config(rope_type: str = "longrope", **rope):
    from transformers import Phi3Config

    gen = torch.Generator().manual_seed(0)
    scaling = {"type": rope_type, "short_factor": (1 + torch.rand(HEAD_DIM // 2, generator=gen)).tolist(),
               "long_factor": (1 + 4 * torch.rand(HEAD_DIM // 2, generator=gen)).tolist(), **rope}
    return Phi3Config(hidden_size=4 * HEAD_DIM, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=MAX_POSITIONS, original_max_position_embeddings=ORIGINAL,
                      rope_theta=10000.0, rope_scaling=scaling), scaling


def hf_cos_sin(config, last_position: int) -> tuple[torch.Tensor, torch.Tensor]:
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    rotary = Phi3RotaryEmbedding(config)
    positions = torch.arange(last_position + 1)[None]
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions)
    return cos[0], sin[0]


@pytest.mark.parametrize("rope_type,extra", [("longrope", {}), ("longrope", {"attention_factor": 1.3})])
def test_short_and_long_tables_equal_transformers(rope_type, extra):
    config, scaling = phi3_config(rope_type, **extra)
    ours = LongRope.from_hf(scaling, MAX_POSITIONS, HEAD_DIM, ORIGINAL)
    table = ours.cos_sin(HEAD_DIM, 10000.0, MAX_POSITIONS)
    half = HEAD_DIM // 2
    for last, rows in ((ORIGINAL - 1, table[:ORIGINAL]),  # within the original length: short
                       (MAX_POSITIONS - 1, table[MAX_POSITIONS:])):  # past it: long, every position
        cos, sin = hf_cos_sin(config, last)
        assert torch.equal(rows[: last + 1, :half], cos[:, :half])
        assert torch.equal(rows[: last + 1, half:], sin[:, :half])


def test_each_sequence_reads_the_long_table_only_once_past_the_original_length():
    _, scaling = phi3_config()
    rope = LongRope.from_hf(scaling, MAX_POSITIONS, HEAD_DIM, ORIGINAL)
    # a prefill chunk ending at the original length, a decode just past it, a chunk crossing it
    meta = AttentionMetadata.build([4, 1, 3], [ORIGINAL, ORIGINAL + 1, ORIGINAL + 2], [[0, 1], [2, 3, 4], [5, 6, 7]],
                                   block_size=16)
    positions = torch.tensor([28, 29, 30, 31, 32, 31, 32, 33])
    got = rope.table_positions(positions, meta, MAX_POSITIONS)
    assert got.tolist() == [28, 29, 30, 31, 32 + MAX_POSITIONS, 31 + MAX_POSITIONS, 32 + MAX_POSITIONS,
                            33 + MAX_POSITIONS]


def test_factor_lists_of_the_wrong_length_are_refused_naming_the_field():
    _, scaling = phi3_config()
    with pytest.raises(LongRopeConfigError, match="short_factor must list 4 numbers"):
        LongRope.from_hf(scaling, MAX_POSITIONS, HEAD_DIM // 2, ORIGINAL)
    with pytest.raises(LongRopeConfigError, match="original_max_position_embeddings"):
        LongRope.from_hf({k: v for k, v in scaling.items() if k != "original_max_position_embeddings"},
                         MAX_POSITIONS, HEAD_DIM, None)
