"""Qwen3-MoE: Qwen3's attention (per-head q/k RMSNorm, no q/k/v bias) with a mixture-of-experts
feed-forward block: a router picks each token's top-k of `num_experts` SiLU-gated experts
(softmax in float32, renormalised when `norm_topk_prob`), engine/model/moe.py. Layers listed in
`mlp_only_layers`, or off the `decoder_sparse_step` stride, keep a dense MLP of
`intermediate_size`, as transformers lays them out. There is no shared expert in this family.

Checkpoints: per-expert tensors (mlp.experts.E.{gate,up,down}_proj.weight, the router
mlp.gate.weight), or transformers' fused mlp.experts.gate_up_proj / down_proj; both become
[E, 2 * I, hidden] and [E, hidden, I] stacks. GGUF (llama.cpp arch "qwen3moe"): ffn_gate_inp,
ffn_{gate,up,down}_exps as 3-D tensors, expert_count / expert_used_count /
expert_feed_forward_length; llama.cpp always renormalises the top-k weights (unless the file's
expert_weights_norm says otherwise), and every layer is sparse.

Paths: torch (the experts grouped by expert, each chosen expert's weights read once per step) and
Triton (the fused kernel in engine/kernels/moe.py); not the CPU fused kernels. --quantization int8 /
w8a8 quantize the attention and dense MLPs and leave the experts dense; int4 is refused.
"""

from __future__ import annotations

from pathlib import Path

import torch

from iterserve.engine.model.architectures import (
    GGUF_LAYER_NAMES,
    Family,
    default_layer_weights,
    gguf_base_config,
    hf_base_config,
    register,
)
from iterserve.engine.model.decoder import DecoderLayer, DecoderModel
from iterserve.engine.model.layers import linear
from iterserve.engine.model.loader import ModelConfig, ModelLoadError
from iterserve.engine.model.moe import MoeSettings, MoeWeights, moe_forward
from iterserve.engine.model.qwen2 import sliding_layers

_MLP = tuple(f"mlp.{p}_proj.weight" for p in ("gate", "up", "down"))
_EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.gate.weight")
_GGUF_NAMES = {**GGUF_LAYER_NAMES, "ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.gate_proj",
               "ffn_up_exps": "mlp.experts.up_proj", "ffn_down_exps": "mlp.experts.down_proj"}


class Qwen3MoeModel(DecoderModel):
    def __init__(self, config: ModelConfig, backend, layers, embed_tokens, norm, lm_head, max_positions: int,
                 quantization: str = "none"):
        super().__init__(config, backend, layers, embed_tokens, norm, lm_head, max_positions, quantization)
        self.experts: dict[int, MoeWeights] = {}  # id(DecoderLayer) -> its experts, for the MoE layers
        self.fused = False
        self._fused_experts = None
        if backend.name == "triton":
            from iterserve.engine.kernels.moe import fused_experts

            self._fused_experts = fused_experts

    @classmethod
    def from_weights(cls, config: ModelConfig, weights: dict[str, torch.Tensor], backend, device: torch.device,
                     dtype: torch.dtype, max_positions: int, quantization: str = "none", q4_1=None,
                     **file_blocks) -> Qwen3MoeModel:
        """The experts stay dense under --quantization int8 / w8a8 (the attention and dense MLPs are
        quantized); int4 is refused."""
        if quantization == "int4":
            raise ModelLoadError("--quantization int4 is not available for qwen3_moe; use int8, w8a8 or none")
        moe = config.moe
        experts: dict[int, MoeWeights] = {}
        for i, sparse in enumerate(moe.sparse_layers):
            if not sparse:
                continue
            prefix = f"model.layers.{i}."
            missing = [n for n in _EXPERTS if prefix + n not in weights]
            if missing:
                raise ModelLoadError(f"{config.name}: layer {i} is a mixture-of-experts layer but "
                                     f"{prefix + missing[0]} is missing")
            gate_up, down, router = (weights.pop(prefix + n).to(device=device, dtype=dtype) for n in _EXPERTS)
            shapes = {"mlp.experts.gate_up_proj": (moe.num_experts, 2 * moe.intermediate_size, config.hidden_size),
                      "mlp.experts.down_proj": (moe.num_experts, config.hidden_size, moe.intermediate_size),
                      "mlp.gate.weight": (moe.num_experts, config.hidden_size)}
            for (name, want), got in zip(shapes.items(), (gate_up, down, router), strict=True):
                if tuple(got.shape) != want:
                    raise ModelLoadError(f"{config.name}: {prefix + name} is {tuple(got.shape)}; num_experts, "
                                         f"hidden_size and moe_intermediate_size give {want}")
            experts[i] = MoeWeights(router=router, gate_up=gate_up.contiguous(), down=down.contiguous(),
                                    top_k=moe.top_k, normalize_top_k=moe.normalize_top_k)
            # the shared builder reads a dense MLP per layer: an empty one stands in for the experts
            for name in _MLP:
                weights[prefix + name] = torch.empty(0, config.hidden_size)
        model = super().from_weights(config, weights, backend, device, dtype, max_positions, quantization, q4_1,
                                     **file_blocks)
        model.experts = {id(model.layers[i]): block for i, block in experts.items()}
        return model

    def mlp(self, attn: torch.Tensor, residual: torch.Tensor, layer: DecoderLayer):
        """Output projection, norm, then the layer's experts (or its dense MLP)."""
        experts = self.experts.get(id(layer))
        if experts is None:
            return super().mlp(attn, residual, layer)
        hidden = self.adapted_linear(layer, "o", attn.reshape(attn.shape[0], self.q_size), layer.o_proj, layer.o_bias)
        x, residual = self.backend.rms_norm(hidden, layer.post_attention_norm, self.config.rms_norm_eps, residual)
        return moe_forward(x, experts, self.backend.silu_and_mul, self._fused_experts, linear), residual


# -- config and weights ------------------------------------------------------------------------------


def _sparse_layers(num_layers: int, step: int, dense: list[int]) -> tuple[bool, ...]:
    """transformers' rule: a layer has experts unless listed in mlp_only_layers or off the step."""
    return tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))


def hf_config(raw: dict, path: Path) -> ModelConfig:
    config = hf_base_config({"intermediate_size": raw.get("moe_intermediate_size"), **raw}, path, "qwen3_moe")
    config.qk_norm = True
    config.attention_bias = config.attention_out_bias = bool(raw.get("attention_bias", False))
    sliding_layers(raw, config)
    try:
        config.moe = MoeSettings(
            # (transformers 5 saves num_experts as num_local_experts)
            num_experts=int(raw["num_experts"] if "num_experts" in raw else raw["num_local_experts"]),
            top_k=int(raw["num_experts_per_tok"]),
            intermediate_size=int(raw["moe_intermediate_size"]),
            normalize_top_k=bool(raw.get("norm_topk_prob", False)),
            sparse_layers=_sparse_layers(config.num_layers, int(raw.get("decoder_sparse_step") or 1),
                                         list(raw.get("mlp_only_layers") or [])))
    except KeyError as exc:
        raise ModelLoadError(f"{path / 'config.json'} lacks {exc.args[0]!r}") from exc
    except ValueError as exc:
        raise ModelLoadError(f"{path / 'config.json'}: {exc}") from exc
    return config


def gguf_config(meta: dict, arch: str, path: Path) -> ModelConfig:
    def get(key: str):
        value = meta.get(f"{arch}.{key}")
        if value is None:
            raise ModelLoadError(f"{path}: GGUF metadata {arch}.{key} is missing")
        return value

    config = gguf_base_config({f"{arch}.feed_forward_length": 0, **meta}, arch, path, "qwen3_moe")
    config.qk_norm = True
    try:
        config.moe = MoeSettings(
            num_experts=int(get("expert_count")), top_k=int(get("expert_used_count")),
            intermediate_size=int(get("expert_feed_forward_length")),
            normalize_top_k=bool(meta.get(f"{arch}.expert_weights_norm", True)),
            sparse_layers=(True,) * config.num_layers)
    except ValueError as exc:
        raise ModelLoadError(f"{path}: {exc}") from exc
    return config


def adapt_weights(weights: dict[str, torch.Tensor], config: ModelConfig) -> None:
    """Each MoE layer's experts as two stacks: gate_up [E, 2 * I, hidden], down [E, hidden, I]."""
    moe = config.moe
    for i, sparse in enumerate(moe.sparse_layers):
        prefix = f"model.layers.{i}.mlp.experts."
        if not sparse or prefix + "gate_up_proj" in weights:
            continue
        if prefix + "gate_proj.weight" in weights:  # GGUF: 3-D stacks already
            gate, up = weights.pop(prefix + "gate_proj.weight"), weights.pop(prefix + "up_proj.weight")
            weights[prefix + "gate_up_proj"] = torch.cat([gate, up], dim=1)
            weights[prefix + "down_proj"] = weights.pop(prefix + "down_proj.weight")
            continue
        names = [f"{prefix}{e}.{p}_proj.weight" for e in range(moe.num_experts) for p in ("gate", "up", "down")]
        missing = [n for n in names if n not in weights]
        if missing:
            raise ModelLoadError(f"{config.name}: expert tensor {missing[0]} is missing "
                                 f"({len(missing)} of layer {i}'s {len(names)})")
        gate_up = [torch.cat([weights.pop(f"{prefix}{e}.gate_proj.weight"), weights.pop(f"{prefix}{e}.up_proj.weight")])
                   for e in range(moe.num_experts)]
        weights[prefix + "gate_up_proj"] = torch.stack(gate_up)
        weights[prefix + "down_proj"] = torch.stack([weights.pop(f"{prefix}{e}.down_proj.weight")
                                                     for e in range(moe.num_experts)])


def layer_weights(config: ModelConfig) -> list[str]:
    """Every layer's attention tensors (the MLP or experts are checked per layer at build time)."""
    return [n for n in default_layer_weights(config) if not n.startswith("mlp.")]


FAMILY = register(Family(
    name="qwen3_moe",
    hf_architectures=("Qwen3MoeForCausalLM",),
    hf_model_types=("qwen3_moe",),
    gguf_architectures=("qwen3moe",),
    hf_config=hf_config,
    gguf_config=gguf_config,
    model_class=Qwen3MoeModel,
    gguf_layer_names=_GGUF_NAMES,
    gguf_permuted_qk=False,
    layer_weights=layer_weights,
    adapt_weights=adapt_weights,
))
