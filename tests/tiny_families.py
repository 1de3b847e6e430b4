"""Tiny random Gemma 2, Gemma 3, Phi-3 and Qwen3-MoE models built with transformers' own config and
model classes (a fixed seed, a few layers, GQA, a window shorter than the prompts, soft-caps, LongRoPE
with a short original length, 8 experts top-2), saved with save_pretrained as safetensors, and
written as GGUF under llama.cpp's tensor names and metadata keys (what its convert_hf_to_gguf.py
writes for gemma2, gemma3, phi3 and qwen3moe: Gemma's norms stored as 1 + w, Phi-3's fused qkv and
gate_up, the LongRoPE factors as tensors, the experts as 3-D stacks). Both carry the embedded
SmolLM2's tokenizer, so prompts are real text."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

VOCAB = 49152  # SmolLM2's
WINDOW = 12
PHI3_ORIGINAL = 40  # LongRoPE's original length: the parity prompts run past it

# family -> (transformers config class, model class, config kwargs)
FAMILIES = {
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=24, attn_logit_softcapping=3.0,
        final_logit_softcapping=8.0, max_position_embeddings=256)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=16, sliding_window_pattern=2,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], max_position_embeddings=256,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, original_max_position_embeddings=PHI3_ORIGINAL, sliding_window=WINDOW,
        pad_token_id=None, tie_word_embeddings=False)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        hidden_size=64, intermediate_size=96, moe_intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
        max_position_embeddings=256, tie_word_embeddings=False)),
}


def smollm_gguf() -> Path:
    from iterserve.engine.model.registry import default_model_path

    return default_model_path()


def _phi3_rope(head_dim: int) -> dict:
    rng = np.random.default_rng(7)
    return {"rope_type": "longrope", "rope_theta": 10000.0,
            "short_factor": (1.0 + rng.random(head_dim // 2)).round(3).tolist(),
            "long_factor": (1.0 + 6 * rng.random(head_dim // 2)).round(3).tolist()}


def hf_model(family: str, seed: int = 0, **overrides):
    """The transformers model, float32, weights drawn so activations stay O(1) (transformers'
    0.02-std init makes every logit nearly equal, and greedy ties flaky); norms random around
    their identity."""
    import transformers

    config_name, model_name, kwargs = FAMILIES[family]
    kwargs = {**kwargs, "vocab_size": VOCAB, "bos_token_id": 1, "eos_token_id": 2, **overrides}
    if family == "phi3" and "rope_parameters" not in kwargs:
        partial = kwargs.get("partial_rotary_factor", 1.0)
        kwargs["rope_parameters"] = _phi3_rope(int(kwargs["hidden_size"] // kwargs["num_attention_heads"] * partial))
    config = getattr(transformers, config_name)(**kwargs)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).float().eval()
    gen = torch.Generator().manual_seed(seed + 1)
    gemma = family.startswith("gemma")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_((0.0 if gemma else 1.0) + 0.1 * torch.randn(p.shape, generator=gen))
            elif "embed_tokens" in name:
                # Gemma scales it by sqrt(hidden) and ties it to the lm_head: a large one makes the
                # model repeat its input token
                p.copy_(torch.randn(p.shape, generator=gen) * (0.05 if gemma else 1.0))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
    return model


def write_tokenizer(path: Path) -> None:
    from iterserve.engine.model.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf(smollm_gguf())
    tokenizer.backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": tokenizer.token(tokenizer.eos_token_id), "bos_token": tokenizer.token(tokenizer.bos_token_id),
        "chat_template": tokenizer.chat_template}))


def save_hf(model, path: Path) -> Path:
    model.save_pretrained(str(path), safe_serialization=True)
    write_tokenizer(path)
    return path


# -- GGUF ----------------------------------------------------------------------------------------------

_COMMON = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
           "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
           "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
           "mlp.down_proj": "ffn_down"}
_LAYER_NAMES = {
    "gemma2": {**_COMMON, "post_attention_layernorm": "post_attention_norm",
               "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"},
    "phi3": {**_COMMON, "post_attention_layernorm": "ffn_norm", "self_attn.qkv_proj": "attn_qkv",
             "mlp.gate_up_proj": "ffn_up"},
    "qwen3_moe": {**_COMMON, "post_attention_layernorm": "ffn_norm", "mlp.gate": "ffn_gate_inp"},
}
_LAYER_NAMES["gemma3"] = _LAYER_NAMES["gemma2"]
GGUF_ARCH = {"gemma2": "gemma2", "gemma3": "gemma3", "phi3": "phi3", "qwen3_moe": "qwen3moe"}


def _tokenizer_metadata(writer) -> None:
    from iterserve.engine.model.loader import open_gguf

    reader = open_gguf(smollm_gguf())

    def field(key):
        value = reader.fields.get(key)
        return None if value is None else value.contents()

    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(field("tokenizer.ggml.pre") or "gpt2")
    writer.add_token_list(field("tokenizer.ggml.tokens"))
    writer.add_token_types(field("tokenizer.ggml.token_type"))
    writer.add_token_merges(field("tokenizer.ggml.merges"))
    writer.add_bos_token_id(field("tokenizer.ggml.bos_token_id"))
    writer.add_eos_token_id(field("tokenizer.ggml.eos_token_id"))
    writer.add_chat_template(field("tokenizer.chat_template"))


def _gguf_tensors(family: str, model) -> dict[str, np.ndarray]:
    """HF state dict -> llama.cpp names, as its convert writes them for this architecture."""
    config = model.config
    state = {k: v.detach().float() for k, v in model.state_dict().items() if "rotary_emb" not in k}
    out: dict[str, np.ndarray] = {}
    names = _LAYER_NAMES[family]
    for name, tensor in state.items():
        if family.startswith("gemma") and name.endswith("norm.weight"):
            tensor = tensor + 1.0  # llama.cpp's Gemma convert stores 1 + w
        if name == "model.embed_tokens.weight":
            out["token_embd.weight"] = tensor
        elif name == "model.norm.weight":
            out["output_norm.weight"] = tensor
        elif name == "lm_head.weight":
            if not config.tie_word_embeddings:
                out["output.weight"] = tensor
        elif ".mlp.experts." in name:
            layer = name.split(".")[2]
            if name.endswith("gate_up_proj"):  # [E, 2I, H] -> ffn_gate_exps / ffn_up_exps [E, I, H]
                gate, up = tensor.chunk(2, dim=1)
                out[f"blk.{layer}.ffn_gate_exps.weight"] = gate
                out[f"blk.{layer}.ffn_up_exps.weight"] = up
            else:
                out[f"blk.{layer}.ffn_down_exps.weight"] = tensor
        else:
            _, _, layer, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            out[f"blk.{layer}.{names[module]}.{kind}"] = tensor
    return {k: v.contiguous().numpy() for k, v in out.items()}


def write_gguf(family: str, model, path: Path) -> Path:
    import gguf

    config = model.config
    arch = GGUF_ARCH[family]
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny-{family}")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    rope = config.rope_parameters
    if family.startswith("gemma"):
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_sliding_window(config.sliding_window)
        if family == "gemma2":
            writer.add_rope_freq_base(rope["rope_theta"])
            writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
            writer.add_final_logit_softcapping(config.final_logit_softcapping)
        else:
            full, local = rope["full_attention"], rope["sliding_attention"]
            writer.add_rope_freq_base(full["rope_theta"])
            writer.add_rope_freq_base_swa(local["rope_theta"])
            if full.get("rope_type") == "linear":
                writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
                writer.add_rope_scaling_factor(full["factor"])
            writer.add_sliding_window_pattern([t == "sliding_attention" for t in config.layer_types])
        if config.query_pre_attn_scalar != head_dim:
            # llama.cpp's files carry no query_pre_attn_scalar (the loader then takes head_dim, as
            # llama.cpp does below 27B); a scale key keeps the tiny Gemma 2's own
            writer.add_attention_scale(config.query_pre_attn_scalar ** -0.5)
    elif family == "phi3":
        writer.add_rope_freq_base(rope["rope_theta"])
        writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
        if rope.get("rope_type") == "longrope":
            import math

            original = config.original_max_position_embeddings
            scale = config.max_position_embeddings / original
            writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)))
            writer.add_rope_scaling_orig_ctx_len(original)
            writer.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], dtype=np.float32))
            writer.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], dtype=np.float32))
        if config.sliding_window:
            writer.add_sliding_window(config.sliding_window)
    else:
        writer.add_rope_freq_base(rope["rope_theta"])
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    _tokenizer_metadata(writer)
    for name, array in _gguf_tensors(family, model).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
