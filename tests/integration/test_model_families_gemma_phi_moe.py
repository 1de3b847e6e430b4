"""Gemma 2, Gemma 3, Phi-3 and Qwen3-MoE against transformers, on the tiny random models of
tests/tiny_families.py (transformers' own classes, saved with save_pretrained and written as GGUF
under llama.cpp's names and keys), with the embedded SmolLM2's tokenizer.

- logits: a mixed flat batch of prefill chunks and decodes at positions past the sliding window
  (12) and, for Phi-3, past LongRoPE's original length (40), from the safetensors directory and
  from the GGUF, through the torch backend and (safetensors) the Triton backend under the
  interpreter; the reference is transformers fed the same chunks with its KV cache, which is also
  where Phi-3's long/short factor switch is defined (fp32, 1e-4 of the logit scale);
- greedy: 32 tokens per prompt through the engine with chunked prefill (16-token steps), a KV
  pool small enough to preempt and prefix caching on (two prompts share a 40-token prefix), equal
  to transformers' generate, from the directory and from the GGUF. Phi-3 runs here with an original
  length beyond every sequence: transformers' generate drops its cache and recomputes the whole
  sequence with the long factors when a sequence crosses it (Phi3ForCausalLM's
  prepare_inputs_for_generation), which the engine does not do (docs/models.md).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from iterserve.engine import LLM, SamplingParams  # noqa: E402
from iterserve.engine.attention.backend import AttentionMetadata, get_backend  # noqa: E402
from iterserve.engine.model.architectures import model_class  # noqa: E402
from iterserve.engine.model.loader import load_model  # noqa: E402
from iterserve.engine.model.tokenizer import Tokenizer  # noqa: E402
from tests import tiny_families as tiny  # noqa: E402

NAMES = sorted(tiny.FAMILIES)
NEW_TOKENS = 32
BLOCK = 16
MAX_POSITIONS = 256
PREEMPTION = {"gemma2": "recompute", "gemma3": "swap", "phi3": "swap", "qwen3_moe": "recompute"}


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
def models(tmp_path_factory, one_thread):
    """name -> (transformers model, safetensors directory, GGUF file)."""
    root = tmp_path_factory.mktemp("families-b")
    built = {}
    for name in NAMES:
        model = tiny.hf_model(name)
        built[name] = (model, tiny.save_hf(model, root / name), tiny.write_gguf(name, model, root / f"{name}.gguf"))
    return built


@pytest.fixture(scope="module")
def story(tokenizer):
    return tokenizer.encode(
        "Once upon a time, in a small village at the edge of a great forest, there lived an old clockmaker "
        "who had never once left the valley. Every morning he opened his shop, wound the hundred clocks on "
        "its walls, and waited for customers who rarely came. One winter day, a stranger knocked.")


# -- logits of a mixed batch -----------------------------------------------------------------------

# Per step, (sequence, tokens it brings): chunks of A cross the window and (at 44) Phi-3's original
# length; B's prompt, then decodes of both past the window.
STEPS = [[(0, 24)], [(0, 20), (1, 9)], [(0, 8), (1, 1), (2, 30)], [(0, 1), (1, 1), (2, 1)], [(0, 1), (2, 1)]]


LENGTHS = [sum(n for step in STEPS for i, n in step if i == seq) for seq in range(3)]


def batch_sequences(story: list[int]) -> list[list[int]]:
    return [story[:LENGTHS[0]], story[7:7 + LENGTHS[1]], story[3:3 + LENGTHS[2]]]


def engine_logits(path: Path, backend_name: str, sequences: list[list[int]]) -> list[torch.Tensor]:
    loaded = load_model(path, show_progress=False)
    config = loaded.config
    model = model_class(config).from_weights(config, loaded.weights, get_backend(backend_name), torch.device("cpu"),
                                             torch.float32, max_positions=MAX_POSITIONS)
    num_blocks = sum(-(-len(s) // BLOCK) for s in sequences) + 2
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(3)).tolist()
    shape = (num_blocks, BLOCK, config.num_kv_heads, config.head_dim)
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(config.num_layers)]
    tables: list[list[int]] = [[] for _ in sequences]
    done = [0] * len(sequences)
    rows: list[list[torch.Tensor]] = [[] for _ in sequences]
    with torch.inference_mode():
        for step in STEPS:
            ids, positions, query_lens, seq_lens, step_tables = [], [], [], [], []
            for i, n in step:
                while len(tables[i]) * BLOCK < done[i] + n:
                    tables[i].append(order.pop())
                ids += sequences[i][done[i]:done[i] + n]
                positions += range(done[i], done[i] + n)
                query_lens.append(n)
                seq_lens.append(done[i] + n)
                step_tables.append(tables[i])
                done[i] += n
            meta = AttentionMetadata.build(query_lens, seq_lens, step_tables, BLOCK)
            logits = model.compute_logits(model(torch.tensor(ids), torch.tensor(positions), caches, meta))
            start = 0
            for (i, _), n in zip(step, query_lens, strict=True):
                rows[i].append(logits[start:start + n])
                start += n
    return [torch.cat(r) for r in rows]


def reference_logits(model, sequences: list[list[int]]) -> list[torch.Tensor]:
    """transformers fed the same chunks, each sequence with its own KV cache."""
    from transformers import DynamicCache

    caches = [DynamicCache(config=model.config) for _ in sequences]
    done = [0] * len(sequences)
    rows: list[list[torch.Tensor]] = [[] for _ in sequences]
    with torch.inference_mode():
        for step in STEPS:
            for i, n in step:
                chunk = sequences[i][done[i]:done[i] + n]
                out = model(torch.tensor([chunk]), past_key_values=caches[i], use_cache=True,
                            position_ids=torch.arange(done[i], done[i] + n)[None])
                rows[i].append(out.logits[0])
                done[i] += n
    return [torch.cat(r) for r in rows]


@pytest.mark.parametrize(("source", "backend_name"), [("hf", "torch"), ("gguf", "torch"), ("hf", "triton")])
@pytest.mark.parametrize("name", NAMES)
def test_mixed_batch_logits_equal_transformers(name, source, backend_name, models, story, one_thread):
    if backend_name == "triton":
        from iterserve.engine.attention.triton_backend import interpreter_enabled

        if not interpreter_enabled():  # only when another module imported triton first
            pytest.skip("triton was imported before TRITON_INTERPRET=1")
    model, directory, gguf_file = models[name]
    sequences = batch_sequences(story)
    got = engine_logits(directory if source == "hf" else gguf_file, backend_name, sequences)
    for seq, mine, want in zip(sequences, got, reference_logits(model, sequences), strict=True):
        scale = want.abs().max().item()
        error = (mine - want).abs().max().item()
        assert error <= 1e-4 * scale, f"{name}/{source}/{backend_name}: max error {error:.3g} at scale {scale:.3g}"
        assert len(seq) == mine.shape[0]


@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_phi3_partial_rotary_equals_transformers(source, story, tmp_path, one_thread):
    """Phi-4-mini's layout: only the first head_dim * partial_rotary_factor dims of a head rotate."""
    model = tiny.hf_model("phi3", partial_rotary_factor=0.5)
    path = tiny.save_hf(model, tmp_path / "hf") if source == "hf" else tiny.write_gguf("phi3", model, tmp_path / "p.gguf")
    sequences = batch_sequences(story)
    for mine, want in zip(engine_logits(path, "torch", sequences), reference_logits(model, sequences), strict=True):
        assert (mine - want).abs().max() <= 1e-4 * want.abs().max()


def test_qwen3_moe_dense_layers_where_mlp_only_layers_says_equal_transformers(story, tmp_path, one_thread):
    model = tiny.hf_model("qwen3_moe", mlp_only_layers=[1])
    assert not hasattr(model.model.layers[1].mlp, "experts")
    sequences = batch_sequences(story)
    got = engine_logits(tiny.save_hf(model, tmp_path / "hf"), "torch", sequences)
    for mine, want in zip(got, reference_logits(model, sequences), strict=True):
        assert (mine - want).abs().max() <= 1e-4 * want.abs().max()


def test_phi3_sequences_past_the_original_length_read_the_long_factors(models, story, one_thread):
    """The switch matters: the same chunks with the short factors only are far from transformers."""
    model, directory, _ = models["phi3"]
    sequences = batch_sequences(story)
    lengths = [len(s) for s in sequences]
    want = reference_logits(model, sequences)[0]
    loaded = load_model(directory, show_progress=False)
    loaded.config.rope_scaling["long_factor"] = loaded.config.rope_scaling["short_factor"]
    short_only = model_class(loaded.config).from_weights(loaded.config, loaded.weights, get_backend("torch"),
                                                         torch.device("cpu"), torch.float32, MAX_POSITIONS)
    assert short_only.long_rope is not None
    meta = AttentionMetadata.build([lengths[0]], [lengths[0]], [list(range(4))], BLOCK)
    shape = (4, BLOCK, loaded.config.num_kv_heads, loaded.config.head_dim)
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(loaded.config.num_layers)]
    with torch.inference_mode():
        got = short_only.compute_logits(short_only(torch.tensor(sequences[0]), torch.arange(lengths[0]), caches, meta))
    assert (got[24:] - want[24:]).abs().max() > 1e-2 * want.abs().max()  # past 40: long in transformers


# -- greedy through the engine ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def prompts(tokenizer, story):
    """Two share a 40-token prefix (prefix caching); lengths 6..75."""
    chat = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+2?"}]))
    return [story[:75], story[:40] + tokenizer.encode(" a stranger knocked"), tokenizer.encode("The capital of France is"),
            chat]


@pytest.fixture(scope="module")
def engine_models(models, tmp_path_factory, one_thread):
    """The models of the engine test: Phi-3's with LongRoPE's original length past max_model_len."""
    root = tmp_path_factory.mktemp("families-b-engine")
    model = tiny.hf_model("phi3", original_max_position_embeddings=160)
    return models | {"phi3": (model, tiny.save_hf(model, root / "phi3"), tiny.write_gguf("phi3", model, root / "p.gguf"))}


@pytest.fixture(scope="module")
def hf_tokens(engine_models, prompts, tokenizer, one_thread):
    eos = tokenizer.eos_token_id
    out = {}
    with torch.inference_mode():
        for name in NAMES:
            model = engine_models[name][0]
            out[name] = []
            for prompt in prompts:
                ids = torch.tensor([prompt])
                tokens = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                        max_new_tokens=NEW_TOKENS, pad_token_id=eos, eos_token_id=eos)
                out[name].append(_strip(tokens[0, ids.shape[1]:].tolist(), eos))
    return out


def _strip(tokens: list[int], eos: int) -> list[int]:
    return tokens[:tokens.index(eos)] if eos in tokens else tokens


@pytest.mark.slow
@pytest.mark.parametrize("source", ["hf", "gguf"])
@pytest.mark.parametrize("name", NAMES)
def test_greedy_tokens_equal_transformers_through_the_engine(name, source, engine_models, prompts, hf_tokens,
                                                            tokenizer, one_thread):
    _, directory, gguf_file = engine_models[name]
    # 10 blocks x 16 = 160 tokens of KV for four sequences of up to 107 tokens: preemption.
    llm = LLM(model=str(directory if source == "hf" else gguf_file), num_kv_blocks=10, num_cpu_blocks=32,
              max_model_len=144, max_num_seqs=4, max_num_batched_tokens=16, preemption_mode=PREEMPTION[name],
              enable_prefix_caching=True, device="cpu", attention_backend="torch", dtype="float32")
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS), use_tqdm=False)
    got = [_strip(list(o.outputs[0].token_ids), tokenizer.eos_token_id) for o in outputs]
    for prompt, mine, theirs in zip(prompts, got, hf_tokens[name], strict=True):
        assert mine == theirs, f"{name}/{source}: prompt of {len(prompt)} tokens"
    assert sum(len(t) for t in got) > 2 * NEW_TOKENS  # the random model does not stop at once
    assert len({t for tokens in got for t in tokens}) > 16  # nor repeat one token
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.block_manager.prefix_cache is not None
    assert llm.engine.block_manager.usage() == 0.0


def test_gemma3_multimodal_checkpoint_serves_its_language_model(models, story, tmp_path, one_thread):
    """Gemma3ForConditionalGeneration's layout (4B and up): the text config under text_config with
    only what differs from Gemma3TextConfig's defaults, the language model's tensors under
    language_model.model., a vision tower beside them. Same logits as the text-only checkpoint."""
    import json

    from safetensors.torch import load_file, save_file

    _, directory, _ = models["gemma3"]
    text = json.loads((directory / "config.json").read_text())
    defaults = {k: v for k, v in text.items() if k in ("vocab_size", "rms_norm_eps")}  # as the defaults would give
    kept = {k: v for k, v in text.items() if k not in defaults and k not in ("architectures", "dtype")}
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
        "text_config": kept | {"vocab_size": text["vocab_size"], "rms_norm_eps": text["rms_norm_eps"]},
        "vision_config": {"model_type": "siglip_vision_model"}}))
    tensors = {"language_model." + k: v for k, v in load_file(directory / "model.safetensors").items()}
    tensors["vision_tower.vision_model.post_layernorm.weight"] = torch.ones(8)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((directory / name).read_bytes())
    sequences = batch_sequences(story)
    want = engine_logits(directory, "torch", sequences)
    got = engine_logits(tmp_path, "torch", sequences)
    assert load_model(tmp_path, show_progress=False).config.architecture == "gemma3"
    for mine, theirs in zip(got, want, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)


def test_a_qwen3_moe_checkpoint_whose_experts_disagree_with_its_config_is_refused_naming_the_tensor(models, tmp_path):
    import json

    from iterserve.engine.model.loader import ModelLoadError

    _, directory, _ = models["qwen3_moe"]
    for file in directory.iterdir():
        (tmp_path / file.name).symlink_to(file)
    config = json.loads((directory / "config.json").read_text())
    (tmp_path / "config.json").unlink()
    (tmp_path / "config.json").write_text(json.dumps(config | {"moe_intermediate_size": 40}))
    loaded = load_model(tmp_path, show_progress=False)
    with pytest.raises(ModelLoadError, match=r"model.layers.0.mlp.experts.gate_up_proj is \(8, 96, 64\); "
                                             r"num_experts, hidden_size and moe_intermediate_size give \(8, 80, 64\)"):
        model_class(loaded.config).from_weights(loaded.config, loaded.weights, get_backend("torch"),
                                                torch.device("cpu"), torch.float32, MAX_POSITIONS)
