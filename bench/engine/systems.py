"""The systems under test, each behind one function: run this workload, return what it produced.

iterserve runs through its engine (one ModelRunner, so one copy of the weights, shared by the
continuous and static engines, run one after the other). HuggingFace runs the same weights: its
Llama code is built from the runner's tensors (q/k/v and gate/up split back apart), so every
system computes with the same model, dtype and threads.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from bench.common import Request
from iterserve.engine.config import EngineConfig
from iterserve.engine.llm_engine import LLMEngine
from iterserve.engine.model_runner import ModelRunner
from iterserve.engine.sampling_params import SamplingParams


@dataclass
class RunResult:
    seconds: float
    outputs: list[list[int]]  # generated token ids per request, in workload order
    generated_tokens: int  # including any a system computed and threw away (padding to the batch's longest)
    steps: int = 0


def load_runner(**engine_options) -> ModelRunner:
    config = EngineConfig(device="cpu", dtype="float32", attention_backend="torch", **engine_options)
    return ModelRunner(config, show_progress=False)


def iterserve_engine(runner: ModelRunner, **overrides) -> LLMEngine:
    overrides.setdefault("long_prefill_token_threshold", None)  # re-derived from the budget below
    config = dataclasses.replace(runner.config, **overrides).resolve()
    return LLMEngine(config, runner, runner.tokenizer)


def params_for(request: Request) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=request.output_len, ignore_eos=True)


def run_iterserve(engine: LLMEngine, workload: list[Request],
                  on_step: Callable[[LLMEngine], None] | None = None) -> RunResult:
    """All requests arrive at once (offline); the engine steps until every one has finished."""
    steps_before = engine.num_steps
    started = time.perf_counter()
    ids = [engine.add_request(None, params_for(r), r.prompt_token_ids) for r in workload]
    finished = {}
    while len(finished) < len(ids):
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output.outputs[0].token_ids
        if on_step is not None:
            on_step(engine)
    seconds = time.perf_counter() - started
    outputs = [finished[i] for i in ids]
    return RunResult(seconds, outputs, sum(map(len, outputs)), engine.num_steps - steps_before)


def hf_model(runner: ModelRunner):
    """transformers' LlamaForCausalLM holding the runner's weights (same values, same dtype)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    model = runner.model
    cfg = model.config
    hf_config = LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, rope_theta=cfg.rope_theta,
        rms_norm_eps=cfg.rms_norm_eps, max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings, bos_token_id=runner.tokenizer.bos_token_id,
        eos_token_id=runner.tokenizer.eos_token_id, pad_token_id=0,
    )
    weights = {"model.embed_tokens.weight": model.embed_tokens, "model.norm.weight": model.norm,
               "lm_head.weight": model.lm_head}
    for i, layer in enumerate(model.layers):
        prefix = f"model.layers.{i}."
        q, k, v = layer.qkv_proj.split([model.q_size, model.kv_size, model.kv_size], dim=0)
        gate, up = layer.gate_up_proj.chunk(2, dim=0)
        weights.update({
            prefix + "input_layernorm.weight": layer.input_norm,
            prefix + "self_attn.q_proj.weight": q, prefix + "self_attn.k_proj.weight": k,
            prefix + "self_attn.v_proj.weight": v, prefix + "self_attn.o_proj.weight": layer.o_proj,
            prefix + "post_attention_layernorm.weight": layer.post_attention_norm,
            prefix + "mlp.gate_proj.weight": gate, prefix + "mlp.up_proj.weight": up,
            prefix + "mlp.down_proj.weight": layer.down_proj,
        })
    with torch.device("meta"):
        hf = LlamaForCausalLM(hf_config)
    hf.load_state_dict(weights, strict=True, assign=True)
    if cfg.tie_word_embeddings:
        hf.tie_weights()
    hf.model.rotary_emb = type(hf.model.rotary_emb)(hf_config)  # rebuilt off the meta device
    return hf.to(model.dtype).eval()


def run_hf_generate_static(hf, workload: list[Request], batch_size: int) -> RunResult:
    """`generate` over padded static batches in arrival order: each batch runs until its longest
    request is done; the shorter ones' extra tokens are computed and thrown away."""
    from transformers import GenerationConfig

    started = time.perf_counter()
    outputs, generated = [], 0
    for first in range(0, len(workload), batch_size):
        batch = workload[first:first + batch_size]
        width = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, r in enumerate(batch):  # left padding, as decoder-only generation needs
            ids[row, width - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids)
            mask[row, width - len(r.prompt_token_ids):] = 1
        longest = max(r.output_len for r in batch)
        config = GenerationConfig(do_sample=False, max_new_tokens=longest, min_new_tokens=0,
                                  eos_token_id=None, pad_token_id=0)
        with torch.inference_mode():
            out = hf.generate(ids, attention_mask=mask, generation_config=config)
        new = out[:, width:]
        generated += new.numel()
        outputs += [new[row, :r.output_len].tolist() for row, r in enumerate(batch)]
    return RunResult(time.perf_counter() - started, outputs, generated)


def run_hf_generate_batch(hf, workload: list[Request], max_batch_size: int, max_batch_tokens: int,
                          num_blocks: int, block_size: int) -> RunResult:
    """transformers' continuous batching (the manager `generate_batch` wraps), with the same caps
    as iterserve: running requests, tokens per step, KV blocks. `generate_batch` itself takes one
    max_new_tokens for all requests; its manager takes one per request, which this workload needs."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    config = GenerationConfig(do_sample=False, max_new_tokens=max(r.output_len for r in workload),
                              eos_token_id=-1, pad_token_id=0)
    cb_config = ContinuousBatchingConfig(max_requests_per_batch=max_batch_size, max_batch_tokens=max_batch_tokens,
                                         num_blocks=num_blocks, page_size=block_size, allow_block_sharing=False)
    with hf.continuous_batching_context_manager(generation_config=config, continuous_batching_config=cb_config,
                                                block=True, timeout=30) as manager:
        started = time.perf_counter()
        ids = [manager.add_request(r.prompt_token_ids, max_new_tokens=r.output_len, eos_token_id=-1)
               for r in workload]
        results = {}
        while len(results) < len(ids):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                results[result.request_id] = result
            elif result is None and not manager.is_running():
                raise RuntimeError("transformers' continuous batching loop stopped before finishing")
        seconds = time.perf_counter() - started
    outputs = [list(results[i].generated_tokens) for i in ids]
    return RunResult(seconds, outputs, sum(map(len, outputs)))
