"""LoRA adapters on every family the engine serves, against transformers + peft, on small random
models built with transformers' own config classes (tests/tiny_families.py's Gemma 2, Gemma 3,
Phi-3 and Qwen3-MoE, and Qwen2, Qwen3 and Mistral built here the same way), each with two peft adapters
(random A, non-zero random B, fixed seeds; rank 4 on every linear peft can target, rank 3 with
rsLoRA on a few):

- Phi-3's adapters target its fused qkv_proj and gate_up_proj, as PEFT names them there;
- Qwen3-MoE's adapt the attention (one layer dense, mlp_only_layers); an adapter of the experts is
  refused at start, naming the module (tests/unit/test_lora_adapter.py covers each refused form);
- the engine's logits over a prompt past the sliding window equal peft's (fp32, 1e-4 of the logit
  scale), its greedy tokens equal peft's generate, and a step mixing both adapters and the base
  gives each request the tokens it gets alone.
"""

from __future__ import annotations

import pytest
import torch

from iterserve.engine import LLM, SamplingParams
from iterserve.engine.attention.backend import AttentionMetadata
from iterserve.engine.config import ConfigError
from iterserve.engine.model.tokenizer import Tokenizer
from tests import tiny_families as tiny

pytestmark = pytest.mark.slow  # about 40 s: seven models, fourteen peft adapters, seven engines

NEW_TOKENS = 10
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# family -> (model overrides, adapter "one"'s targets, adapter "two"'s targets)
TARGETS = {
    "gemma2": ({}, ALL, ("q_proj", "v_proj", "down_proj")),
    "gemma3": ({}, ALL, ("k_proj", "o_proj", "up_proj")),
    # original length past every sequence: transformers' generate recomputes at the switch (docs/models.md)
    "phi3": ({"original_max_position_embeddings": 200}, ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"),
             ("qkv_proj", "down_proj")),
    # attention: peft (0.21, transformers 5) turns a MoE model's MLP targets into the experts' fused
    # parameters (target_parameters, refused below); a dense layer's MLP adapter is read in
    # tests/unit/test_lora_adapter.py and runs the Llama path
    "qwen3_moe": ({"mlp_only_layers": [1]}, ("q_proj", "k_proj", "v_proj", "o_proj"), ("q_proj", "v_proj", "o_proj")),
    "qwen2": ({}, ALL, ("q_proj", "v_proj", "down_proj")),
    "qwen3": ({}, ALL, ("k_proj", "gate_proj", "up_proj")),
    "mistral": ({}, ALL, ("o_proj", "gate_proj")),
}
# Llama-like families built here as tiny_families builds the others (q/k/v biases on Qwen2, a window on
# Mistral, q/k norms on Qwen3)
LLAMA_LIKE = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, tie_word_embeddings=False)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, sliding_window=tiny.WINDOW, max_position_embeddings=256, tie_word_embeddings=False)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, max_position_embeddings=256, tie_word_embeddings=False)),
}


def hf_model(family: str, **overrides):
    if family in tiny.FAMILIES:
        return tiny.hf_model(family, **overrides)
    import transformers

    config_name, model_name, kwargs = LLAMA_LIKE[family]
    config = getattr(transformers, config_name)(**kwargs, vocab_size=tiny.VOCAB, bos_token_id=1, eos_token_id=2)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config).float().eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # as tiny_families draws them: activations O(1), norms around 1
        for name, p in model.named_parameters():
            scale = 1.0 if "embed_tokens" in name else p.shape[-1] ** -0.5
            base = 1.0 if name.endswith("norm.weight") else 0.0
            p.copy_(base + (0.1 if base else scale) * torch.randn(p.shape, generator=gen))
    return model


@pytest.fixture(scope="module")
def one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_gguf(tiny.smollm_gguf())


@pytest.fixture(scope="module")
def prompts(tokenizer):
    story = tokenizer.encode(
        "Once upon a time, in a small village at the edge of a great forest, there lived an old clockmaker "
        "who had never once left the valley. Every morning he opened his shop, wound the hundred clocks.")
    return [story[:30], tokenizer.encode("The capital of France is"), story[5:25]]


def build(family: str, root):
    """(the PeftModel holding adapters one and two, the model's folder, the adapters' folder)."""
    from peft import LoraConfig, get_peft_model

    overrides, targets_a, targets_b = TARGETS[family]
    model = hf_model(family, **overrides)
    folder = tiny.save_hf(model, root / family)
    peft_model = None
    for name, rank, alpha, targets, rslora in (("one", 4, 8, targets_a, False), ("two", 3, 5, targets_b, True)):
        config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), use_rslora=rslora,
                            init_lora_weights=False, lora_dropout=0.0)
        if peft_model is None:
            peft_model = get_peft_model(model, config, adapter_name=name)
        else:
            peft_model.add_adapter(name, config)
        gen = torch.Generator().manual_seed(rank)
        for param_name, param in peft_model.named_parameters():
            if f".{name}." in param_name and "lora_" in param_name:
                param.data.copy_(0.3 * torch.randn(param.shape, generator=gen))
    adapters = root / f"{family}-adapters"
    peft_model.save_pretrained(str(adapters))  # one and two in adapters/<name>
    return peft_model.eval(), folder, adapters


def engine_logits(llm, prompt: list[int], lora: str | None) -> torch.Tensor:
    """Every position's logits of prompt through the engine's model (a fresh KV block range)."""
    runner = llm.engine.executor
    block_size = runner.block_size
    blocks = list(range(runner.num_kv_blocks - -(-len(prompt) // block_size), runner.num_kv_blocks))
    meta = AttentionMetadata.build([len(prompt)], [len(prompt)], [blocks], block_size, runner.device)
    model = runner.model
    model.lora_step = runner.lora.step([lora] * len(prompt))
    try:
        with torch.inference_mode():
            return model.compute_logits(model(torch.tensor(prompt), torch.arange(len(prompt)), runner.kv_caches, meta))
    finally:
        model.lora_step = None


def run(engine, requests: list[tuple[list[int], str | None]]) -> list[list[int]]:
    """Greedy tokens of each (prompt, adapter) request, all submitted before the first step."""
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    ids = [engine.add_request(None, params, prompt, lora_name=lora) for prompt, lora in requests]
    done = {}
    while len(done) < len(ids):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    return [done[i] for i in ids]


def peft_reference(peft_model, prompt: list[int], lora: str | None) -> tuple[torch.Tensor, list[int]]:
    ids = torch.tensor([prompt])

    def forward():
        logits = peft_model(ids).logits[0]
        tokens = peft_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=2,
                                     max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)[0, len(prompt):].tolist()
        return logits, tokens

    with torch.inference_mode():
        if lora is None:
            with peft_model.disable_adapter():
                return forward()
        peft_model.set_adapter(lora)
        return forward()


@pytest.mark.parametrize("family", sorted(TARGETS))
def test_adapters_equal_transformers_with_peft_and_mix_in_one_step(family, prompts, tmp_path, one_thread):
    peft_model, folder, adapters = build(family, tmp_path)
    llm = LLM(model=str(folder), device="cpu", dtype="float32", attention_backend="torch", max_model_len=128,
              num_kv_blocks=48, max_num_seqs=4, max_loras=2, max_lora_rank=4,
              lora_modules=(f"one={adapters / 'one'}", f"two={adapters / 'two'}"))
    try:
        prompt = prompts[0]  # 30 tokens: past the sliding window (12)
        base = None
        for lora in (None, "one", "two"):
            reference, hf_tokens = peft_reference(peft_model, prompt, lora)
            logits = engine_logits(llm, prompt, lora)
            scale = reference.abs().max().item()
            error = (logits - reference).abs().max().item()
            assert error <= 1e-4 * scale, f"{family}/{lora}: max error {error:.3g} at scale {scale:.3g}"
            assert run(llm.engine, [(prompt, lora)])[0] == hf_tokens, f"{family}/{lora}"
            if lora is None:
                base = logits
            else:  # the adapter changes the model
                assert (logits - base).abs().max().item() > 1e-2 * scale, f"{family}/{lora}"
        requests = [(prompts[0], "one"), (prompts[1], None), (prompts[2], "two"), (prompts[1], "one")]
        alone = [run(llm.engine, [request])[0] for request in requests]
        assert run(llm.engine, requests) == alone
    finally:
        llm.engine.close()


def test_an_adapter_of_moe_experts_is_refused_at_start_naming_the_module(tmp_path, one_thread):
    """peft's adapter of the experts' fused parameters, and the older per-expert linears
    (mlp.experts.E.gate_proj), as vLLM reads them."""
    import json

    from peft import LoraConfig, get_peft_model
    from safetensors.torch import save_file

    model = tiny.hf_model("qwen3_moe")
    folder = tiny.save_hf(model, tmp_path / "moe")
    peft_model = get_peft_model(model, LoraConfig(r=2, lora_alpha=2, target_modules=["q_proj", "gate_proj", "up_proj",
                                                                                    "down_proj"]))
    peft_model.save_pretrained(str(tmp_path / "peft"))
    with pytest.raises(ConfigError, match=r"target_parameters=.*gate_up_proj.*the experts of a mixture-of-experts "
                                          r"model\) is not supported; adaptable on qwen3_moe: q_proj"):
        LLM(model=str(folder), device="cpu", dtype="float32", num_kv_blocks=8, max_model_len=64,
            lora_modules=(f"experts={tmp_path / 'peft'}",))
    adapter = tmp_path / "experts"
    adapter.mkdir()
    prefix = "base_model.model.model.layers.0.mlp.experts.3.gate_proj"
    save_file({f"{prefix}.lora_A.weight": torch.zeros(2, 64), f"{prefix}.lora_B.weight": torch.ones(48, 2)},
              str(adapter / "adapter_model.safetensors"))
    (adapter / "adapter_config.json").write_text(json.dumps({"r": 2, "lora_alpha": 2, "target_modules": ["gate_proj"]}))
    with pytest.raises(ConfigError, match=r"mlp\.experts\.3\.gate_proj.*LoRA on experts and routers is not supported"
                                          r".*q_proj, k_proj, v_proj, o_proj"):
        LLM(model=str(folder), device="cpu", dtype="float32", num_kv_blocks=8, max_model_len=64,
            lora_modules=(f"experts={adapter}",))
