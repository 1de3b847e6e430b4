"""`iterserve serve --fake-model --enable-prefix-caching`: a repeated prompt is served from cached
blocks, as the vLLM-named counters show; a request's cache_salt and skip_prefix_cache are honoured."""

from __future__ import annotations

import httpx

from iterserve.engine import metrics as names
from tests.server_fixture import running_server

PROMPT = "You are a helpful assistant. " * 8  # 232 bytes = 232 fake tokens: 14 full blocks


def test_repeated_prompts_hit_the_cache_unless_salted_or_opted_out():
    with running_server(["--fake-model", "--enable-prefix-caching"]) as server:
        def complete(**extra) -> tuple[float, float]:
            body = {"prompt": PROMPT + "Hi", "max_tokens": 2, **extra}
            httpx.post(f"{server.url}/v1/completions", json=body, timeout=30).raise_for_status()
            m = server.metrics()
            assert m[names.PREFIX_CACHE_HITS_TOTAL] == m[names.VLLM_PREFIX_CACHE_HITS_TOTAL]
            return m[names.VLLM_PREFIX_CACHE_QUERIES_TOTAL], m[names.VLLM_PREFIX_CACHE_HITS_TOTAL]

        assert complete() == (234, 0)
        assert complete() == (468, 224)  # 14 blocks of 16
        assert complete(skip_prefix_cache=True) == (468, 224)  # not even looked up
        assert complete(cache_salt="tenant-a") == (702, 224)
        assert complete(cache_salt="tenant-a") == (936, 448)
        assert server.metrics()[names.KV_CACHE_USAGE] == 0.0 < server.metrics()[names.KV_CACHE_CACHED_FRACTION]
        bad = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "cache_salt": 5}, timeout=30)
        assert bad.status_code == 400
