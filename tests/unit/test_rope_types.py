"""rope.py's tables against transformers' own ROPE_INIT_FUNCTIONS for every type it computes, and
the one-line error for a type it does not."""

import pytest
import torch

from iterserve.engine.model.loader import ModelLoadError
from iterserve.engine.model.rope import inv_freq_and_factor, rotary_cos_sin

HEAD_DIM, MAX_POSITIONS = 32, 64
CASES = {
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 2.5},
    "dynamic": {"rope_type": "dynamic", "factor": 4.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    "yarn-mscale": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16, "mscale": 0.7,
                    "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2, "truncate": False},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16},
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_inv_freq_and_attention_factor_equal_transformers(name):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = CASES[name]
    config = LlamaConfig(hidden_size=4 * HEAD_DIM, num_attention_heads=4, max_position_embeddings=32,
                         rope_parameters={"rope_theta": 5000.0, **params})
    kind = params["rope_type"]
    # dynamic: transformers rescales by the forward's length; the engine fixes it for max_model_len
    seq_len = MAX_POSITIONS if kind == "dynamic" else None
    if kind == "default":  # transformers' LlamaRotaryEmbedding.compute_default_rope_parameters
        want = 1.0 / (5000.0 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.int64).float() / HEAD_DIM))
        want_factor = 1.0
    else:
        want, want_factor = ROPE_INIT_FUNCTIONS[kind](config, None, seq_len=seq_len)
    got, factor = inv_freq_and_factor(params, HEAD_DIM, 5000.0, MAX_POSITIONS, 32)
    assert torch.equal(got, want) and factor == pytest.approx(want_factor, rel=1e-12)
    table = rotary_cos_sin(HEAD_DIM, 5000.0, MAX_POSITIONS, params, 32)
    assert table.shape == (MAX_POSITIONS, HEAD_DIM)
    assert torch.allclose(table[:, 0], torch.cos(torch.arange(MAX_POSITIONS) * want[0]) * want_factor, atol=1e-6)


def test_dynamic_keeps_the_plain_base_within_max_position_embeddings():
    plain, _ = inv_freq_and_factor(None, HEAD_DIM, 5000.0, 32, 32)
    dynamic, _ = inv_freq_and_factor(CASES["dynamic"], HEAD_DIM, 5000.0, 32, 32)
    assert torch.equal(plain, dynamic)


def test_unknown_rope_type_is_a_one_line_error_listing_the_supported():
    with pytest.raises(ModelLoadError, match=r"rope scaling type 'mrope' is not supported; supported: "
                                             r"default, dynamic, linear, llama3, .*yarn") as info:
        inv_freq_and_factor({"rope_type": "mrope"}, HEAD_DIM, 5000.0, 8, 8)
    assert "\n" not in str(info.value)
