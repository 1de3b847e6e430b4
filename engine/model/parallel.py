"""Tensor parallelism in the model: which slice of each weight a rank holds, and the three layers
that talk to the other ranks (engine/distributed/group.py's collectives).

Megatron's split, as vLLM does it:
- q/k/v and gate/up are column-parallel: rank r holds its heads' rows (its share of the MLP), so
  attention and the gated activation run on local heads with no communication;
- o and down are row-parallel: rank r holds the matching input columns, and one all-reduce sums
  the partial outputs (RowParallel); a bias is added once, after the sum;
- KV heads are sharded with the query heads; with fewer KV heads than ranks each KV head is
  replicated on size / kv_heads ranks (every rank still holds exactly one);
- the embedding and the LM head are vocab-parallel: rank r holds rows [r * V/N, (r + 1) * V/N);
  an id outside them embeds to zero and one all-reduce completes the lookup; each rank's logits
  are gathered once, on every rank, for the sampler on rank 0 (VocabParallelHead).

The decoder itself is unchanged: it runs on a ModelConfig with the rank's own head and MLP
counts, and the two row-parallel layers are callables that `layers.linear` calls like a
quantized weight. Embedding goes through a subclass made per model class (tp_model_class), so
a family's own `embed` (Gemma's sqrt(hidden) scale) still applies.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from iterserve.engine.model.loader import ModelConfig


class ParallelConfigError(ValueError):
    """A tensor-parallel size this model cannot be split into."""


@dataclass(frozen=True)
class Shard:
    rank: int
    size: int


def check_divides(config: ModelConfig, size: int) -> None:
    """Refuse, naming both numbers, a size that does not split the heads (and KV heads) evenly."""
    if size == 1:
        return
    if config.num_heads % size:
        raise ParallelConfigError(
            f"--tensor-parallel-size {size} does not divide the model's {config.num_heads} attention heads; "
            f"use a divisor of {config.num_heads}")
    kv = config.num_kv_heads
    if (kv >= size and kv % size) or (kv < size and size % kv):
        raise ParallelConfigError(
            f"--tensor-parallel-size {size} and the model's {kv} KV heads: one must divide the other "
            f"(KV heads are sharded, or replicated when fewer than the ranks)")
    if config.intermediate_size % size:
        raise ParallelConfigError(
            f"--tensor-parallel-size {size} does not divide the model's MLP width {config.intermediate_size}")
    if config.moe is not None:
        raise ParallelConfigError(f"--tensor-parallel-size {size}: mixture-of-experts models ({config.architecture}) "
                                  "are not sharded yet; use --tensor-parallel-size 1")


def local_config(config: ModelConfig, shard: Shard) -> ModelConfig:
    """The config rank `shard.rank` computes with: its own heads, KV heads and MLP width."""
    check_divides(config, shard.size)
    return replace(config, num_heads=config.num_heads // shard.size,
                   num_kv_heads=max(1, config.num_kv_heads // shard.size),
                   intermediate_size=config.intermediate_size // shard.size)


def vocab_range(vocab: int, shard: Shard) -> tuple[int, int]:
    """Rank r's rows of the embedding and LM head: equal parts of ceil(V / N) rows (the last may be short)."""
    part = -(-vocab // shard.size)
    return min(vocab, shard.rank * part), min(vocab, (shard.rank + 1) * part)


def shard_rows(config: ModelConfig, shard: Shard) -> tuple[slice, slice, slice]:
    """Rank r's output rows of q, of k and v (the same rows), and of gate and up (each): the
    column-parallel slices, also o's and down's input columns (engine/lora shards adapters by them)."""
    n, r, d = shard.size, shard.rank, config.head_dim
    heads, kv = config.num_heads, config.num_kv_heads
    q_rows = slice(r * heads // n * d, (r + 1) * heads // n * d)
    kv_head = r * kv // n if kv < n else None  # the one replicated KV head of this rank
    kv_rows = slice(kv_head * d, (kv_head + 1) * d) if kv_head is not None else slice(r * kv // n * d,
                                                                                   (r + 1) * kv // n * d)
    width = config.intermediate_size // n
    return q_rows, kv_rows, slice(r * width, (r + 1) * width)


def shard_weights(weights: dict[str, torch.Tensor], config: ModelConfig, shard: Shard) -> None:
    """In place: every tensor becomes this rank's slice (HF names, [out, in] layouts)."""
    if shard.size == 1:
        return
    q_rows, kv_rows, mlp_rows = shard_rows(config, shard)
    start, end = vocab_range(config.vocab_size, shard)
    for name in list(weights):
        w = weights[name]
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            weights[name] = w[start:end]
            continue
        if ".self_attn.q_proj." in name:
            weights[name] = w[q_rows]
        elif ".self_attn.k_proj." in name or ".self_attn.v_proj." in name:
            weights[name] = w[kv_rows]
        elif name.endswith("self_attn.o_proj.weight"):
            weights[name] = w[:, q_rows]
        elif ".mlp.gate_proj." in name or ".mlp.up_proj." in name:
            weights[name] = w[mlp_rows]
        elif name.endswith("mlp.down_proj.weight"):
            weights[name] = w[:, mlp_rows]
        else:
            continue
        weights[name] = weights[name].contiguous()


class RowParallel:
    """A row-parallel linear: the local partial product, then one all-reduce (sum) over the ranks.
    Called by layers.linear like a quantized weight; the bias, full, is added by linear after."""

    def __init__(self, weight: torch.Tensor, group):
        self.weight = weight
        self.group = group
        self.shape = weight.shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        from iterserve.engine.model.layers import linear

        return self.group.all_reduce(linear(x, self.weight))


class VocabParallelHead:
    """The LM head's vocabulary rows of this rank; the logits of every rank gathered (once per call)
    and joined into [N, vocab]."""

    def __init__(self, weight: torch.Tensor, vocab: int, group):
        self.vocab = vocab
        self.group = group
        self.part = -(-vocab // group.size)
        if weight.shape[0] < self.part:  # the last rank's short part, padded so every rank sends as much
            weight = torch.cat([weight, weight.new_zeros(self.part - weight.shape[0], weight.shape[1])])
        self.weight = weight
        self.shape = (vocab, weight.shape[1])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        from iterserve.engine.model.layers import linear

        return self.group.all_gather(linear(x, self.weight).contiguous())[:, : self.vocab]


_TP_CLASSES: dict[type, type] = {}


def tp_model_class(model_class: type) -> type:
    """model_class with a vocab-parallel embedding: ids outside this rank's rows embed to zero (through
    the family's own embed, so its scaling applies) and one all-reduce sums the ranks."""
    if model_class not in _TP_CLASSES:
        def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
            start, end = self.vocab_rows
            inside = (input_ids >= start) & (input_ids < end)
            local = model_class.embed(self, torch.where(inside, input_ids - start, 0))
            return self.tp_group.all_reduce(local * inside.unsqueeze(-1).to(local.dtype))

        _TP_CLASSES[model_class] = type(f"TensorParallel{model_class.__name__}", (model_class,), {"embed": embed})
    return _TP_CLASSES[model_class]


def parallelize(model, full: ModelConfig, group) -> None:
    """In place, after from_weights on the sharded weights: row-parallel o/down, the vocab-parallel
    LM head and embedding. An o/down bias stays whole on every rank: linear adds it to the summed
    output, so it counts once."""
    for layer in model.layers:
        layer.o_proj = RowParallel(layer.o_proj, group)
        layer.down_proj = RowParallel(layer.down_proj, group)
    model.lm_head = VocabParallelHead(model.lm_head, full.vocab_size, group)
    model.vocab_rows = vocab_range(full.vocab_size, Shard(group.rank, group.size))
    model.tp_group = group
    model.fused = False  # cpu_fused's kernels read the dense weights themselves
    model.__class__ = tp_model_class(type(model))


# -- pipeline parallelism: each stage holds a contiguous run of the layers ----------------------


def stage_layers(num_layers: int, stage: int, stages: int) -> range:
    """The layers of `stage` (of `stages`): equal runs, the first stages one longer when they do not divide."""
    if stages > num_layers:
        raise ParallelConfigError(f"--pipeline-parallel-size {stages} exceeds the model's {num_layers} layers; "
                                  f"use at most {num_layers}")
    base, extra = divmod(num_layers, stages)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (stage < extra))


def stage_config(config: ModelConfig, layers: range) -> ModelConfig:
    """The config a stage builds its model with: its own layers, numbered from 0."""
    if config.moe is not None:
        raise ParallelConfigError(f"--pipeline-parallel-size: mixture-of-experts models ({config.architecture}) are not "
                                  "split into stages yet; use --pipeline-parallel-size 1")
    types = config.layer_types[layers.start : layers.stop] if config.layer_types is not None else None
    return replace(config, num_layers=len(layers), layer_types=types)


def stage_weights(weights: dict[str, torch.Tensor], layers: range) -> None:
    """In place: keep this stage's layers, renumbered from 0 (embedding, final norm and LM head stay:
    the first stage embeds, the last computes the logits)."""
    kept = {}
    # Renamed into a dict of their own: in place, a later stage's layer 17 (renamed 2) would be taken
    # for the model's layer 2 and dropped.
    for name in [name for name in weights if name.startswith("model.layers.")]:
        tensor = weights.pop(name)
        index, rest = name.removeprefix("model.layers.").split(".", 1)
        if int(index) in layers:
            kept[f"model.layers.{int(index) - layers.start}.{rest}"] = tensor
    weights.update(kept)


def stage_forward(model, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches, meta,
                  carry: tuple[torch.Tensor, torch.Tensor] | None, last: bool):
    """DecoderModel.forward over one stage's layers: from the embedding (carry None) or the previous
    stage's (hidden, residual); returns the final hidden states on the last stage, else (hidden, residual)."""
    backend = model.backend
    hidden, residual = (model.embed(input_ids), None) if carry is None else carry
    for layer, (k_cache, v_cache) in zip(model.layers, kv_caches, strict=True):
        q, k, v, residual = model.attention_input(hidden, residual, layer, positions)
        backend.write_kv(k, v, k_cache, v_cache, meta)
        attn = backend.attend(q, k_cache, v_cache, meta, model.scale, layer.attention)
        hidden, residual = model.mlp(attn, residual, layer)
    return model.final_norm(hidden, residual) if last else (hidden, residual)
