"""LoRA adapters made with peft on the embedded model, saved in PEFT's format: the references of
the LoRA tests (engine/lora). Random A, non-zero random B, fixed seeds; several ranks, rsLoRA and
target sets. `peft_adapters` yields (folder of the saved adapters, the PeftModel holding them all,
the specs); the PeftModel is built on its own copy of the transformers model, so the session's
hf_smollm is never touched."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch


@dataclass(frozen=True)
class AdapterSpec:
    name: str
    rank: int
    alpha: int
    targets: tuple[str, ...]
    rslora: bool = False


ADAPTERS = (
    AdapterSpec("all-r8", 8, 16, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")),
    AdapterSpec("qv-r5-rslora", 5, 7, ("q_proj", "v_proj"), rslora=True),
    AdapterSpec("mlp-o-r3", 3, 12, ("o_proj", "gate_proj", "down_proj")),
)


@pytest.fixture(scope="module")
def peft_adapters(tmp_path_factory):
    from peft import LoraConfig, get_peft_model

    from iterserve.engine.model.registry import resolve_model_path
    from tests.hf_fixture import hf_model

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("lora-adapters")
    model = None
    try:
        base = hf_model(resolve_model_path(None)[0]).eval()
        for spec in ADAPTERS:
            config = LoraConfig(r=spec.rank, lora_alpha=spec.alpha, target_modules=list(spec.targets),
                                use_rslora=spec.rslora, init_lora_weights=False, lora_dropout=0.0)
            if model is None:
                model = get_peft_model(base, config, adapter_name=spec.name)
            else:
                model.add_adapter(spec.name, config)
            gen = torch.Generator().manual_seed(len(spec.name) * 1000 + spec.rank)
            for name, param in model.named_parameters():
                if f".{spec.name}." in name and "lora_" in name:
                    std = 0.1 if "lora_A" in name else 0.1
                    param.data.copy_(torch.randn(param.shape, generator=gen) * std)
        model.save_pretrained(str(root))  # every adapter but "default" in root/<name>
        model.eval()
        yield root, model, ADAPTERS
    finally:
        torch.set_num_threads(previous)


# The embedded SmolLM2-135M's linears: (in, out).
SMOLLM_SHAPES = {"q_proj": (576, 576), "k_proj": (576, 192), "v_proj": (576, 192), "o_proj": (576, 576),
                 "gate_proj": (576, 1536), "up_proj": (576, 1536), "down_proj": (1536, 576)}


def write_adapter(folder, rank: int, targets: tuple[str, ...], seed: int, layers: int = 30, alpha: int = 16):
    """An adapter in PEFT's file format for the embedded model, written without peft (fast): random
    A and B on every layer's targets."""
    import json

    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(layers):
        for module in targets:
            fan_in, fan_out = SMOLLM_SHAPES[module]
            block = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * 0.1
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.1
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": alpha,
                                                            "target_modules": list(targets), "bias": "none"}))
    return folder
