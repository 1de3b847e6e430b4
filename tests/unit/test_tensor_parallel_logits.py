"""Tensor-parallel layers (engine/model/parallel.py) against one rank, in one process: each rank
is a thread with its own gloo group over 127.0.0.1, holding its slice of a small random Llama
(tests/tp_models.py). A mixed flat batch (a prompt chunk, a chunk starting mid-sequence, decodes)
through the sharded models gives the logits of the whole model within 1e-5 relative, in fp32:
KV heads split and replicated, biases counted once, a vocabulary not divisible by the ranks; and
two other families (tests/tiny_families.py): Gemma 2 (scaled embedding, four norms per layer,
sliding window, soft-caps) and Phi-3 (fused qkv and gate_up split at load, LongRoPE)."""

from __future__ import annotations

import threading

import pytest
import torch

from iterserve.engine.attention.backend import AttentionMetadata, get_backend
from iterserve.engine.distributed.group import Group
from iterserve.engine.model import parallel
from iterserve.engine.model.architectures import model_class
from iterserve.engine.model.loader import ModelConfig, load_model
from tests import tp_models

BLOCK = 16


FAMILIES = ("gemma2", "phi3")  # tests/tiny_families.py: Gemma's scaled embedding, norms and soft-caps; Phi-3's fused qkv


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from tests import tiny_families

    root = tmp_path_factory.mktemp("tp-models")
    paths = {name: tp_models.build(name, root / name) for name in tp_models.MODELS}
    for family in FAMILIES:
        (root / family).mkdir()
        paths[family] = tiny_families.save_hf(tiny_families.hf_model(family), root / family)
    return paths


def _batch(vocab: int):
    """Three sequences: a 20-token prompt, a 9-token chunk at 23..31 (its first 23 tokens already
    in the cache from a first pass), a decode at 40. Returns (first pass, second pass) batches."""
    gen = torch.Generator().manual_seed(3)
    tokens = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (20, 32, 41)]
    tables = [[0, 1], [2, 3], [4, 5, 6]]
    first_ids = tokens[1][:23] + tokens[2][:40]
    first = dict(ids=first_ids, positions=list(range(23)) + list(range(40)), query=[23, 40], seq=[23, 40],
                 tables=tables[1:])
    second = dict(ids=tokens[0] + tokens[1][23:] + tokens[2][40:],
                  positions=list(range(20)) + list(range(23, 32)) + [40], query=[20, 9, 1], seq=[20, 32, 41],
                  tables=tables)
    return first, second


def _run(model, caches, batch):
    meta = AttentionMetadata.build(batch["query"], batch["seq"], batch["tables"], BLOCK, torch.device("cpu"))
    hidden = model(torch.tensor(batch["ids"]), torch.tensor(batch["positions"]), caches, meta)
    return model.compute_logits(hidden)


def _model(path, shard: parallel.Shard | None, group=None):
    loaded = load_model(path, show_progress=False)
    config = loaded.config
    if shard is not None:
        parallel.shard_weights(loaded.weights, config, shard)
        config = parallel.local_config(config, shard)
    model = model_class(config).from_weights(config, loaded.weights, get_backend("torch", torch.device("cpu")),
                                             torch.device("cpu"), torch.float32, max_positions=256)
    if group is not None:
        parallel.parallelize(model, loaded.config, group)
    caches = [(torch.zeros(8, BLOCK, config.num_kv_heads, config.head_dim),
               torch.zeros(8, BLOCK, config.num_kv_heads, config.head_dim)) for _ in range(config.num_layers)]
    return model, caches, loaded.config


def _sharded_logits(path, size: int):
    results, errors = {}, []
    store_owner = Group(0, size, torch.device("cpu"), timeout_s=60)
    port = store_owner.open_store()

    def rank_main(rank: int):
        try:
            group = store_owner if rank == 0 else Group(rank, size, torch.device("cpu"), timeout_s=60)
            group.connect(port=port)
            model, caches, full = _model(path, parallel.Shard(rank, size), group)
            first, second = _batch(full.vocab_size)
            with torch.inference_mode():
                _run(model, caches, first)
                results[rank] = _run(model, caches, second)
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors, errors
    return results


@pytest.mark.slow  # building the models with transformers: ~30 s on a loaded CI machine
@pytest.mark.parametrize("name,size", [("h8kv4", 2), ("h8kv4", 4), ("h4kv1", 2), ("h4kv1", 4), ("gemma2", 2),
                                       ("phi3", 2)])
def test_sharded_logits_equal_one_rank(checkpoints, name, size):
    model, caches, full = _model(checkpoints[name], None)
    first, second = _batch(full.vocab_size)
    with torch.inference_mode():
        _run(model, caches, first)
        expected = _run(model, caches, second)
    results = _sharded_logits(checkpoints[name], size)
    assert expected.shape == (30, full.vocab_size)
    for rank in range(size):  # every rank holds the gathered logits
        got = results[rank]
        assert got.shape == expected.shape
        scale = expected.abs().max()
        assert ((got - expected).abs().max() / scale).item() < 1e-5, (name, size, rank)


def _config(heads: int, kv_heads: int, layers: int = 2) -> ModelConfig:
    return ModelConfig(vocab_size=100, hidden_size=64, intermediate_size=96, num_layers=layers, num_heads=heads,
                       num_kv_heads=kv_heads, head_dim=16, rope_theta=1e4, rms_norm_eps=1e-5,
                       max_position_embeddings=64, tie_word_embeddings=True)


def test_a_size_that_does_not_divide_the_heads_is_refused_naming_both():
    with pytest.raises(parallel.ParallelConfigError, match=r"--tensor-parallel-size 3 .* 8 attention heads"):
        parallel.local_config(_config(8, 4), parallel.Shard(0, 3))
    with pytest.raises(parallel.ParallelConfigError, match=r"--tensor-parallel-size 8 and the model's 3 KV heads"):
        parallel.check_divides(_config(24, 3), 8)
    with pytest.raises(parallel.ParallelConfigError, match=r"--pipeline-parallel-size 3 exceeds the model's 2 layers"):
        parallel.stage_layers(2, 0, 3)


def test_stages_split_the_layers_and_keep_their_order():
    assert [list(parallel.stage_layers(7, s, 3)) for s in range(3)] == [[0, 1, 2], [3, 4], [5, 6]]
    config = _config(4, 2, layers=4)
    config.layer_types = ("sliding_attention", "full_attention", "sliding_attention", "full_attention")
    config.sliding_window = 8
    local = parallel.stage_config(config, range(2, 4))
    assert local.num_layers == 2 and [local.layer_window(i) for i in range(2)] == [8, None]
    weights = {f"model.layers.{i}.mlp.up_proj.weight": torch.full((1,), float(i)) for i in range(4)}
    weights["model.norm.weight"] = torch.ones(1)
    parallel.stage_weights(weights, range(2, 4))
    assert sorted(weights) == ["model.layers.0.mlp.up_proj.weight", "model.layers.1.mlp.up_proj.weight",
                               "model.norm.weight"]
    assert weights["model.layers.0.mlp.up_proj.weight"].item() == 2.0


def test_kv_heads_fewer_than_ranks_are_replicated_and_query_heads_follow_their_group():
    """8 query heads, 2 KV heads, 4 ranks: ranks 0-1 hold KV head 0 (query heads 0-3), ranks 2-3 KV head 1."""
    config = _config(8, 2)
    rows = torch.arange(8 * 16).float().unsqueeze(1)
    kv_rows = torch.arange(2 * 16).float().unsqueeze(1)
    for rank in range(4):
        weights = {"model.layers.0.self_attn.q_proj.weight": rows.clone(),
                   "model.layers.0.self_attn.k_proj.weight": kv_rows.clone()}
        parallel.shard_weights(weights, config, parallel.Shard(rank, 4))
        q_head = int(weights["model.layers.0.self_attn.q_proj.weight"][0].item()) // 16
        kv_head = int(weights["model.layers.0.self_attn.k_proj.weight"][0].item()) // 16
        assert weights["model.layers.0.self_attn.k_proj.weight"].shape[0] == 16
        assert q_head == 2 * rank and kv_head == q_head // 4
