"""`--compile`: the decoder's dense work compiled by torch.compile (inductor's C++/OpenMP code on CPU).

A SmolLM2-sized decode step runs ~30 small torch ops per layer (norms, rotary, splits, SiLU, the
residual adds) around a few matmuls, each a separate dispatch from Python. Here the work between
two attentions (layer i's output projection, norm and MLP, then layer i+1's norm, q/k/v projection
and rotary) is one compiled graph, the same graph for every layer (the weights are its inputs), so
inductor fuses the elementwise ops into a few C++ loops and the matmuls stay MKL calls (or the
quantized linears' kernels: quant.py's linears trace like any torch code). The paged KV write and
attention stay eager, in the attention backend: they are the graphs' boundaries, so prefill chunks,
decodes and mixed batches all take this path. The token count is a dynamic dimension.

Compiled code is cached on disk (TORCHINDUCTOR_CACHE_DIR, default ~/.cache/iterserve/inductor), so
only the first start on a machine pays the full compile; `warm_up()` compiles at start-up for one
token, a few tokens and a full batch (so no request waits for a compile) and logs how long it took.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from iterserve.engine.attention.backend import AttentionMetadata
    from iterserve.engine.model.decoder import DecoderLayer
    from iterserve.engine.model.decoder import DecoderModel as LlamaModel

logger = logging.getLogger(__name__)

CACHE_DIR = Path.home() / ".cache" / "iterserve" / "inductor"
# Token counts compiled at start-up, one per shape class a step can fall in: 1 (a lone decode), a
# few decodes (the quantized kernels, up to quant.py's dense_above), 17..32 (dense linears still
# streaming the weight, llama.SMALL_ROWS) and more (prefill chunks, full batches).
WARM_UP_TOKENS = (1, 4, 24, 64)


def _first(model: LlamaModel, input_ids: torch.Tensor, layer: DecoderLayer, positions: torch.Tensor):
    return model.attention_input(model.embed(input_ids), None, layer, positions)


def _between(model: LlamaModel, attn: torch.Tensor, residual: torch.Tensor, layer: DecoderLayer,
             next_layer: DecoderLayer, positions: torch.Tensor):
    hidden, residual = model.mlp(attn, residual, layer)
    return model.attention_input(hidden, residual, next_layer, positions)


def _last(model: LlamaModel, attn: torch.Tensor, residual: torch.Tensor, layer: DecoderLayer):
    hidden, residual = model.mlp(attn, residual, layer)
    return model.final_norm(hidden, residual)


def _dynamic(*tensors: torch.Tensor) -> None:
    for t in tensors:
        torch._dynamo.maybe_mark_dynamic(t, 0)


class CompiledForward:
    """LlamaModel.forward with the dense work compiled; install with `compile_model(model)`."""

    def __init__(self, model: LlamaModel):
        if model.device.type != "cpu":
            raise ValueError("--compile compiles the CPU path (inductor's C++ code); on CUDA the Triton "
                             "attention backend already runs fused kernels: drop --compile")
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(CACHE_DIR))
        self.model = model
        # One graph per function and shape class (1 token, up to the quantized linears' dense_above,
        # more), per model in the process (the graphs are keyed by the functions below): raise the
        # recompile limit (8), past which dynamo would silently run a function eagerly.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        options = {"dynamic": None, "fullgraph": True}  # fullgraph: a graph break is an error, not a slow path
        self.first = torch.compile(_first, **options)
        self.between = torch.compile(_between, **options)
        self.last = torch.compile(_last, **options)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata) -> torch.Tensor:
        model, backend, layers = self.model, self.model.backend, self.model.layers
        _dynamic(input_ids, positions)
        q, k, v, residual = self.first(model, input_ids, layers[0], positions)
        for i, (k_cache, v_cache) in enumerate(kv_caches):
            backend.write_kv(k, v, k_cache, v_cache, meta)
            attn = backend.attend(q, k_cache, v_cache, meta, model.scale, layers[i].attention)
            _dynamic(attn, residual)
            if i + 1 == len(layers):
                return self.last(model, attn, residual, layers[i])
            q, k, v, residual = self.between(model, attn, residual, layers[i], layers[i + 1], positions)
        raise ValueError(f"got {len(kv_caches)} KV caches for {len(layers)} layers")

    @torch.inference_mode()
    def warm_up(self, token_counts: tuple[int, ...] = WARM_UP_TOKENS) -> float:
        """Compile (or load from the cache) every graph a step can need; returns the seconds taken."""
        model, layers = self.model, self.model.layers
        cfg = model.config
        start = time.perf_counter()
        for n in token_counts:
            ids = torch.zeros(n, dtype=torch.long, device=model.device)
            positions = torch.arange(n, device=model.device)
            attn = torch.zeros(n, cfg.num_heads, cfg.head_dim, dtype=model.dtype, device=model.device)
            residual = torch.zeros(n, cfg.hidden_size, dtype=model.dtype, device=model.device)
            _dynamic(ids, positions, attn, residual)
            self.first(model, ids, layers[0], positions)
            if len(layers) > 1:
                self.between(model, attn, residual, layers[0], layers[1], positions)
            self.last(model, attn, residual, layers[-1])
        elapsed = time.perf_counter() - start
        logger.info("--compile: decoder graphs ready in %.1f s for %s tokens (compiled code cached in %s)",
                    elapsed, "/".join(map(str, token_counts)), os.environ["TORCHINDUCTOR_CACHE_DIR"])
        return elapsed


def compile_model(model: LlamaModel, warm_up: bool = True) -> CompiledForward:
    """Make model.forward run the compiled path; compile its graphs now unless warm_up is False."""
    compiled = CompiledForward(model)
    model.compiled = compiled
    if warm_up:
        compiled.warm_up()
    return compiled
