"""Prefix caching with the real scheduler and block manager (fake executor): block hashes, hits at
block boundaries, sharing, LRU eviction, opt-out and salt, and the stats the server exports."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from iterserve.engine.config import EngineConfig
from iterserve.engine.prefix_cache import PrefixCache, hash_block_tokens, prefix_block_hashes
from iterserve.engine.sampling_params import SamplingParams
from tests.unit.engine_helpers import fake_engine, run_to_completion

BLOCK = 16


def params(max_tokens: int = 4, **extra) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **extra)


def tokens(n: int, offset: int = 0) -> list[int]:
    return [97 + (offset + j * 7) % 26 for j in range(n)]


def cached_engine(**options):
    options.setdefault("max_num_batched_tokens", 256)
    return fake_engine(enable_prefix_caching=True, **options)


def admit(engine, prompt: list[int], request_id: str, **extra):
    """Add one request and run the step that admits it; returns its first scheduled chunk."""
    engine.add_request(prompt_token_ids=prompt, params=params(**extra), request_id=request_id)
    engine._drain_inbox([])
    out = engine.scheduler.schedule()
    engine.scheduler.update(out, engine.executor.execute(out))
    return next(c for c in out.chunks if c.seq.request_id == request_id)


# -- hashing ---------------------------------------------------------------------------------------
def test_block_hashes_are_chained_over_full_blocks_only():
    ids = tokens(40)
    hashes = prefix_block_hashes(ids, BLOCK)
    assert len(hashes) == 2  # the 8-token tail has no hash
    assert hashes == prefix_block_hashes(ids[:32], BLOCK)
    assert hashes[0] == hash_block_tokens(None, ids[:16])
    assert hashes[1] == hash_block_tokens(hashes[0], ids[16:32])
    # Same second block after a different first block: a different name.
    other = prefix_block_hashes(tokens(16, 3) + ids[16:32], BLOCK)
    assert other[1] != hashes[1]
    salted = prefix_block_hashes(ids, BLOCK, extra=("tenant-a",))
    assert salted[0] != hashes[0] and salted[1] != hashes[1]
    assert prefix_block_hashes(ids, BLOCK, extra=("tenant-b",))[0] != salted[0]


def test_block_hashes_are_the_same_in_another_process():
    ids = tokens(48)
    code = ("from iterserve.engine.prefix_cache import prefix_block_hashes as h; "
            f"print(h({ids!r}, {BLOCK}, ('salt',)))")
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(prefix_block_hashes(ids, BLOCK, ("salt",)))


def test_cache_index_evicts_least_recently_parked_first():
    cache = PrefixCache()
    for block, block_hash in [(0, 100), (1, 101), (2, 102)]:
        assert cache.insert(block, block_hash)
    assert not cache.insert(5, 101)  # those tokens already have a block
    for block in (2, 0, 1):
        cache.park(block)
    cache.unpark(0)
    assert cache.evict() == 2 and cache.match([100, 101, 102]) == [0, 1]
    assert cache.evict() == 1 and cache.match([100, 101]) == [0]
    cache.record(100, 40)
    cache.record(100, 60)
    assert cache.hit_rate() == 0.5 and (cache.queries, cache.hits) == (200, 100)


# -- the engine --------------------------------------------------------------------------------------
@pytest.mark.parametrize(("shared", "prompt_len", "expected_hit"), [
    (32, 40, 32),  # two full shared blocks
    (33, 40, 32),  # one token more: still two blocks
    (40, 40, 32),  # the same prompt again: hit all full blocks
    (32, 32, 16),  # the same prompt, an exact multiple: the last block is recomputed
    (33, 33, 32),  # exact multiple plus one: only the last token is computed
    (15, 40, 0),  # less than a block
])
def test_a_request_starts_after_its_longest_cached_block_aligned_prefix(shared, prompt_len, expected_hit):
    engine = cached_engine()
    first = tokens(max(shared, prompt_len))
    admit(engine, first[:prompt_len] if shared == prompt_len else first, "a")
    second = first[:shared] + tokens(prompt_len - shared, 5)
    chunk = admit(engine, second, "b")
    assert chunk.start == expected_hit and chunk.num_tokens == prompt_len - expected_hit and chunk.sample
    stats = engine.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (2 * prompt_len, expected_hit)


def test_shared_blocks_count_once_and_stay_cached_when_released():
    engine = cached_engine(num_blocks=20)
    system = tokens(48)
    admit(engine, system + tokens(14, 1), "a")
    admit(engine, system + tokens(14, 2), "b")
    a, b = (engine._sequences[r] for r in ("a", "b"))
    assert a.block_table[:3] == b.block_table[:3] and a.block_table[3] != b.block_table[3]
    bm = engine.block_manager
    assert bm.gpu.num_used == 5 and all(bm.gpu.refcount(x) == 2 for x in a.block_table[:3])
    run_to_completion(engine)
    assert bm.usage() == 0.0 and bm.num_free_blocks == 20
    assert bm.num_cached_blocks == 5  # the three shared blocks and each request's own full fourth block
    assert engine.stats().num_cached_blocks == 5


def test_cached_blocks_are_evicted_only_when_an_allocation_needs_them_oldest_first():
    engine = cached_engine(num_blocks=10, watermark=0.0, max_model_len=160)
    old, recent = tokens(32, 1), tokens(32, 2)
    for request_id, prompt in (("old", old), ("recent", recent)):
        engine.add_request(prompt_token_ids=prompt + [100], params=params(), request_id=request_id)
        run_to_completion(engine)
    bm = engine.block_manager
    assert bm.num_cached_blocks == 4
    assert bm.num_free_blocks == 10  # cached blocks count as free
    # 8 blocks: the 6 plain free ones, then the 2 least recently released cached ones (old's).
    engine.add_request(prompt_token_ids=tokens(128, 9), params=params(1), request_id="big")
    run_to_completion(engine)
    assert admit(engine, recent + [101], "again").start == 32
    assert bm.prefix_cache.match(prefix_block_hashes(old, BLOCK)) == []


def test_per_request_opt_out_neither_reads_nor_offers_blocks():
    engine = cached_engine()
    prompt = tokens(40)
    assert admit(engine, prompt, "a", skip_prefix_cache=True).start == 0
    assert admit(engine, prompt, "b").start == 0  # a offered nothing
    assert admit(engine, prompt, "c", skip_prefix_cache=True).start == 0  # b did, c does not read
    assert admit(engine, prompt, "d").start == 32
    assert engine.stats().prefix_cache_queries == 80  # b and d only


def test_requests_share_blocks_only_with_the_same_cache_salt():
    engine = cached_engine()
    prompt = tokens(40)
    admit(engine, prompt, "a", cache_salt="tenant-a")
    assert admit(engine, prompt, "b", cache_salt="tenant-b").start == 0
    assert admit(engine, prompt, "c").start == 0
    assert admit(engine, prompt, "d", cache_salt="tenant-a").start == 32


def test_preempted_sequence_finds_its_own_blocks_again():
    prompts = {"a": tokens(50, 1), "b": tokens(50, 2)}
    results = []
    for caching in (False, True):
        engine = fake_engine(num_blocks=8, watermark=0.0, max_num_batched_tokens=64, max_model_len=128,
                             enable_prefix_caching=caching)
        for request_id, prompt in prompts.items():
            engine.add_request(prompt_token_ids=prompt, params=params(30), request_id=request_id)
        results.append(run_to_completion(engine))
        assert engine.scheduler.num_preemptions > 0
    assert engine.stats().prefix_cache_hits > 0  # the preempted one resumed from its own cached blocks
    assert results[0] == results[1]


def test_defaults_on_for_the_real_model_off_for_static_and_fake():
    assert EngineConfig(model="some-model").resolve().enable_prefix_caching is True
    assert EngineConfig(model="some-model", scheduling="static").resolve().enable_prefix_caching is False
    assert EngineConfig(model="fake").resolve().enable_prefix_caching is False
    assert EngineConfig(model="some-model", enable_prefix_caching=False).resolve().enable_prefix_caching is False
    # The static baseline recomputes every prompt even when asked (bench/engine/throughput.py copies a
    # resolved config and switches it to static).
    assert EngineConfig(model="some-model", scheduling="static",
                        enable_prefix_caching=True).resolve().enable_prefix_caching is False


def test_metrics_export_queries_hits_rate_and_the_cached_share_beside_usage():
    from prometheus_client.parser import text_string_to_metric_families

    from iterserve.engine import metrics as names
    from iterserve.engine.server.metrics import ServerMetrics

    engine = cached_engine(num_blocks=20)
    prompt = tokens(40)
    admit(engine, prompt, "a")
    admit(engine, prompt, "b")
    run_to_completion(engine)
    exposition = ServerMetrics("m", engine.stats).exposition().decode()
    s = {f.name if f.type != "counter" else f"{f.name}_total": f.samples[0].value
         for f in text_string_to_metric_families(exposition) if f.samples}
    assert s[names.PREFIX_CACHE_QUERIES_TOTAL] == s[names.VLLM_PREFIX_CACHE_QUERIES_TOTAL] == 80
    assert s[names.PREFIX_CACHE_HITS_TOTAL] == s[names.VLLM_PREFIX_CACHE_HITS_TOTAL] == 32
    assert s[names.PREFIX_CACHE_HIT_RATE] == 0.4
    assert s[names.KV_CACHE_USAGE] == 0.0  # idle: the cached blocks are not "in use"
    assert s[names.KV_CACHE_CACHED_FRACTION] == 2 / 20


@pytest.mark.parametrize(("argv", "expected"), [([], None), (["--no-enable-prefix-caching"], False),
                                                (["--enable-prefix-caching"], True)])
def test_serve_flag(argv, expected):
    import argparse

    from iterserve.engine.server.cli import configure, engine_config

    parser = argparse.ArgumentParser()
    configure(parser)
    assert engine_config(parser.parse_args(argv)).enable_prefix_caching is expected
