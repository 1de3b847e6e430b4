"""Every registered model family against transformers, on small random models transformers itself
builds (its config classes, 2 layers, hidden 64, GQA, a fixed seed), saved with save_pretrained
as safetensors (one row sharded with an index, one stored in bf16) and written as GGUF under
llama.cpp's tensor names and metadata keys. The embedded SmolLM2's tokenizer makes the prompts
real text.

- logits: a mixed flat batch of prefill chunks (starting mid-sequence) and decodes at positions
  past the sliding window and past rope scaling's original length, through the torch backend and
  the Triton backend (interpreter), equal to transformers' forward (fp32, 1e-4 relative);
- greedy: 32 tokens per prompt through the engine with chunked prefill (16-token steps), a KV pool
  small enough to preempt (recompute or swap) and prefix caching on (two prompts share a prefix),
  equal to transformers' generate; the same from the GGUF.

A family is one row of FAMILIES: (transformers config class, its kwargs, GGUF arch, options).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import json  # noqa: E402
import math  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from iterserve.engine import LLM, SamplingParams  # noqa: E402
from iterserve.engine.attention.backend import AttentionMetadata, get_backend  # noqa: E402
from iterserve.engine.model.architectures import model_class  # noqa: E402
from iterserve.engine.model.loader import ModelLoadError, load_model, open_gguf, permute_rows  # noqa: E402
from iterserve.engine.model.registry import resolve_model_path  # noqa: E402
from iterserve.engine.model.tokenizer import Tokenizer  # noqa: E402

HIDDEN, HEADS, KV_HEADS, LAYERS, FFN, MAX_POSITIONS = 64, 4, 2, 2, 128, 256
NEW_TOKENS = 32
BLOCK = 16


@dataclass
class Family:
    config_class: str  # transformers config class name
    kwargs: dict
    gguf_arch: str | None = None  # llama.cpp's general.architecture; None: no GGUF row
    engine: bool = True  # also the greedy engine test (a row that only adds a rope variant checks logits)
    preemption: str = "recompute"
    save: dict = field(default_factory=dict)  # save_pretrained options / storage dtype


ROPE_LLAMA3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
FAMILIES = {
    # Llama 3.x: llama3 rope past its original 32 positions, q/k/v/o and MLP biases, head_dim given
    # apart from hidden / heads, tied embeddings; stored as shards with an index.
    "llama3": Family("LlamaConfig", dict(rope_parameters=ROPE_LLAMA3, attention_bias=True, mlp_bias=True,
                                         head_dim=32, tie_word_embeddings=True),
                     gguf_arch="llama", preemption="swap", save={"max_shard_size": "2MB"}),
    "llama-yarn": Family("LlamaConfig", dict(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0,
                                                              "factor": 4.0, "original_max_position_embeddings": 32})),
    "llama-linear": Family("LlamaConfig", dict(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0,
                                                                "factor": 2.0}), engine=False),
    # Qwen2.5 as it ships: q/k/v biases, untied lm_head, no window; bf16 on disk.
    "qwen2.5": Family("Qwen2Config", {}, gguf_arch="qwen2", preemption="swap", save={"dtype": torch.bfloat16}),
    # Qwen2 with its optional window on the layers from max_window_layers on (llama.cpp's qwen2 GGUF
    # records no window, so no GGUF row).
    "qwen2-window": Family("Qwen2Config", dict(use_sliding_window=True, sliding_window=20, max_window_layers=1)),
    "qwen3": Family("Qwen3Config", dict(head_dim=32), gguf_arch="qwen3"),
    # Mistral: every layer slides; a window that is not a multiple of the block size.
    "mistral": Family("MistralConfig", dict(sliding_window=12), gguf_arch="llama"),
}


@pytest.fixture(scope="module")
def one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer.from_gguf(resolve_model_path(None)[0])


@pytest.fixture(scope="module")
def prompts(tokenizer):
    """Token ids of real text: two share a 40-token prefix (prefix caching), lengths 9..75."""
    story = ("Once upon a time, in a small village at the edge of a great forest, there lived an old "
             "clockmaker who had never once left the valley. Every morning he opened his shop, wound the "
             "hundred clocks on its walls, and waited for customers who rarely came. One winter day,")
    base = tokenizer.encode(story)
    return [base[:75], base[:40] + tokenizer.encode(" a stranger knocked"), tokenizer.encode("The capital of France is"),
            tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+2?"}]))]


def _randomise(model, seed: int) -> None:
    """transformers starts biases at 0 and norms at 1: give them values, so a bias or norm the
    engine drops shows in the logits."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.copy_(0.2 * torch.randn(param.shape, generator=gen))
            elif "norm" in name:
                param.copy_(1.0 + 0.2 * torch.randn(param.shape, generator=gen))


def build(name: str, directory: Path, tokenizer: Tokenizer) -> Path:
    """The family's random model saved as transformers saves it, with the embedded tokenizer."""
    import transformers

    family = FAMILIES[name]
    kwargs = dict(vocab_size=tokenizer.vocab_size, hidden_size=HIDDEN, intermediate_size=FFN,
                  num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                  max_position_embeddings=MAX_POSITIONS, rms_norm_eps=1e-5, initializer_range=0.2,
                  tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
                  eos_token_id=tokenizer.eos_token_id) | family.kwargs
    config = getattr(transformers, family.config_class)(**kwargs)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomise(model, 1)
    save = dict(family.save)
    if "dtype" in save:
        model = model.to(save.pop("dtype"))
    model.save_pretrained(directory, **save)
    tokenizer.backend.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": tokenizer.token(tokenizer.eos_token_id), "bos_token": tokenizer.token(tokenizer.bos_token_id),
        "chat_template": tokenizer.chat_template}))
    return directory


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tokenizer, one_thread):
    root = tmp_path_factory.mktemp("families")
    return {name: build(name, root / name, tokenizer) for name in FAMILIES}


def reference(directory: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


# -- logits of a mixed batch -------------------------------------------------------------------

# Per sequence, the tokens each step brings: a first chunk, then decodes and later chunks; the
# steps mix them (step 0: three prefills; step 3: two decodes and a 30-token chunk at 10..40).
SCHEDULE = [[40, 25, 1, 1, 1, 12], [7, 1, 2, 30, 1, 1], [64, 1, 1, 1, 1, 1]]


def engine_logits(directory: Path, backend_name: str, sequences: list[list[int]]) -> list[torch.Tensor]:
    loaded = load_model(directory, show_progress=False)
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
        for step in range(len(SCHEDULE[0])):
            ids, positions, query_lens, seq_lens = [], [], [], []
            for i, seq in enumerate(sequences):
                n = SCHEDULE[i][step]
                while len(tables[i]) * BLOCK < done[i] + n:
                    tables[i].append(order.pop())
                ids += seq[done[i]:done[i] + n]
                positions += range(done[i], done[i] + n)
                query_lens.append(n)
                seq_lens.append(done[i] + n)
                done[i] += n
            meta = AttentionMetadata.build(query_lens, seq_lens, tables, BLOCK)
            hidden = model(torch.tensor(ids), torch.tensor(positions), caches, meta)
            logits = model.compute_logits(hidden)
            start = 0
            for i, n in enumerate(query_lens):
                rows[i].append(logits[start:start + n])
                start += n
    return [torch.cat(r) for r in rows]


@pytest.mark.parametrize("backend_name", ["torch", "triton"])
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_mixed_batch_logits_equal_transformers(name, backend_name, checkpoints, prompts, one_thread):
    if backend_name == "triton":
        from iterserve.engine.attention.triton_backend import interpreter_enabled

        if not interpreter_enabled():  # only when another module imported triton first
            pytest.skip("triton was imported before TRITON_INTERPRET=1")
    lengths = [sum(s) for s in SCHEDULE]
    story = prompts[0] * 3
    sequences = [story[:lengths[0]], story[5:5 + lengths[1]], story[11:11 + lengths[2]]]
    got = engine_logits(checkpoints[name], backend_name, sequences)
    model = reference(checkpoints[name])
    with torch.inference_mode():
        for seq, mine in zip(sequences, got, strict=True):
            want = model(torch.tensor([seq])).logits[0]
            scale = want.abs().max().item()
            error = (mine - want).abs().max().item()
            assert error <= 1e-4 * scale, f"{name}/{backend_name}: max error {error:.3g} at logit scale {scale:.3g}"


# -- greedy through the engine -----------------------------------------------------------------


def hf_greedy(directory: Path, prompts: list[list[int]], eos: int) -> list[list[int]]:
    model = reference(directory)
    out = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            tokens = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                    max_new_tokens=NEW_TOKENS, pad_token_id=eos, eos_token_id=eos)
            out.append(_strip(tokens[0, ids.shape[1]:].tolist(), eos))
    return out


def _strip(tokens: list[int], eos: int) -> list[int]:
    return tokens[:tokens.index(eos)] if eos in tokens else tokens


def engine_greedy(model_path: Path, prompts: list[list[int]], preemption: str, eos: int) -> tuple[list[list[int]], LLM]:
    # 10 blocks x 16 = 160 tokens of KV for four sequences of up to 107 tokens: preemption.
    llm = LLM(model=str(model_path), num_kv_blocks=10, num_cpu_blocks=32, max_model_len=144,
              max_num_seqs=4, max_num_batched_tokens=16, preemption_mode=preemption, enable_prefix_caching=True,
              device="cpu", attention_backend="torch", dtype="float32")
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS), use_tqdm=False)
    return [_strip(list(o.outputs[0].token_ids), eos) for o in outputs], llm


ENGINE_FAMILIES = sorted(n for n, f in FAMILIES.items() if f.engine)


@pytest.fixture(scope="module")
def hf_tokens(checkpoints, prompts, tokenizer, one_thread):
    return {name: hf_greedy(checkpoints[name], prompts, tokenizer.eos_token_id) for name in ENGINE_FAMILIES}


@pytest.mark.slow
@pytest.mark.parametrize("name", ENGINE_FAMILIES)
def test_greedy_tokens_equal_transformers_through_the_engine(name, checkpoints, prompts, hf_tokens, tokenizer,
                                                            one_thread):
    family = FAMILIES[name]
    got, llm = engine_greedy(checkpoints[name], prompts, family.preemption, tokenizer.eos_token_id)
    for prompt, mine, theirs in zip(prompts, got, hf_tokens[name], strict=True):
        assert mine == theirs, f"{name}: prompt of {len(prompt)} tokens"
    assert sum(len(t) for t in got) > 2 * NEW_TOKENS  # the random model does not stop at once
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.block_manager.prefix_cache.hits > 0  # prefixes were shared (the common one, or a resumed sequence's own)
    assert llm.engine.block_manager.usage() == 0.0


# -- GGUF under llama.cpp's names --------------------------------------------------------------

_GGUF_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def llama3_rope_factors(head_dim: int, rope: dict) -> np.ndarray:
    """convert_hf_to_gguf.py's rope_freqs for Llama 3 scaling."""
    inv_freq = 1.0 / (rope["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    old, factor = rope["original_max_position_embeddings"], rope["factor"]
    low_wavelen, high_wavelen = old / rope["low_freq_factor"], old / rope["high_freq_factor"]
    factors = []
    for freq in inv_freq:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (old / wavelen - rope["low_freq_factor"]) / (rope["high_freq_factor"] - rope["low_freq_factor"])
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def write_gguf(name: str, directory: Path, path: Path) -> Path:
    """The checkpoint as llama.cpp's convert writes it: F32 tensors under its names, q/k rows
    interleaved for the llama arch, the embedded model's tokenizer metadata."""
    import gguf
    from safetensors.torch import load_file

    family = FAMILIES[name]
    arch = family.gguf_arch
    raw = json.loads((directory / "config.json").read_text())
    weights = {}
    for file in directory.glob("*.safetensors"):
        weights |= {k: v.float().numpy() for k, v in load_file(file).items()}
    head_dim = raw.get("head_dim") or HIDDEN // HEADS
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(LAYERS)
    writer.add_context_length(MAX_POSITIONS)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    if raw.get("sliding_window") and raw.get("model_type") == "mistral":
        writer.add_sliding_window(raw["sliding_window"])
    source = open_gguf(resolve_model_path(None)[0])
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.chat_template"):
        writer.add_string(key, source.fields[key].contents())
    writer.add_token_list(source.fields["tokenizer.ggml.tokens"].contents())
    writer.add_token_types(source.fields["tokenizer.ggml.token_type"].contents())
    writer.add_token_merges(source.fields["tokenizer.ggml.merges"].contents())
    writer.add_bos_token_id(source.fields["tokenizer.ggml.bos_token_id"].contents())
    writer.add_eos_token_id(source.fields["tokenizer.ggml.eos_token_id"].contents())
    rope = raw.get("rope_parameters") or {}
    if rope.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_factors(head_dim, rope))
    globals_ = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}
    for hf_name, array in weights.items():
        if hf_name in globals_:
            writer.add_tensor(globals_[hf_name], array)
            continue
        _, _, layer, rest = hf_name.split(".", 3)
        module, kind = rest.rsplit(".", 1)
        if arch == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
            array = permute_rows(array, HEADS if module.endswith("q_proj") else KV_HEADS)
        writer.add_tensor(f"blk.{layer}.{_GGUF_NAMES[module]}.{kind}", np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


GGUF_FAMILIES = sorted(n for n, f in FAMILIES.items() if f.gguf_arch and f.engine)


@pytest.mark.slow
@pytest.mark.parametrize("name", GGUF_FAMILIES)
def test_gguf_under_llama_cpp_names_gives_the_same_greedy_tokens(name, checkpoints, prompts, hf_tokens, tokenizer,
                                                                tmp_path, one_thread):
    path = write_gguf(name, checkpoints[name], tmp_path / f"{name}.gguf")
    loaded = load_model(path, show_progress=False)
    assert loaded.config.architecture == FAMILIES[name].gguf_arch  # llama.cpp writes Mistral as llama
    assert loaded.config.sliding_window == json.loads((checkpoints[name] / "config.json").read_text()).get(
        "sliding_window") if name == "mistral" else True
    got, _ = engine_greedy(path, prompts, "recompute", tokenizer.eos_token_id)
    for prompt, mine, theirs in zip(prompts, got, hf_tokens[name], strict=True):
        assert mine == theirs, f"{name} GGUF: prompt of {len(prompt)} tokens"


# -- errors ------------------------------------------------------------------------------------


def test_unsupported_architecture_and_rope_type_are_one_line_errors(checkpoints, tmp_path):
    source = checkpoints["qwen3"]
    for change, match in [({"model_type": "gpt_neox", "architectures": ["GPTNeoXForCausalLM"]},
                           r"architecture 'GPTNeoXForCausalLM'.*supported: llama \(LlamaForCausalLM\).*qwen3"),
                          ({"rope_parameters": {"rope_type": "mrope", "rope_theta": 1e4}},
                           r"rope scaling type 'mrope' is not supported; supported: .*llama3.*yarn")]:
        target = tmp_path / next(iter(change))
        target.mkdir()
        for file in source.iterdir():
            (target / file.name).symlink_to(file)
        (target / "config.json").unlink()
        (target / "config.json").write_text(json.dumps(json.loads((source / "config.json").read_text()) | change))
        with pytest.raises(ModelLoadError, match=match) as info:
            load_model(target, show_progress=False)
        assert "\n" not in str(info.value)


# -- generation_config.json --------------------------------------------------------------------


def test_generation_config_eos_ids_and_sampling_defaults_are_honoured(checkpoints, prompts, hf_tokens, tokenizer,
                                                                      tmp_path, one_thread):
    from types import SimpleNamespace

    from iterserve.engine.server.protocol import CompletionRequest
    from iterserve.engine.server.request_params import sampling_params

    source = checkpoints["llama3"]
    target = tmp_path / "llama3-generation"
    target.mkdir()
    for file in source.iterdir():
        if file.name != "generation_config.json":
            (target / file.name).symlink_to(file)
    expected = hf_tokens["llama3"][0]
    stop_at = expected[3]  # a token the model emits 4th: listed as another eos id, it ends the output there
    eos = tokenizer.eos_token_id
    (target / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [eos, stop_at], "temperature": 0.0, "top_k": 5, "max_new_tokens": 20,
         "repetition_penalty": "bad"}))  # a malformed value is ignored, not fatal
    llm = LLM(model=str(target), max_model_len=144, device="cpu", attention_backend="torch", dtype="float32")
    defaults = llm.default_sampling_params()
    assert (defaults.temperature, defaults.top_k, defaults.max_tokens, defaults.repetition_penalty) == (0.0, 5, 20, 1.0)
    stopped = llm.generate([prompts[0]], use_tqdm=False)[0].outputs[0]  # the model's defaults: greedy
    assert list(stopped.token_ids) == expected[:expected.index(stop_at) + 1] and stopped.finish_reason == "stop"
    ignored = llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0]
    assert len(ignored.token_ids) == NEW_TOKENS and list(ignored.token_ids)[:len(expected)] == expected

    # The OpenAI server: what a request leaves out comes from the file; what it sets wins.
    engine = SimpleNamespace(engine=llm.engine)
    body = CompletionRequest(model="m", prompt="hi", top_p=0.5)
    params = sampling_params(body, None, 3, engine, "prompt", default_max_tokens=100)
    assert (params.temperature, params.top_k, params.top_p, params.max_tokens) == (0.0, 5, 0.5, 20)
    body = CompletionRequest(model="m", prompt="hi", temperature=0.7, top_k=-1)
    params = sampling_params(body, 7, 3, engine, "prompt", default_max_tokens=100)
    assert (params.temperature, params.top_k, params.max_tokens) == (0.7, -1, 7)


# -- prefill/decode KV transfer with a sliding window --------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mistral", "qwen2-window"])
def test_kv_pulled_from_a_prefill_engine_gives_the_local_greedy_tokens(name, checkpoints, prompts, one_thread):
    """Prompts longer than the window: the decode engine pulls the prefill engine's whole block
    table and continues with the window applied to it, as an engine that ran the prompt itself."""
    from iterserve.engine.config import EngineConfig
    from iterserve.engine.model_runner import ModelRunner
    from tests.integration.test_kv_transfer_real_model import engine_on, run
    from tests.kv_auth_helpers import remote_decode

    runner = ModelRunner(EngineConfig(model=str(checkpoints[name]), num_kv_blocks=40, max_model_len=144,
                                      device="cpu", dtype="float32", attention_backend="torch"), show_progress=False)
    greedy = SamplingParams(temperature=0, max_tokens=8)
    local, prefill, decode = engine_on(runner, "both"), engine_on(runner, "prefill"), engine_on(runner, "decode")
    prefill.start_kv_transfer()
    try:
        for i, ids in enumerate(prompts[:2]):
            local.add_request(prompt_token_ids=ids, params=greedy, request_id=f"ref-{i}")
        expected = {k.removeprefix("ref-"): out.outputs[0].token_ids for k, out in run(local).items()}
        for i, ids in enumerate(prompts[:2]):
            prefill.add_request(prompt_token_ids=ids, params=SamplingParams(temperature=0, max_tokens=1),
                                request_id=f"p-{i}", kv_transfer_params=remote_decode())
            params = run(prefill)[f"p-{i}"].kv_transfer_params
            decode.add_request(prompt_token_ids=ids, params=greedy, request_id=f"d-{i}",
                               kv_transfer_params={**params, "do_remote_prefill": True})
            out = run(decode)[f"d-{i}"]
            assert out.error is None and out.outputs[0].token_ids == expected[str(i)], f"{name}: prompt {i}"
        assert decode.stats().kv_pulls_ok == 2
    finally:
        for engine in (local, prefill, decode):
            engine.close()
