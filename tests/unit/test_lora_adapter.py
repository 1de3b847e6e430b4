"""Reading a PEFT adapter: what is accepted (scale, rsLoRA, fused targets in slots) and what is
refused with the field named; the --lora-modules flag's form."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from iterserve.engine.config import ConfigError, EngineConfig
from iterserve.engine.lora.adapter import LoraError, load_adapter
from iterserve.engine.lora.manager import LoraManager
from iterserve.engine.model.loader import ModelConfig

CONFIG = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_layers=2, num_heads=2, num_kv_heads=1,
                     head_dim=8, rope_theta=10000.0, rms_norm_eps=1e-5, max_position_embeddings=64,
                     tie_word_embeddings=True)
SHAPES = {"q_proj": (16, 16), "k_proj": (16, 8), "v_proj": (16, 8), "o_proj": (16, 16), "gate_proj": (16, 24),
          "up_proj": (16, 24), "down_proj": (24, 16)}


def adapter(tmp_path, rank=4, targets=("q_proj", "v_proj", "up_proj"), layers=2, shapes=SHAPES, **config):
    tensors = {}
    for layer in range(layers):
        for module in targets:
            block = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, shapes[module][0])
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(shapes[module][1], rank)
    tmp_path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(tmp_path / "adapter_model.safetensors"))
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": rank, "lora_alpha": 8, **config}))
    return tmp_path


def test_scale_is_alpha_over_rank_or_over_its_root_with_rslora(tmp_path):
    assert load_adapter("a", adapter(tmp_path / "a"), CONFIG, 8).scale == 2.0
    assert load_adapter("b", adapter(tmp_path / "b", use_rslora=True), CONFIG, 8).scale == 4.0


@pytest.mark.parametrize(("change", "named"), [
    ({"rank": 9}, "--max-lora-rank 8"),
    ({"use_dora": True}, "use_dora"),
    ({"bias": "all"}, "bias"),
    ({"rank_pattern": {"q_proj": 2}}, "rank_pattern"),
    ({"layers": 3}, "layer 2"),
    ({"shapes": {**SHAPES, "q_proj": (16, 12)}}, "another base model"),
])
def test_an_adapter_this_engine_cannot_serve_is_refused_naming_why(tmp_path, change, named):
    with pytest.raises(LoraError, match=named):
        load_adapter("bad", adapter(tmp_path, **change), CONFIG, 8)


def test_a_missing_directory_names_the_format(tmp_path):
    with pytest.raises(LoraError, match="adapter_config.json"):
        load_adapter("gone", tmp_path / "nowhere", CONFIG, 8)


def test_fused_slots_hold_each_module_in_its_block_and_eviction_keeps_the_step_s_adapters(tmp_path):
    manager = LoraManager(CONFIG, [object(), object()], max_loras=2, max_lora_rank=8, max_cpu_loras=2,
                          device=torch.device("cpu"), dtype=torch.float32)
    for name in "abc":
        manager.register(name, str(adapter(tmp_path / name)))
    step = manager.step(["a", None, "b", "b"])
    assert step.segments == ([0, 2], [1, 2], [manager._slot_of["a"], manager._slot_of["b"]])
    a_slots, b_slots = manager.weights[0]["qkv"]
    read = load_adapter("a", tmp_path / "a", CONFIG, 8)
    slot = manager._slot_of["a"]
    q_a, q_b = read.weights[(0, "q_proj")]
    v_a, v_b = read.weights[(0, "v_proj")]
    assert torch.equal(a_slots[slot, :, :4], q_a.t()) and torch.equal(a_slots[slot, :, 16:20], v_a.t())
    assert torch.equal(b_slots[slot, :4, :16], q_b.t()) and torch.equal(b_slots[slot, 16:20, 24:32], v_b.t())
    assert not b_slots[slot, 8:16].any()  # k_proj is not targeted: its block stays zero
    manager.step(["c", "b"])  # a is the least recently used slot not needed: c takes it
    assert set(manager.loaded_in_slots()) == {"b", "c"} and manager._slot_of["c"] == slot
    with pytest.raises(RuntimeError, match="--max-loras 2"):
        manager.step(["a", "b", "c"])


def test_lora_modules_take_name_equals_path():
    assert EngineConfig(lora_modules=("x=/a", "y=/b")).lora_module_paths() == {"x": "/a", "y": "/b"}
    with pytest.raises(ConfigError, match="NAME=PATH"):
        EngineConfig(lora_modules=("x",)).resolve(64)
    assert EngineConfig(lora_modules=("x=/a",)).resolve(64).enable_lora
