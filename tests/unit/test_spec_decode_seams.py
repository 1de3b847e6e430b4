"""Where speculative decoding meets the rest of the engine:

- Verification runs the attention path of a prefill chunk: a verified sequence brings 1 + k query
  rows over its own paged KV. Each attention path (the torch backend with the CPU paged-decode
  kernel for the plain decodes beside it and SDPA for the verified chunks, the torch backend
  without that kernel, and the Triton kernels under the interpreter) gives a verified chunk the
  outputs that k + 1 single-token decodes give, in a batch mixing decodes, verified chunks (block
  boundaries inside and at their edges) and a prompt chunk; and the engine speculating on the
  Triton backend keeps plain decoding's greedy tokens.
- The EAGLE seam (engine/spec_decode/proposer.py HiddenStateProposer): a proposer that asks for the
  target's hidden states gets, after each sampled step, the rows whose logits were sampled (1 + k
  for a verified chunk); through the LM head they give the tokens the engine emitted.
- The off-switch's defaults per device type, and the per-sequence acceptance policy.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton (as tests/unit/test_kernels_attention.py)

import pytest  # noqa: E402
import torch  # noqa: E402

from iterserve.engine.attention import cpu_paged  # noqa: E402
from iterserve.engine.attention.backend import AttentionMetadata  # noqa: E402
from iterserve.engine.attention.torch_backend import TorchBackend  # noqa: E402
from iterserve.engine.sampling_params import SamplingParams  # noqa: E402
from iterserve.engine.spec_decode.config import DISABLE_BY_BATCH_SIZE, SpeculativeConfig  # noqa: E402
from iterserve.engine.spec_decode.policy import PROBE_EVERY, SpecPolicy  # noqa: E402
from iterserve.engine.spec_decode.proposer import HiddenStateProposer, NgramProposer  # noqa: E402

BLOCK, HEADS, KV_HEADS, DIM = 8, 6, 2, 64
# (context already cached, new query rows): plain decodes (1 row), verified chunks of 1 + k rows
# (one starting at a block edge, one crossing an edge, one ending on one), and a prompt chunk.
ROWS = [(20, 1), (15, 5), (16, 3), (5, 4), (9, 1), (0, 12), (29, 3), (3, 1)]


def backend_named(name: str):
    if name == "triton-interpreter":
        from iterserve.engine.attention.triton_backend import TritonBackend

        return TritonBackend()
    return TorchBackend(paged_decode=name == "torch+paged-decode-kernel")


class Pool:
    """A paged KV pool with shuffled block tables and the per-token q/k/v of every sequence."""

    def __init__(self, seed: int):
        gen = torch.Generator().manual_seed(seed)
        totals = [c + n for c, n in ROWS]
        needed = [-(-t // BLOCK) for t in totals]
        self.num_blocks = sum(needed) + 2
        order = torch.randperm(self.num_blocks, generator=gen).tolist()
        self.tables, start = [], 0
        for n in needed:
            self.tables.append(order[start : start + n])
            start += n
        self.q = [torch.randn(t, HEADS, DIM, generator=gen) for t in totals]
        self.k = [torch.randn(t, KV_HEADS, DIM, generator=gen) for t in totals]
        self.v = [torch.randn(t, KV_HEADS, DIM, generator=gen) for t in totals]
        self.noise = (torch.randn(self.num_blocks, BLOCK, KV_HEADS, DIM, generator=gen),
                      torch.randn(self.num_blocks, BLOCK, KV_HEADS, DIM, generator=gen))

    def caches_with_context(self):
        """Caches (noise everywhere else) holding every sequence's context KV."""
        k_cache, v_cache = self.noise[0].clone(), self.noise[1].clone()
        for i, (context, _) in enumerate(ROWS):
            for p in range(context):
                block, offset = self.tables[i][p // BLOCK], p % BLOCK
                k_cache[block, offset], v_cache[block, offset] = self.k[i][p], self.v[i][p]
        return k_cache, v_cache

    def step(self, backend, k_cache, v_cache, spans: list[tuple[int, int]]) -> list[torch.Tensor]:
        """One step: sequence i brings rows spans[i] = (start, end) (none when start == end)."""
        live = [i for i, (a, b) in enumerate(spans) if b > a]
        meta = AttentionMetadata.build([spans[i][1] - spans[i][0] for i in live], [spans[i][1] for i in live],
                                       [self.tables[i] for i in live], BLOCK)
        query = torch.cat([self.q[i][slice(*spans[i])] for i in live])
        key = torch.cat([self.k[i][slice(*spans[i])] for i in live])
        value = torch.cat([self.v[i][slice(*spans[i])] for i in live])
        backend.write_kv(key, value, k_cache, v_cache, meta)
        out = backend.attend(query, k_cache, v_cache, meta, DIM ** -0.5)
        pieces, at = {}, 0
        for i in live:
            n = spans[i][1] - spans[i][0]
            pieces[i] = out[at : at + n]
            at += n
        return [pieces.get(i) for i in range(len(spans))]


def dense_reference(pool: Pool, i: int) -> torch.Tensor:
    """Causal attention of sequence i's new rows over its own keys, computed densely."""
    context, n = ROWS[i]
    q, k, v = pool.q[i][context:], pool.k[i], pool.v[i]
    group = HEADS // KV_HEADS
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * DIM ** -0.5
    positions = torch.arange(context, context + n)
    scores = scores.masked_fill(torch.arange(context + n)[None, :] > positions[:, None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("name", ["torch+paged-decode-kernel", "torch-sdpa", "triton-interpreter"])
def test_a_verified_chunk_attends_as_its_single_token_decodes_would(name):
    backend = backend_named(name)
    if name == "torch+paged-decode-kernel":
        assert cpu_paged.load() is not None, "the CPU paged-decode kernel did not build (no C compiler?)"
    pool = Pool(seed=11)
    # One step: every sequence's rows at once, as a speculative step schedules them.
    k_cache, v_cache = pool.caches_with_context()
    together = pool.step(backend, k_cache, v_cache, [(c, c + n) for c, n in ROWS])
    # The same rows one token per step: the decodes speculation replaces.
    k_single, v_single = pool.caches_with_context()
    alone = [[] for _ in ROWS]
    for j in range(max(n for _, n in ROWS)):
        spans = [(c + j, c + j + 1) if j < n else (c + n, c + n) for c, n in ROWS]
        for i, rows in enumerate(pool.step(backend, k_single, v_single, spans)):
            if rows is not None:
                alone[i].append(rows)
    for i in range(len(ROWS)):
        want = dense_reference(pool, i)
        assert (together[i] - want).abs().max().item() < 2e-5, (name, ROWS[i])
        assert (torch.cat(alone[i]) - together[i]).abs().max().item() < 2e-5, (name, ROWS[i])
    # Both ways write the same KV, and nothing outside the sequences' slots.
    assert torch.equal(k_cache, k_single) and torch.equal(v_cache, v_single)


# -- the EAGLE seam ---------------------------------------------------------------------------------------
class Recorder(HiddenStateProposer):
    """n-gram proposals; records what observe_hidden receives (with the proposals it verified)."""

    def __init__(self):
        self.ngram = NgramProposer(1, 3)
        self.seen = []

    def propose(self, seqs, num_tokens):
        return self.ngram.propose(seqs, num_tokens)

    def observe_hidden(self, states):
        for state in states:
            self.seen.append((state.seq, state.first_position, list(state.seq.spec_token_ids), state.rows.clone()))


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from tests.unit import tiny_llama as tiny

    return tiny.write_gguf(tmp_path_factory.mktemp("seam") / "tiny.gguf", tiny.hf_weights(seed=9))


def test_a_hidden_state_proposer_gets_the_rows_the_engine_sampled(tiny_model):
    from iterserve.engine import LLM

    llm = LLM(str(tiny_model), device="cpu", attention_backend="torch", dtype="float32", max_model_len=128,
              block_size=8, num_kv_blocks=256, max_num_seqs=8, max_num_batched_tokens=64,
              speculative_config='{"method": "ngram", "num_speculative_tokens": 3, "min_acceptance_rate": 0, '
                                 '"disable_by_batch_size": 8}')
    runner = llm.engine.executor
    recorder = Recorder()
    runner.proposer = llm.engine.proposer = recorder
    prompts = [[65 + i % 5 for i in range(n)] for n in (7, 16, 23, 30)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    verified = accepted = 0
    for seq, first, proposals, rows in recorder.seen:
        tokens = seq.prompt_token_ids + seq.output_token_ids
        assert rows.shape == (1 + len(proposals), runner.model.config.hidden_size)
        kept = 0  # greedy: the leading proposals that are the emitted tokens were accepted
        while kept < len(proposals) and first + 1 + kept < len(tokens) and proposals[kept] == tokens[first + 1 + kept]:
            kept += 1
        emitted = runner.model.compute_logits(rows[: kept + 1]).argmax(-1).tolist()
        assert emitted == tokens[first + 1 : first + 2 + kept]
        verified += bool(proposals)
        accepted += kept
    assert verified > 0 and accepted > 0, (len(recorder.seen), verified, accepted)


# -- the policy ------------------------------------------------------------------------------------------
def test_the_off_switch_default_depends_on_the_device_type():
    config = SpeculativeConfig.parse('{"method": "ngram"}')
    assert config.disable_by_batch_size is None
    assert config.batch_limit("cpu") == DISABLE_BY_BATCH_SIZE["cpu"] < DISABLE_BY_BATCH_SIZE["cuda"]
    assert config.batch_limit("cuda") == config.batch_limit("xpu") == DISABLE_BY_BATCH_SIZE["cuda"]
    assert SpeculativeConfig.parse('{"disable_by_batch_size": 5}').batch_limit("cpu") == 5

    from tests.unit.engine_helpers import fake_engine

    engine = fake_engine(speculative_config='{"method": "ngram"}')  # the fake model runs as a CPU engine
    assert engine.scheduler.spec_policy.disable_by_batch_size == DISABLE_BY_BATCH_SIZE["cpu"]


class _Seq:
    spec_acceptance = 1.0
    spec_skipped = 0


def test_a_sequence_with_low_acceptance_stops_proposing_probes_and_comes_back():
    policy = SpecPolicy(disable_by_batch_size=4, min_acceptance_rate=0.3)
    assert policy.step_allows(4) and not policy.step_allows(5)
    seq = _Seq()
    rounds = 0
    while policy.seq_allows(seq):  # every proposal rejected: the moving average falls below 0.3
        policy.observe(seq, 4, 0)
        rounds += 1
        assert rounds < 10
    assert rounds == 4  # 1 -> 0.7 -> 0.49 -> 0.343 -> 0.24
    probes = [i for i in range(3 * PROBE_EVERY) if policy.seq_allows(seq)]
    assert len(probes) == 3 and probes[1] - probes[0] == probes[2] - probes[1] == PROBE_EVERY
    for _ in range(2):  # the probes find a repetitive stretch: everything accepted
        policy.observe(seq, 4, 4)
    assert seq.spec_acceptance >= 0.3 and all(policy.seq_allows(seq) for _ in range(PROBE_EVERY))


def test_speculation_on_the_triton_backend_keeps_greedy_tokens(tiny_model):
    """The whole engine with verified chunks through the Triton kernels (the interpreter on a CPU):
    the same greedy tokens as plain decoding on the torch backend."""
    from iterserve.engine import LLM

    prompts = [[65 + i % 4 for i in range(n)] for n in (9, 17)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    results = {}
    for backend, speculative_config in (("torch", None), ("triton", '{"method": "ngram", "num_speculative_tokens": 3, '
                                                                     '"prompt_lookup_min": 1, "min_acceptance_rate": 0, '
                                                                     '"disable_by_batch_size": 8}')):
        llm = LLM(str(tiny_model), device="cpu", attention_backend=backend, dtype="float32", max_model_len=128,
                  block_size=8, num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=64,
                  speculative_config=speculative_config)
        results[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        if speculative_config:
            assert llm.engine.stats().spec_num_accepted_tokens > 0
    assert results["triton"] == results["torch"]
