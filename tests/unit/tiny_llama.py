"""A tiny random Llama written as a GGUF file (quantized as asked, q/k permuted the way llama.cpp's
convert does) and as a HuggingFace directory, for loader and model tests."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from iterserve.engine.model.loader import permute_rows

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS, CONTEXT = 64, 4, 2, 16, 256, 2, 128
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EOS_ID = 256  # <|endoftext|>
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_tokens() -> list[str]:
    from iterserve.engine.model.tokenizer import _bytes_to_unicode

    table = _bytes_to_unicode()
    return [table[b] for b in range(256)]


VOCAB = len(byte_tokens()) + len(SPECIALS)


def hf_weights(seed: int = 0, tied: bool = True) -> dict[str, np.ndarray]:
    """HF-layout float32 weights, scaled so activations stay O(1)."""
    rng = np.random.default_rng(seed)

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    def norm() -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32)

    weights = {"model.embed_tokens.weight": rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32),
               "model.norm.weight": norm()}
    if not tied:
        weights["lm_head.weight"] = mat(VOCAB, HIDDEN)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        weights |= {
            p + "input_layernorm.weight": norm(),
            p + "post_attention_layernorm.weight": norm(),
            p + "self_attn.q_proj.weight": mat(HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.k_proj.weight": mat(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.v_proj.weight": mat(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.o_proj.weight": mat(HIDDEN, HEADS * HEAD_DIM),
            p + "mlp.gate_proj.weight": mat(FFN, HIDDEN),
            p + "mlp.up_proj.weight": mat(FFN, HIDDEN),
            p + "mlp.down_proj.weight": mat(HIDDEN, FFN),
        }
    return weights


_TO_GGUF = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(hf_name: str) -> str:
    special = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
               "lm_head.weight": "output.weight"}
    if hf_name in special:
        return special[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module = rest.removesuffix(".weight")
    return f"blk.{layer}.{_TO_GGUF[module]}.weight"


def write_gguf(path: Path, weights: dict[str, np.ndarray], types: dict[str, str] | None = None,
               raw: dict[str, tuple[np.ndarray, str]] | None = None, arch: str = "llama") -> Path:
    """types: HF name -> GGML type name (default F32). raw: HF name -> (already-encoded bytes, type)."""
    import gguf

    types, raw = types or {}, raw or {}
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(LAYERS)
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(byte_tokens() + SPECIALS)
    writer.add_token_types([1] * 256 + [3] * len(SPECIALS))
    writer.add_token_merges([])
    writer.add_eos_token_id(EOS_ID)
    writer.add_bos_token_id(EOS_ID)
    writer.add_chat_template(CHAT_TEMPLATE)
    for name, array in weights.items():
        if "q_proj" in name:
            array = permute_rows(array, HEADS)
        elif "k_proj" in name:
            array = permute_rows(array, KV_HEADS)
        if name in raw:
            data, qtype = raw[name]
            writer.add_tensor(gguf_name(name), data, raw_dtype=gguf.GGMLQuantizationType[qtype])
            continue
        qtype = types.get(name, "F32")
        if qtype == "F32":
            writer.add_tensor(gguf_name(name), array)
        elif qtype == "F16":
            writer.add_tensor(gguf_name(name), array.astype(np.float16))
        else:
            kind = gguf.GGMLQuantizationType[qtype]
            writer.add_tensor(gguf_name(name), gguf.quants.quantize(array, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_hf_dir(path: Path, weights: dict[str, np.ndarray], tied: bool = True) -> Path:
    """config.json + model.safetensors + tokenizer files, as transformers saves a Llama."""
    import torch
    from safetensors.torch import save_file

    from iterserve.engine.model.tokenizer import Tokenizer

    path.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB,
        "hidden_size": HIDDEN, "intermediate_size": FFN, "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
        "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "max_position_embeddings": CONTEXT,
        "tie_word_embeddings": tied, "bos_token_id": EOS_ID, "eos_token_id": EOS_ID, "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    (path / "config.json").write_text(json.dumps(config))
    save_file({k: torch.from_numpy(v) for k, v in weights.items()}, str(path / "model.safetensors"))
    gguf_file = write_gguf(path / "tokenizer-source.gguf", {"model.embed_tokens.weight": weights[
        "model.embed_tokens.weight"]})
    Tokenizer.from_gguf(gguf_file).backend.save(str(path / "tokenizer.json"))
    gguf_file.unlink()
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": SPECIALS[0], "bos_token": SPECIALS[0], "chat_template": CHAT_TEMPLATE}))
    return path
