"""LoRA adapters under --tensor-parallel-size 2, real rank processes over gloo on 127.0.0.1: the
greedy tokens of a batch mixing two adapters and the base equal one process's. Each rank holds
its part of every adapter (column-parallel q/k/v and gate/up shard B's output rows, row-parallel
o and down A's input columns, whose partial delta the layer's all-reduce sums); one adapter is
given at start (--lora-modules), the other loaded through the offline API while the engine
runs, so it reaches the worker through the step plan. Models: tests/tp_models.py's Llama with
q/k/v/o and MLP biases (8 heads, 4 KV heads), and a tiny Phi-3 whose adapters are on its fused
qkv_proj and gate_up_proj."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from iterserve.engine import LLM, LoRARequest, SamplingParams
from iterserve.engine.config import ConfigError
from iterserve.engine.model.loader import load_model
from iterserve.engine.model.registry import resolve_model_path
from iterserve.engine.model.tokenizer import Tokenizer
from tests import tiny_families as tiny
from tests import tp_models

pytestmark = pytest.mark.slow  # about 40 s: two models, each at TP=1 and TP=2

NEW_TOKENS = 12


def write_adapter(folder, model_dir, rank: int, seed: int):
    """Random A and B on every linear the model's family adapts (PEFT's file format)."""
    from iterserve.engine.lora.adapter import module_shapes

    config = load_model(model_dir, show_progress=False).config
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for module, (fan_in, fan_out) in module_shapes(config).items():
            block = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * 0.3
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.3
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({"r": rank, "lora_alpha": 2 * rank}))
    return str(folder)


@pytest.fixture(scope="module")
def setups(tmp_path_factory):
    """name -> (model folder, adapter a's folder, adapter b's folder)."""
    root = tmp_path_factory.mktemp("lora-tp")
    phi3 = tiny.save_hf(tiny.hf_model("phi3", original_max_position_embeddings=200), root / "phi3")
    models = {"h8kv4": tp_models.build("h8kv4", root / "h8kv4"), "phi3": phi3}
    return {name: (str(path), write_adapter(root / f"{name}-a", path, 4, 1), write_adapter(root / f"{name}-b", path, 3, 2))
            for name, path in models.items()}


@pytest.fixture(scope="module")
def prompts():
    tokenizer = Tokenizer.from_gguf(resolve_model_path(None)[0])
    return [tokenizer.encode(text) for text in (
        "Once upon a time, in a small village at the edge of a great forest,", "The capital of France is",
        "def add(a, b):", "Once upon a time, in a small village")]


def greedy(setup, prompts, tp: int) -> list[list[int]]:
    model, path_a, path_b = setup
    llm = LLM(model=model, tensor_parallel_size=tp, device="cpu", attention_backend="torch", dtype="float32",
              num_kv_blocks=32, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=16, max_loras=2,
              max_lora_rank=4, lora_modules=(f"a={path_a}",))
    try:
        params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
        b = LoRARequest("b", 2, path_b)  # read at run time: the worker learns it from the step plan
        outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=["a", None, b, "a"])
        base = llm.generate(prompts[:1], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in [*outputs, *base]]
    finally:
        llm.engine.close()


@pytest.mark.parametrize("name", ["h8kv4", "phi3"])
def test_two_ranks_with_adapters_give_one_process_s_tokens(setups, prompts, name):
    one = greedy(setups[name], prompts, 1)
    assert one[0] != one[4]  # adapter a changes prompt 0's tokens from the base model's
    assert greedy(setups[name], prompts, 2) == one


def test_lora_with_pipeline_stages_is_refused_naming_the_combination(setups):
    with pytest.raises(ConfigError, match="--enable-lora / --lora-modules with --pipeline-parallel-size above 1"):
        LLM(model=setups["h8kv4"][0], pipeline_parallel_size=2, enable_lora=True, device="cpu", dtype="float32")
