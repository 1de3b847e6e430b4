"""Reading a PEFT adapter: what is accepted (scale, rsLoRA, fused targets in slots) and what is
refused with the field named; the --lora-modules flag's form; Phi-3's fused linears, mixture-of-
experts layers (attention and dense MLPs adapted, experts refused by name); each tensor-parallel
rank's part of an adapter against the whole."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from safetensors.torch import save_file

from iterserve.engine.config import ConfigError, EngineConfig
from iterserve.engine.lora.adapter import LoraError, load_adapter
from iterserve.engine.lora.manager import LoraManager
from iterserve.engine.model.loader import ModelConfig
from iterserve.engine.model.moe import MoeSettings
from iterserve.engine.model.parallel import Shard, shard_rows

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


# -- families: Phi-3's fused linears, mixture-of-experts layers, multimodal checkpoints -------------

PHI3 = replace(CONFIG, architecture="phi3")
PHI3_SHAPES = {"qkv_proj": (16, 32), "o_proj": (16, 16), "gate_up_proj": (16, 48), "down_proj": (24, 16)}
MOE = replace(CONFIG, architecture="qwen3_moe", moe=MoeSettings(num_experts=4, top_k=2, intermediate_size=8,
                                                                normalize_top_k=True, sparse_layers=(True, False)))


def raw_adapter(folder, tensors: dict[str, tuple[int, int]], rank=4, seed=0, **config):
    """An adapter of these (key prefix -> (in, out)) A/B pairs, random A and B."""
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for prefix, (fan_in, fan_out) in tensors.items():
        weights[f"base_model.model.{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen)
        weights[f"base_model.model.{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({"r": rank, "lora_alpha": 8, **config}))
    return folder


def full_adapter(folder, config: ModelConfig, seed=0):
    """Every linear of both layers adapted (q/k/v/o, gate/up/down; Phi-3's fused names on Phi-3)."""
    shapes = PHI3_SHAPES if config.architecture == "phi3" else SHAPES
    mlp = ("gate_proj", "up_proj", "down_proj", "gate_up_proj")
    return raw_adapter(folder, {f"model.layers.{layer}.{'mlp' if module in mlp else 'self_attn'}.{module}": shape
                                for layer in range(2) for module, shape in shapes.items()}, seed=seed)


def deltas(manager: LoraManager, layers, name: str, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each fused target's LoRA delta of layer 1 on inputs[target] (rows all of adapter name)."""
    step = manager.step([name] * 3)
    out = {}
    for target, x in inputs.items():
        width = manager.weights[1][target][1].shape[2]
        out[target] = step.add(layers[1], target, x, torch.zeros(x.shape[0], width))
    return out


def test_phi3_fused_qkv_and_gate_up_take_one_a_and_b_over_the_fused_output(tmp_path):
    layers = [object(), object()]
    manager = LoraManager(PHI3, layers, max_loras=1, max_lora_rank=8, max_cpu_loras=1, device=torch.device("cpu"),
                          dtype=torch.float32)
    manager.register("p", str(full_adapter(tmp_path / "p", PHI3)))
    read = load_adapter("p", tmp_path / "p", PHI3, 8)
    x = {"qkv": torch.randn(3, 16), "o": torch.randn(3, 16), "gate_up": torch.randn(3, 16), "down": torch.randn(3, 24)}
    got = deltas(manager, layers, "p", x)
    for target, module in (("qkv", "qkv_proj"), ("o", "o_proj"), ("gate_up", "gate_up_proj"), ("down", "down_proj")):
        a, b = read.weights[(1, module)]
        torch.testing.assert_close(got[target], x[target] @ a.t() @ b.t() * read.scale)
    with pytest.raises(LoraError, match="adaptable on phi3: qkv_proj, o_proj, gate_up_proj, down_proj"):
        load_adapter("split", adapter(tmp_path / "split"), PHI3, 8)  # q_proj: not a Phi-3 module


@pytest.mark.parametrize(("tensors", "named"), [
    ({"model.layers.0.mlp.experts.1.gate_proj": (16, 8)}, r"mlp\.experts\.1\.gate_proj.*not supported.*q_proj"),
    ({"model.layers.0.mlp.gate": (16, 4)}, r"mlp\.gate, part of a mixture-of-experts block"),
    ({"model.layers.0.mlp.down_proj": (24, 16)}, r"mlp\.down_proj of layer 0, a mixture-of-experts layer"),
])
def test_mixture_of_experts_layers_refuse_expert_adapters_naming_the_module(tmp_path, tensors, named):
    with pytest.raises(LoraError, match=named):
        load_adapter("moe", raw_adapter(tmp_path, tensors), MOE, 8)


def test_mixture_of_experts_attention_and_dense_mlps_are_adapted(tmp_path):
    tensors = {"model.layers.0.self_attn.q_proj": (16, 16), "model.layers.1.self_attn.o_proj": (16, 16),
               "model.layers.1.mlp.down_proj": (24, 16)}  # layer 1 is dense
    assert set(load_adapter("moe", raw_adapter(tmp_path / "ok", tensors), MOE, 8).weights) == {
        (0, "q_proj"), (1, "o_proj"), (1, "down_proj")}
    with pytest.raises(LoraError, match="target_parameters.*not supported; adaptable on qwen3_moe: q_proj"):
        load_adapter("p", raw_adapter(tmp_path / "p", tensors, target_parameters=["mlp.experts.gate_up_proj"]), MOE, 8)


def test_a_multimodal_checkpoint_s_vision_tower_lora_is_ignored(tmp_path):
    tensors = {"model.language_model.layers.0.self_attn.q_proj": (16, 16),
               "model.vision_tower.vision_model.encoder.layers.0.self_attn.q_proj": (40, 40)}
    assert set(load_adapter("mm", raw_adapter(tmp_path, tensors), CONFIG, 8).weights) == {(0, "q_proj")}


# -- tensor parallelism: each rank's slots hold its part ----------------------------------------------

@pytest.mark.parametrize("config", [CONFIG, replace(CONFIG, num_heads=4, num_kv_heads=2, head_dim=4), PHI3],
                         ids=["kv-replicated", "kv-split", "phi3-fused"])
def test_a_rank_s_part_gives_its_output_columns_or_its_share_of_the_sum(tmp_path, config):
    """Column-parallel q/k/v and gate/up: the rank's delta is the whole delta's columns of its rows
    (k/v: its KV head's, replicated when fewer KV heads than ranks). Row-parallel o and down: the
    ranks' deltas over their input columns sum to the whole delta."""
    path = str(full_adapter(tmp_path / "a", config, seed=3))
    layers = [object(), object()]
    whole = LoraManager(config, layers, 1, 8, 1, torch.device("cpu"), torch.float32)
    whole.register("a", path)
    x = {"qkv": torch.randn(3, 16), "o": torch.randn(3, 16), "gate_up": torch.randn(3, 16), "down": torch.randn(3, 24)}
    want = deltas(whole, layers, "a", x)
    q, kv, inter = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim, config.intermediate_size
    summed = {"o": 0, "down": 0}
    for rank in range(2):
        shard = Shard(rank, 2)
        part = LoraManager(config, layers, 1, 8, 1, torch.device("cpu"), torch.float32, shard=shard)
        part.register("a", path)
        q_rows, kv_rows, mlp_rows = shard_rows(config, shard)
        got = deltas(part, layers, "a", {"qkv": x["qkv"], "gate_up": x["gate_up"], "o": x["o"][:, q_rows],
                                         "down": x["down"][:, mlp_rows]})
        qkv = want["qkv"]
        torch.testing.assert_close(got["qkv"], torch.cat([qkv[:, q_rows], qkv[:, q:q + kv][:, kv_rows],
                                                          qkv[:, q + kv:][:, kv_rows]], dim=1))
        torch.testing.assert_close(got["gate_up"], torch.cat([want["gate_up"][:, :inter][:, mlp_rows],
                                                              want["gate_up"][:, inter:][:, mlp_rows]], dim=1))
        summed = {target: summed[target] + got[target] for target in summed}
    for target, total in summed.items():
        torch.testing.assert_close(total, want[target])


def test_a_worker_reads_an_adapter_again_when_rank_0_reloads_its_name(tmp_path):
    """Rank 0's sources name each load; a worker's ensure reads a load it has not read, and its slot
    then holds the new adapter."""
    layers = [object(), object()]
    rank0, worker = (LoraManager(CONFIG, layers, 1, 8, 1, torch.device("cpu"), torch.float32) for _ in range(2))
    first, second = str(adapter(tmp_path / "one")), str(full_adapter(tmp_path / "two", CONFIG, seed=5))
    rank0.register("x", first)
    worker.ensure("x", rank0.sources(["x"])["x"])
    x = {"qkv": torch.randn(3, 16)}
    torch.testing.assert_close(deltas(worker, layers, "x", x), deltas(rank0, layers, "x", x))
    worker.ensure("x", rank0.sources(["x"])["x"])  # the same load: nothing read
    assert worker.slot_loads == 1
    rank0.unregister("x")
    rank0.register("x", second)
    assert rank0.sources(["x"])["x"] == (second, 2)
    worker.ensure("x", rank0.sources(["x"])["x"])
    torch.testing.assert_close(deltas(worker, layers, "x", x), deltas(rank0, layers, "x", x))
    assert worker.slot_loads == 2
