"""Small random Llama models for the tensor-parallel tests, built with transformers (LlamaConfig,
a fixed seed, 2 layers, hidden 64, head_dim 16) and saved as safetensors with the embedded
SmolLM2's tokenizer, so prompts are real text:

- h8kv4: 8 heads, 4 KV heads (split evenly by 2 and by 4), q/k/v/o and MLP biases (a row-parallel
  bias must count once);
- h4kv1: 4 heads, 1 KV head (replicated on every rank), a vocabulary of 49155 (not a multiple of
  2 or 4: the last rank's vocabulary part is short)."""

from __future__ import annotations

import json
from pathlib import Path

MODELS = {
    "h8kv4": dict(num_attention_heads=8, num_key_value_heads=4, attention_bias=True, mlp_bias=True),
    "h4kv1": dict(num_attention_heads=4, num_key_value_heads=1, extra_vocab=3),
}


def build(name: str, directory: Path) -> Path:
    import torch
    import transformers

    from iterserve.engine.model.registry import resolve_model_path
    from iterserve.engine.model.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_gguf(resolve_model_path(None)[0])
    options = dict(MODELS[name])
    extra_vocab = options.pop("extra_vocab", 0)
    config = transformers.LlamaConfig(
        vocab_size=tokenizer.vocab_size + extra_vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-5, initializer_range=0.2, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, **options)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # biases and norms away from 0 and 1, so one counted twice shows
        for param_name, param in model.named_parameters():
            if param_name.endswith(".bias"):
                param.copy_(0.2 * torch.randn(param.shape, generator=gen))
            elif "norm" in param_name:
                param.copy_(1.0 + 0.2 * torch.randn(param.shape, generator=gen))
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    tokenizer.backend.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": tokenizer.token(tokenizer.eos_token_id), "bos_token": tokenizer.token(tokenizer.bos_token_id),
        "chat_template": tokenizer.chat_template}))
    return directory
