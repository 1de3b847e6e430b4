"""Speculative decoding on the real scheduler with the fake model: the --speculative-config rules,
n-gram lookup against a brute-force search, outputs identical to plain decoding (stop tokens, stop
strings, max_tokens, prefix caching, preemption by recompute and swap), KV rollback, the token
budget, the policy, and a hypothesis property test with a proposer that is sometimes right."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from iterserve.engine.config import ConfigError, EngineConfig
from iterserve.engine.fake_executor import FakeExecutor
from iterserve.engine.sampling_params import SamplingParams
from iterserve.engine.spec_decode import NgramProposer, SpeculativeConfig
from iterserve.engine.spec_decode.proposer import Proposal, Proposer
from tests.unit.engine_helpers import fake_engine, run_to_completion
from tests.unit.test_scheduler_properties import SHARED_PREFIX, KvShadow, check_block_invariants

# disable_by_batch_size 8 (the accelerator default; the fake model counts as a CPU engine, whose default is lower).
NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
                    "disable_by_batch_size": 8})
PROMPTS = ["abc abc abc abc hello world " * 3, "the cat sat on the mat, the cat sat on the", "x", "aaaa" * 20,
           "one two three four one two three four"]


def spec(**options) -> str:
    return json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                       "prompt_lookup_max": 3, "disable_by_batch_size": 8, **options})


# -- configuration ----------------------------------------------------------------------------------
@pytest.mark.parametrize("raw, words", [
    ("{", "not JSON"),
    ("[1]", "JSON object"),
    ('{"method": "eagle"}', "method must be one of"),
    ('{"num_speculative_tokens": 0}', "num_speculative_tokens"),
    ('{"num_speculative_tokens": 99}', "num_speculative_tokens"),
    ('{"prompt_lookup_min": 5, "prompt_lookup_max": 2}', "prompt_lookup_min (5) exceeds"),
    ('{"method": "draft_model"}', 'needs "model"'),
    ('{"method": "ngram", "model": "x"}', "does not use"),
    ('{"n": 1}', "unknown key 'n'"),
    ('{"min_acceptance_rate": 2}', "min_acceptance_rate"),
    ('{"disable_by_batch_size": true}', "disable_by_batch_size"),
    ("{" + " " * 5000 + "}", "longer than"),
])
def test_bad_speculative_config_names_the_key(raw, words):
    with pytest.raises(ConfigError, match="--speculative-config") as error:
        EngineConfig(model="fake", speculative_config=raw).resolve()
    assert words in str(error.value)


def test_speculative_config_defaults_and_off():
    assert SpeculativeConfig.parse(None) is None
    config = SpeculativeConfig.parse('{"method": "ngram"}')
    assert (config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max) == (4, 2, 4)
    with pytest.raises(ConfigError, match="needs the real model"):
        fake_engine(speculative_config='{"method": "draft_model", "model": "x"}')


# -- n-gram lookup ----------------------------------------------------------------------------------
def brute_force(tokens: list[int], k: int, low: int, high: int) -> list[int]:
    for n in range(min(high, len(tokens) - 1), low - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def test_ngram_lookup_matches_brute_force():
    rng = random.Random(0)
    proposer = NgramProposer(1, 4)
    # Large ids whose bytes straddle token boundaries check that only aligned byte matches count.
    alphabets = [[1, 2, 3], [0, 256, 65536, 1, 16777216], list(range(40))]
    for trial in range(600):
        alphabet = alphabets[trial % len(alphabets)]
        tokens = [rng.choice(alphabet) for _ in range(rng.randint(1, 40))]
        k = rng.randint(1, 5)
        assert proposer.lookup(tokens, k) == brute_force(tokens, k, 1, 4), tokens
    assert NgramProposer(2, 3).lookup([5, 6, 7, 8, 5, 6], 3) == [7, 8, 5]
    assert NgramProposer(2, 3).lookup([5, 6, 7, 8, 9, 6], 3) == []  # only a 1-gram matches


# -- whole engine ---------------------------------------------------------------------------------
def generate(speculative_config: str | None, params: list[SamplingParams], **options):
    engine = fake_engine(speculative_config=speculative_config, **options)
    for i, (prompt, p) in enumerate(zip(PROMPTS * 4, params, strict=False)):
        engine.add_request(prompt=prompt, params=p, request_id=f"r{i}")
    outputs = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                outputs[output.request_id] = (output.outputs[0].token_ids, output.outputs[0].text,
                                              output.outputs[0].finish_reason)
    assert engine.block_manager.usage() == 0.0
    return outputs, engine


@pytest.mark.parametrize("options", [
    {},
    {"enable_prefix_caching": True},
    {"num_blocks": 12, "preemption_mode": "recompute", "max_num_batched_tokens": 64, "max_model_len": 128},
    {"num_blocks": 12, "num_cpu_blocks": 24, "preemption_mode": "swap", "max_num_batched_tokens": 64,
     "max_model_len": 128},
    {"chunked_prefill": False, "max_num_batched_tokens": 256},
])
def test_outputs_equal_plain_decoding_with_fewer_steps(options):
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (40, 7, 1, 60, 33)] * 3
    plain, plain_engine = generate(None, params, **options)
    fast, fast_engine = generate(NGRAM, params, **options)
    assert fast == plain
    stats = fast_engine.stats()
    assert 0 < stats.spec_num_accepted_tokens <= stats.spec_num_draft_tokens
    assert list(stats.spec_accepted_per_pos) == sorted(stats.spec_accepted_per_pos, reverse=True)
    assert sum(stats.spec_accepted_per_pos) == stats.spec_num_accepted_tokens
    assert fast_engine.num_steps < plain_engine.num_steps


def test_stop_rules_inside_accepted_tokens_end_where_plain_decoding_ends():
    stops = [SamplingParams(max_tokens=50, stop=["ca"]), SamplingParams(max_tokens=50, stop_token_ids=[ord("o")]),
             SamplingParams(max_tokens=50, stop=["l", "ab"]),
             SamplingParams(max_tokens=9, min_tokens=3, stop_token_ids=[ord(" ")]),
             SamplingParams(max_tokens=50, stop=["  "], stop_token_ids=[ord("z")])]
    plain, _ = generate(None, stops)
    fast, engine = generate(NGRAM, stops)
    assert fast == plain
    assert engine.stats().spec_num_accepted_tokens > 0


def test_rejected_positions_are_rolled_back():
    engine = fake_engine(speculative_config=spec(), block_size=16)
    engine.add_request(prompt_token_ids=list(range(97, 97 + 14)), request_id="a",
                       params=SamplingParams(max_tokens=20, ignore_eos=True))
    engine.step()  # prefill: 14 tokens, one sampled
    seq = engine.scheduler.running[0]
    free_before = engine.block_manager.num_free_blocks
    engine.proposer = WrongProposer()
    engine.step()  # verifies 4 wrong proposals at positions 14..18: a second block, then rolled back
    assert seq.num_computed_tokens == 15 and len(seq.output_token_ids) == 2
    assert len(seq.block_table) == 1 and engine.block_manager.num_free_blocks == free_before
    assert engine.stats().spec_num_draft_tokens == 4 and engine.stats().spec_num_accepted_tokens == 0


class WrongProposer(Proposer):
    """Proposes tokens the fake model never emits (it emits letters and spaces only)."""

    def propose(self, seqs, num_tokens):
        return [Proposal([ord("#")] * k) for k in num_tokens]


class SometimesRight(Proposer):
    """Proposes the fake model's own continuation, corrupted at a random position (or not at all)."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)

    def propose(self, seqs, num_tokens):
        proposals = []
        for seq, k in zip(seqs, num_tokens, strict=True):
            tokens, last, position = [], seq.last_token_id, seq.num_tokens
            for _ in range(self.rng.randint(0, k)):
                last = FakeExecutor.token_after(last, position) if self.rng.random() < 0.8 else ord("#")
                tokens.append(last)
                position += 1
            proposals.append(Proposal(tokens))
        return proposals


def test_budget_counts_proposals_and_leaves_prefill_its_share():
    engine = fake_engine(speculative_config=spec(), max_num_batched_tokens=32, long_prefill_token_threshold=8,
                         max_num_seqs=16)
    engine.proposer = SometimesRight(1)
    for i in range(6):
        engine.add_request(prompt=f"{i} short", request_id=f"d{i}", params=SamplingParams(max_tokens=30, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert all(seq.num_computed_tokens == seq.num_tokens - 1 for seq in engine.scheduler.running)
    engine.add_request(prompt="p" * 100, request_id="long", params=SamplingParams(max_tokens=2, ignore_eos=True))
    engine.proposer = WrongProposer()
    engine._drain_inbox([])
    engine._propose()
    out = engine.scheduler.schedule()
    assert out.num_batched_tokens <= 32
    spec_tokens = sum(chunk.num_spec for chunk in out.chunks)
    assert spec_tokens > 0
    prefill = [chunk for chunk in out.chunks if chunk.seq.request_id == "long"]
    assert prefill and prefill[0].num_tokens >= 8  # the prefill share survived the proposals


def test_policy_stops_speculating_on_a_full_batch_and_after_rejections():
    engine = fake_engine(speculative_config=spec(disable_by_batch_size=2, min_acceptance_rate=0.5))
    engine.proposer = WrongProposer()
    for i in range(3):
        engine.add_request(prompt="abc", request_id=f"r{i}", params=SamplingParams(max_tokens=40, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.stats().spec_num_drafts == 0  # three running > disable_by_batch_size
    engine.abort_request("r2")
    for _ in range(16):
        engine.step()
    drafts = engine.stats().spec_num_drafts
    # Two sequences, 16 steps: after two rejected rounds each stops, probing once every 8 steps.
    assert 4 <= drafts <= 10, drafts


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    requests=st.lists(st.tuples(st.integers(0, 20), st.integers(1, 70), st.integers(1, 40),
                                st.one_of(st.none(), st.integers(0, 40)), st.sampled_from([0, 16, 17, 33])),
                      min_size=1, max_size=16),
    num_blocks=st.integers(min_value=8, max_value=32),
    max_num_seqs=st.integers(min_value=1, max_value=10),
    budget=st.integers(min_value=16, max_value=80),
    mode=st.sampled_from(["recompute", "swap"]),
    caching=st.booleans(),
    k=st.integers(1, 6),
    seed=st.integers(0, 1000),
)
def test_random_workloads_with_speculation_keep_every_invariant(requests, num_blocks, max_num_seqs, budget, mode,
                                                                caching, k, seed):
    max_model_len = min(num_blocks * 16, 128)
    budget = max(budget, max_num_seqs)
    engine = fake_engine(num_blocks=num_blocks, num_cpu_blocks=num_blocks, max_num_seqs=max_num_seqs,
                         max_num_batched_tokens=budget, preemption_mode=mode, max_model_len=max_model_len,
                         enable_prefix_caching=caching,
                         speculative_config=spec(num_speculative_tokens=k, disable_by_batch_size=1 << 20,
                                                 min_acceptance_rate=0.0))
    engine.proposer = SometimesRight(seed)
    engine.executor = KvShadow(engine.executor, engine.block_manager)
    pending = sorted(enumerate(requests), key=lambda item: item[1][0])
    aborts: dict[int, list[str]] = {}
    admitted, finished = set(), set()
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][1][0] <= step:
            i, (_, prompt_len, max_tokens, abort_at, shared) = pending.pop(0)
            prompt = (SHARED_PREFIX[:shared] + [97 + (i + j) % 26 for j in range(prompt_len)])[: max_model_len - 1]
            engine.add_request(prompt_token_ids=prompt, request_id=f"r{i}",
                               params=SamplingParams(max_tokens=max_tokens, ignore_eos=True))
            admitted.add(f"r{i}")
            if abort_at is not None:
                aborts.setdefault(step + abort_at, []).append(f"r{i}")
        for request_id in aborts.pop(step, []):
            engine.abort_request(request_id)
        engine._drain_inbox([])
        engine._propose()
        out = engine.scheduler.schedule()
        assert out.num_batched_tokens <= budget
        for chunk in out.chunks:
            assert chunk.num_spec == 0 or (chunk.sample and chunk.num_tokens == 1 + chunk.num_spec)
            assert chunk.start + chunk.num_tokens <= max_model_len
        check_block_invariants(engine)
        sampled = engine.executor.execute(out)
        for chunk, token in zip(out.chunks, sampled, strict=True):
            if chunk.num_spec:  # the fake model's own tokens: each accepted proposal is what it would emit
                assert token[:-1] == chunk.seq.spec_token_ids[: len(token) - 1]
        engine.scheduler.update(out, sampled)
        for seq in list(engine._sequences.values()):
            if seq.is_finished:
                finished.add(seq.request_id)
                assert len(seq.output_token_ids) <= seq.params.max_tokens
        check_block_invariants(engine)
        for seq in engine.scheduler.running:  # nothing past the computed tokens stays allocated
            assert len(seq.block_table) <= engine.block_manager.blocks_for(seq.num_computed_tokens + 1)
        step += 1
        assert step < 5000, "no progress"
    assert engine.block_manager.usage() == 0.0
    assert engine.block_manager.cpu.num_used == 0
    assert engine.block_manager.num_free_blocks == num_blocks


def test_tokens_match_plain_decoding_under_the_property_workload_proposer():
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (40, 7, 1, 60, 33)] * 2
    options = {"num_blocks": 16, "max_num_batched_tokens": 48, "max_num_seqs": 8}
    plain, _ = generate(None, params, **options)
    engine = fake_engine(speculative_config=spec(min_acceptance_rate=0.0), **options)
    engine.proposer = SometimesRight(7)
    for i, (prompt, p) in enumerate(zip(PROMPTS * 4, params, strict=False)):
        engine.add_request(prompt=prompt, params=p, request_id=f"r{i}")
    tokens = run_to_completion(engine)
    assert tokens == {rid: out[0] for rid, out in plain.items()}


def test_metrics_export_the_counters_under_both_names():
    from prometheus_client.parser import text_string_to_metric_families

    from iterserve.engine import metrics as names
    from iterserve.engine.server.metrics import ServerMetrics

    _, engine = generate(NGRAM, [SamplingParams(max_tokens=40, ignore_eos=True)] * 5)
    stats = engine.stats()
    text = ServerMetrics("m", engine.stats).exposition().decode()
    samples = {(s.name, s.labels.get("position")): s.value for f in text_string_to_metric_families(text)
               for s in f.samples if not s.name.endswith("_created")}
    for own, vllm, value in [
        (names.SPEC_DECODE_DRAFTS_TOTAL, names.VLLM_SPEC_DECODE_NUM_DRAFTS, stats.spec_num_drafts),
        (names.SPEC_DECODE_DRAFT_TOKENS_TOTAL, names.VLLM_SPEC_DECODE_NUM_DRAFT_TOKENS, stats.spec_num_draft_tokens),
        (names.SPEC_DECODE_ACCEPTED_TOKENS_TOTAL, names.VLLM_SPEC_DECODE_NUM_ACCEPTED_TOKENS,
         stats.spec_num_accepted_tokens),
    ]:
        assert value > 0
        assert samples[(own, None)] == samples[(vllm + "_total", None)] == value
    for position, count in enumerate(stats.spec_accepted_per_pos):
        assert samples[(names.VLLM_SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS + "_total", str(position))] == count
    assert "vllm:" not in ServerMetrics("m", engine.stats, vllm_names=False).exposition().decode()


@pytest.mark.parametrize("length", [15, 16, 17, 33])
def test_a_decode_engine_speculates_after_a_kv_pull(length):
    from tests.unit import test_kv_transfer as kv

    prefill_engine = kv.make_engine("prefill")
    decode_engine = kv.make_engine("decode", speculative_config=spec(min_acceptance_rate=0.0))
    decode_engine.proposer = SometimesRight(length)
    prefill_engine.start_kv_transfer()
    try:
        prompt = "".join(chr(97 + (i * 7) % 26) for i in range(length))
        params = kv.prefill(prefill_engine, prompt)
        decode_engine.add_request(prompt, kv.GREEDY, request_id="d", kv_transfer_params=kv.remote(params))
        out = kv.run(decode_engine)["d"]
        assert out.error is None and out.outputs[0].token_ids == kv.reference(prompt)
        assert decode_engine.stats().kv_pulls_ok == 1 and decode_engine.stats().spec_num_accepted_tokens > 0
        manager = decode_engine.block_manager
        assert manager.num_free_blocks == manager.num_blocks
    finally:
        prefill_engine.close()
        decode_engine.close()


def test_the_admin_retune_applies_while_speculating():
    engine = fake_engine(speculative_config=spec(min_acceptance_rate=0.0), max_num_seqs=8)
    engine.proposer = SometimesRight(3)
    for i in range(8):
        engine.add_request(prompt=f"{i} abc abc", request_id=f"r{i}", params=SamplingParams(max_tokens=30, ignore_eos=True))
    for _ in range(4):
        engine.step()
    engine.set_max_num_seqs(2)
    engine.add_request(prompt="late", request_id="late", params=SamplingParams(max_tokens=5, ignore_eos=True))
    tokens = {}
    while engine.has_unfinished_requests():
        assert len(engine.scheduler.running) <= 8
        for output in engine.step():
            if output.finished:
                tokens[output.request_id] = output.outputs[0].token_ids
        if len(tokens) >= 7:
            assert len(engine.scheduler.running) <= 2
    assert len(tokens) == 9 and engine.block_manager.usage() == 0.0
