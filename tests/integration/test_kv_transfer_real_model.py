"""Prefill/decode KV transfer on the embedded SmolLM2-135M: a prefill engine runs each prompt and
leases its KV blocks, a decode engine pulls them over loopback TCP and generates; greedy tokens
equal those of an engine that ran the prompt itself, for prompts of exactly k*block_size and
k*block_size+1 tokens, with several pulls in flight beside a local request; every engine's free
blocks are back to baseline after each round, and the decode engine's loaded KV is the prefill
engine's, bit for bit, except the last prompt position (which a step recomputes to sample from).
The prompts are prefixes of one story, so the decode engine finds earlier prompts' blocks in its
own prefix cache and pulls only the rest of each lease. The engines hold the same KV key, as an
InferenceService's do: do_remote_decode calls are signed as the router signs them.

KV poisoning: an attacker's listener serving KV of its own choosing for a prompt every user sends
(a system prompt) gets no connection from a decode engine, whether the params are unsigned or the
MAC check is bypassed, and the next user's greedy tokens are the model's own.

The weights are loaded once; each engine gets its own KV pool (a shallow copy of the runner with
fresh cache tensors), so the engines share nothing but read-only weights.
"""

from __future__ import annotations

import copy
import time

import pytest
import torch

from iterserve.engine.config import EngineConfig
from iterserve.engine.kv_transfer import params as kv_params
from iterserve.engine.kv_transfer.transport import LeaseRead, TcpTransport
from iterserve.engine.llm_engine import LLMEngine
from iterserve.engine.sampling_params import InvalidRequestError, SamplingParams
from tests.kv_auth_helpers import key_file, remote_decode, run_engine

pytestmark = pytest.mark.slow

STORY = ("Once upon a time, in a small village at the edge of a great forest, there lived an old clockmaker "
         "who had never once left the valley. Every morning he opened his shop, wound the hundred clocks on "
         "its walls, and waited for customers who rarely came. One winter day, a stranger knocked at the door "
         "and asked whether any clock in the shop could run backwards.")
LENGTHS = [1, 16, 17, 32, 33, 65]
GREEDY = SamplingParams(temperature=0, max_tokens=6)
NUM_BLOCKS = 40


@pytest.fixture(scope="module")
def runner():
    from iterserve.engine.model_runner import ModelRunner

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    # float32: greedy tokens are compared across batches of different shapes, which bf16 (what
    # --dtype auto picks on a CPU with native bf16) rounds differently.
    yield ModelRunner(EngineConfig(num_kv_blocks=NUM_BLOCKS, max_model_len=256, device="cpu", dtype="float32",
                                   attention_backend="torch"), show_progress=False)
    torch.set_num_threads(previous)


def engine_on(runner, role: str) -> LLMEngine:
    own = copy.copy(runner)  # shared weights and sampler, its own KV pool
    own.kv_caches = [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in runner.kv_caches]
    key = key_file() if role != "both" else None
    config = EngineConfig(**{**runner.config.__dict__, "role": role, "kv_auth_key_file": key})
    return LLMEngine(config, own, runner.tokenizer)


def run(engine: LLMEngine, timeout: float = 120) -> dict:
    return run_engine(engine, timeout)


def at_baseline(engine: LLMEngine) -> bool:
    engine.collect_kv_leases()
    return engine.block_manager.gpu.num_used == 0 and engine.block_manager.num_free_blocks == NUM_BLOCKS


def test_greedy_tokens_after_a_pull_equal_local_prefill(runner):
    token_ids = runner.tokenizer.encode(STORY)
    assert len(token_ids) > max(LENGTHS)
    prompts = {f"len{n}": token_ids[:n] for n in LENGTHS}
    local, prefill, decode = engine_on(runner, "both"), engine_on(runner, "prefill"), engine_on(runner, "decode")
    prefill.start_kv_transfer()
    try:
        for name, ids in prompts.items():
            local.add_request(prompt_token_ids=ids, params=GREEDY, request_id=f"ref-{name}")
        expected = {name.removeprefix("ref-"): out.outputs[0].token_ids for name, out in run(local).items()}
        assert at_baseline(local)

        # Round 1: one prompt at a time, checking the loaded KV against the prefill engine's blocks.
        pulled_from_block = {}
        for name, ids in prompts.items():
            prefill.add_request(prompt_token_ids=ids, params=SamplingParams(temperature=0, max_tokens=1),
                                request_id=f"p-{name}", kv_transfer_params=remote_decode())
            params = run(prefill)[f"p-{name}"].kv_transfer_params
            assert params["num_tokens"] == len(ids) and len(params["block_ids"]) == -(-len(ids) // 16)
            decode.add_request(prompt_token_ids=ids, params=GREEDY, request_id=f"d-{name}",
                               kv_transfer_params={**params, "do_remote_prefill": True})
            decode_blocks = None
            while decode_blocks is None or decode.has_unfinished_requests():
                outputs = decode.step()
                seq = decode._sequences.get(f"d-{name}")
                if decode_blocks is None and seq is not None and seq.kv_transfer.loaded:
                    # Blocks before first came from the decode engine's own prefix cache (earlier prompts
                    # here are prefixes of later ones), the rest were pulled.
                    first = seq.kv_transfer.first_block
                    decode_blocks = list(seq.block_table[first : len(params["block_ids"])])
                    pulled_from_block[name] = first
                    _assert_same_kv(prefill.executor, params["block_ids"][first:], decode.executor, decode_blocks,
                                    len(ids) - 1 - first * 16)
                for out in outputs:
                    if out.finished:
                        assert out.error is None
                        assert out.outputs[0].token_ids == expected[name], name
                time.sleep(0.001)
            deadline = time.monotonic() + 10
            while not (at_baseline(prefill) and at_baseline(decode)):
                assert time.monotonic() < deadline, "blocks not back to baseline"
                time.sleep(0.01)
        assert decode.stats().kv_pulls_ok == len(prompts) and decode.stats().kv_pulls_failed == 0
        assert pulled_from_block["len33"] == 2 and pulled_from_block["len16"] == 0  # len32 cached 2 full blocks

        # Round 2: every pull in flight at once, beside a local request on the decode engine.
        leases = {}
        for name, ids in prompts.items():
            prefill.add_request(prompt_token_ids=ids, params=SamplingParams(temperature=0, max_tokens=1),
                                request_id=f"p2-{name}", kv_transfer_params=remote_decode())
        for request_id, out in run(prefill).items():
            leases[request_id.removeprefix("p2-")] = out.kv_transfer_params
        decode.add_request(prompt_token_ids=prompts["len33"], params=GREEDY, request_id="plain")
        for name, ids in prompts.items():
            decode.add_request(prompt_token_ids=ids, params=GREEDY, request_id=f"d2-{name}",
                               kv_transfer_params={**leases[name], "do_remote_prefill": True})
        outputs = run(decode)
        assert outputs["plain"].outputs[0].token_ids == expected["len33"]
        for name in prompts:
            assert outputs[f"d2-{name}"].outputs[0].token_ids == expected[name], name
        deadline = time.monotonic() + 10
        while not (at_baseline(prefill) and at_baseline(decode)):
            assert time.monotonic() < deadline, "blocks not back to baseline"
            time.sleep(0.01)
        assert decode.stats().kv_pulls_failed == 0
    finally:
        prefill.close()
        decode.close()


def _assert_same_kv(source, source_blocks, target, target_blocks, num_exact: int) -> None:
    """The first num_exact token positions of every layer's K and V are identical on both engines."""
    size = 16
    for (src_k, src_v), (dst_k, dst_v) in zip(source.kv_caches, target.kv_caches, strict=True):
        for src, dst in ((src_k, dst_k), (src_v, dst_v)):
            a = src[source_blocks].reshape(len(source_blocks) * size, -1)[:num_exact]
            b = dst[target_blocks].reshape(len(target_blocks) * size, -1)[:num_exact]
            assert torch.equal(a, b)


class PoisonedSource:
    """An attacker's KV listener: any lease, any secret, the right layout, KV of its choosing."""

    def __init__(self, layout):
        self.layout, self.engine_id, self.reads = layout, "attacker", 0

    def open_read(self, transfer_id, secret, first_block, num_blocks):
        self.reads += 1
        return LeaseRead(list(range(num_blocks)), time.monotonic() + 30)

    def read_layers(self, block_ids):
        poison = memoryview(torch.full((len(block_ids) * self.layout.block_bytes_per_layer // 4,), 7.0).numpy().tobytes())
        half = len(poison) // 2
        for _ in range(self.layout.num_layers):
            yield poison[:half], poison[half:]

    def close_read(self, transfer_id):
        pass

    def release(self, transfer_id, secret):
        return True


def test_an_attackers_kv_never_reaches_the_shared_prefix_cache(runner):
    """Before: a client's do_remote_prefill pointing at its own listener made the decode engine pull
    the attacker's KV for a common prompt and file it in the prefix cache, so every later user of
    that prompt decoded from it. Now unsigned params are refused before any dial and, with the MAC
    check bypassed, the connector still refuses unauthenticated params: the prompt is recomputed."""
    system_prompt = runner.tokenizer.encode(STORY)[:48]  # 3 full blocks every user shares
    decode = engine_on(runner, "decode")
    local = engine_on(runner, "both")
    evil = TcpTransport()
    source = PoisonedSource(decode.kv_connector.layout)
    port = evil.listen(source, "127.0.0.1", 0)
    try:
        local.add_request(prompt_token_ids=system_prompt, params=GREEDY, request_id="ref")
        expected = run(local)["ref"].outputs[0].token_ids
        forged = {"transfer_id": "t", "engine_id": "e", "host": "127.0.0.1", "port": port, "block_ids": [0, 1, 2],
                  "num_tokens": len(system_prompt), "block_size": 16, "compat_hash": decode.kv_connector.compat_hash,
                  "lease_expires_at": time.time() + 60, "lease_secret": "s", "do_remote_prefill": True}
        with pytest.raises(InvalidRequestError) as refused:
            decode.add_request(prompt_token_ids=system_prompt, params=GREEDY, kv_transfer_params=forged)
        assert refused.value.param == "kv_transfer_params.mac"
        # The MAC check bypassed: the connector itself never dials unauthenticated params.
        decode._check_kv_transfer = kv_params.parse_request
        decode.add_request(prompt_token_ids=system_prompt, params=GREEDY, request_id="attack",
                           kv_transfer_params=forged)
        assert run(decode)["attack"].outputs[0].token_ids == expected  # recomputed, not the poison
        assert source.reads == 0 and decode.stats().kv_pulls_ok == 0
        decode.add_request(prompt_token_ids=system_prompt, params=GREEDY, request_id="victim")
        assert run(decode)["victim"].outputs[0].token_ids == expected
    finally:
        evil.close()
        decode.close()
