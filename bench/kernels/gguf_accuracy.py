"""Accuracy of each --quantization mode on the embedded SmolLM2-135M against the exact model (`none`:
the GGUF's weights dequantized to fp32), side by side with llama.cpp on the same prompts, in the two
forms that matter:

- free-running greedy text, the form a user sees: every prompt continued greedily for --tokens
  tokens by each mode (all prompts in one batch, one token each per step, as the engine runs them);
  per system the prompts whose continuation equals the exact one, and the mean number of tokens
  before the first divergence;
- per position with the exact prefix fed (teacher-forced): each prompt plus the exact continuation;
  the share of positions where the system's argmax is the exact model's, and (iterserve's modes)
  the largest |logit error|.

The prompts: the fixed set below (plain text, code, five chats, among them "What is the capital of
France?") and PER_KIND more of each kind (free text, code, chat, lists) drawn from the fragments below
by a seeded generator (--seed), so a run is reproducible and nothing is downloaded. A free-running
divergence is chaotic (one flipped near-tie changes the rest of the text), so each figure comes with a
bootstrap 95% interval over the prompts, and each mode is compared with llama.cpp per prompt (the
paired difference of tokens before divergence, of identical continuations and of positions agreeing
fed the exact prefix, with its interval).

llama.cpp's `llama-server` serves the same GGUF file on 127.0.0.1 (found or built as
bench/peers/compare.py does, unless --llama-server or --no-build): its greedy token ids
(`return_tokens`) free-running from the same prompt ids, and its argmax fed the exact prefix: one
request per position with n_predict 1 and its prompt cache on, so each position costs one decoded token
(the prefix's KV from the earlier requests, as in free-running decoding).

--ablate runs the `auto` model with one part at a time changed (ABLATIONS: a layer group's linears or
the LM head exact, the fused small ops off, and the activation quantizer in torch as ours, with ties
away from zero, as llama.cpp's AVX2 quantize_row_q8_0/q8_1 store it (fp16 scale and block sum), and in
coarser blocks), each against auto per prompt: what each part of auto costs, and whether llama.cpp's
way of doing a part would be more exact.

    .venv/bin/python -m bench.kernels.gguf_accuracy --ablate --json docs/perf/gguf_accuracy.json
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import itertools
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np
import torch

from bench import common

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "To make a cup of tea, you first",
    "Photosynthesis is the process by which",
    "The largest planet in the solar system",
    "import numpy as np\n\ndef mean(values):",
    "Water boils at a temperature of",
    "The French Revolution began in",
    "A good way to learn a new language is",
    "The main difference between a virus and a bacterium is",
    "In mathematics, a prime number is",
    "The recipe calls for two eggs, a cup of flour and",
    "Dear hiring manager, I am writing to apply for",
    "The theory of relativity was proposed by",
    "SELECT name, age FROM users WHERE",
    "The human heart has four chambers:",
    "My favourite season is autumn because",
    "The stock market fell sharply today after",
    "Machine learning models are trained by",
    "The Great Wall of China was built to",
    "Here is a short poem about the sea:\n",
    "The boiling point of a liquid depends on",
    "for (int i = 0; i < n; i++) {",
    "The mitochondria is known as",
    "An apple a day",
    "The first man to walk on the moon was",
    "Climate change is caused mainly by",
    "The quick brown fox",
    "Q: What is 12 times 12?\nA:",
    "The best way to save money is to",
]
FRANCE = "What is the capital of France?"
CHATS = [FRANCE, "What is the capital of Germany?", "Write a haiku about autumn leaves.",
         "Explain what a neural network is in one sentence.", "Give me three tips for better sleep."]

# The generated prompts: PER_KIND of each kind, each a template filled from the word lists by a seeded RNG.
PER_KIND = 24
TOPICS = ["volcanoes", "the Roman Empire", "quantum computing", "honey bees", "the printing press", "jazz music",
          "coral reefs", "the stock market", "electric cars", "the immune system", "ancient Egypt", "black holes",
          "the internet", "climate change", "chess", "the human brain", "renewable energy", "the Olympic Games",
          "vaccines", "the Moon landing", "democracy", "coffee", "rainforests", "artificial intelligence"]
THINGS = ["a lighthouse", "an old bicycle", "a rainy city", "a lost cat", "the first snow", "a train station",
          "a mountain lake", "a library at night", "a broken clock", "a garden in spring", "a desert road",
          "a fishing boat"]
NAMES = ["parse_date", "merge_sorted", "count_words", "is_palindrome", "flatten", "binary_search", "read_config",
         "moving_average", "dedupe", "to_snake_case", "gcd", "matrix_multiply", "top_k", "chunked"]
TEXT = ["The history of {topic} begins", "Scientists who study {topic} have found that",
        "Most people do not know that {topic}", "{Topic} matters today because", "A brief introduction to {topic}:",
        "The most surprising fact about {topic} is", "In the 19th century, {topic}",
        "Here is a short story about {thing}.", "I will never forget {thing}. It was",
        "The article explained how {topic} works:", "Critics of {topic} often argue that",
        "My grandmother used to tell me about {thing}:"]
CODE = ["def {name}(items):\n    \"\"\"", "def {name}(a, b):\n", "function {camel}(input) {{\n",
        "int {name}(int n) {{\n    if (n <= 1)", "class {Camel}:\n    def __init__(self", "# {name} in Rust\nfn {name}(",
        "SELECT id, {name} FROM orders\nWHERE", "#!/bin/bash\n# {name}: ", "public static int {camel}(int[] values) {{\n",
        "import json\n\n\ndef {name}(path):\n", "const {camel} = (list) =>", "fn main() {{\n    let {name} ="]
CHAT = ["What is {topic}?", "Explain {topic} to a ten-year-old.", "Give me three facts about {topic}.",
        "Write a haiku about {thing}.", "Write two sentences about {thing}.", "Why is {topic} important?",
        "How do I write a Python function called {name}?", "Summarize the history of {topic} in one sentence.",
        "What are the pros and cons of {topic}?", "Tell me a joke about {topic}."]
LIST = ["Five facts about {topic}:\n1.", "Things to pack for a trip to {thing}:\n-", "Steps to learn {topic}:\n1.",
        "Shopping list:\n- eggs\n- {item}\n-", "Pros and cons of {topic}:\nPros:\n-", "Top ten books about {topic}:\n1.",
        "Agenda for the meeting on {topic}:\n1.", "Ingredients for {item} soup:\n*", "TODO:\n- [ ] {name}\n- [ ]",
        "Chapter 1: {Topic}\nChapter 2:"]
ITEMS = ["tomato", "lentil", "pumpkin", "onion", "mushroom", "carrot", "chicken", "bean", "potato", "leek"]


def prompt_set(seed: int, per_kind: int = PER_KIND) -> list[tuple[str, str | list[dict]]]:
    """(kind, prompt) pairs: the fixed prompts and chats, then per_kind generated ones of each kind
    (a chat is a message list for the chat template). Seeded: the same set for the same seed."""
    rng = random.Random(seed)
    fixed = [("fixed", p) for p in PROMPTS] + [("chat", [{"role": "user", "content": c}]) for c in CHATS]
    seen = {p for _, p in fixed if isinstance(p, str)} | set(CHATS)
    out = []
    for kind, templates in (("text", TEXT), ("code", CODE), ("chat", CHAT), ("list", LIST)):
        made = 0
        while made < per_kind:
            name, topic = rng.choice(NAMES), rng.choice(TOPICS)
            camel = "".join(w.capitalize() for w in name.split("_"))
            text = rng.choice(templates).format(topic=topic, Topic=topic[0].upper() + topic[1:], thing=rng.choice(THINGS),
                                                name=name, camel=camel[0].lower() + camel[1:], Camel=camel,
                                                item=rng.choice(ITEMS))
            if text in seen:
                continue
            seen.add(text)
            out.append((kind, [{"role": "user", "content": text}] if kind == "chat" else text))
            made += 1
    return fixed + out


def build_models(modes: list[str]):
    from iterserve.engine.attention.backend import get_backend
    from iterserve.engine.model.architectures import model_class
    from iterserve.engine.model.loader import load_model
    from iterserve.engine.model.quant import effective_mode
    from iterserve.engine.model.registry import resolve_model_path
    from iterserve.engine.model.tokenizer import Tokenizer

    path = resolve_model_path(None)[0]
    loaded = load_model(path, show_progress=False, keep_q4_1=True, keep_blocks=True)
    models = {mode: model_class(loaded.config).from_weights(
        loaded.config, dict(loaded.weights), get_backend("torch"), torch.device("cpu"), torch.float32,
        max_positions=1024, quantization=effective_mode(mode, True, torch.device("cpu"), "auto"),
        q4_1=dict(loaded.q4_1), gguf_blocks=dict(loaded.gguf_blocks))
        for mode in modes}
    return models, Tokenizer.from_gguf(path), path


def caches(model, blocks: int):
    cfg = model.config
    return [(torch.zeros(blocks, 16, cfg.num_kv_heads, cfg.head_dim),
             torch.zeros(blocks, 16, cfg.num_kv_heads, cfg.head_dim)) for _ in range(cfg.num_layers)]


def greedy(model, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Greedy continuations of all prompts together: one prefill of them all, then a token each per step."""
    from iterserve.engine.attention.backend import AttentionMetadata

    per_seq = -(-(max(map(len, prompts)) + new_tokens) // 16)
    pool = caches(model, per_seq * len(prompts))
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(prompts))]
    seqs, fed = [list(p) for p in prompts], [0] * len(prompts)
    for _ in range(new_tokens):
        query_lens = [len(seq) - done for seq, done in zip(seqs, fed, strict=True)]
        meta = AttentionMetadata.build(query_lens, [len(seq) for seq in seqs], tables, 16)
        hidden = model(torch.tensor([t for seq, done in zip(seqs, fed, strict=True) for t in seq[done:]]),
                       torch.tensor([p for seq, done in zip(seqs, fed, strict=True) for p in range(done, len(seq))]),
                       pool, meta)
        last = torch.tensor(list(itertools.accumulate(query_lens))) - 1
        fed = [len(seq) for seq in seqs]
        for seq, token in zip(seqs, model.compute_logits(hidden[last]).argmax(-1).tolist(), strict=True):
            seq.append(token)
    return [seq[len(p):] for seq, p in zip(seqs, prompts, strict=True)]


def forced_logits(model, sequences: list[list[int]], positions: int, group: int = 16) -> list[torch.Tensor]:
    """Per sequence, the logits predicting its last `positions` tokens: `group` sequences per prefill, each
    whole (a row's linears do not depend on the other rows of the call)."""
    from iterserve.engine.attention.backend import AttentionMetadata

    out = []
    for start in range(0, len(sequences), group):
        part = sequences[start:start + group]
        per_seq = -(-max(map(len, part)) // 16)
        tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(part))]
        lengths = [len(s) for s in part]
        meta = AttentionMetadata.build(lengths, lengths, tables, 16)
        hidden = model(torch.tensor([t for s in part for t in s]),
                       torch.tensor([p for n in lengths for p in range(n)]), caches(model, per_seq * len(part)), meta)
        ends = list(itertools.accumulate(lengths))
        rows = torch.tensor([e - 1 - positions + i for e in ends for i in range(positions)])
        out.extend(model.compute_logits(hidden[rows]).float().split(positions))
    return out


def tokens_before_divergence(exact: list[list[int]], got: list[list[int]]) -> list[int]:
    return [next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
            for a, b in zip(exact, got, strict=True)]


# -- statistics over prompts ---------------------------------------------------------------------------

BOOTSTRAP = 10_000


def interval(values, seed: int = 0, ratio_of=None) -> list[float]:
    """Bootstrap 95% interval (percentiles of BOOTSTRAP resamples of the prompts) of the mean of values,
    or of sum(values) / sum(ratio_of) when ratio_of is given (the same prompts resampled in both)."""
    v = np.asarray(values, dtype=np.float64)
    picks = np.random.default_rng(seed).integers(0, len(v), (BOOTSTRAP, len(v)))
    stats = v[picks].mean(1) if ratio_of is None else v[picks].sum(1) / np.asarray(ratio_of, np.float64)[picks].sum(1)
    return [float(np.percentile(stats, 2.5)), float(np.percentile(stats, 97.5))]


def figures(exact: list[list[int]], got: list[list[int]], agree: list[int], positions: int) -> dict:
    """A system's free-running and teacher-forced figures, with their intervals and the per-prompt values."""
    before = tokens_before_divergence(exact, got)
    same = [int(a == b) for a, b in zip(exact, got, strict=True)]
    return {"free_running": {"exact": sum(same), "prompts": len(same), "exact_ci95": interval(same),
                             "mean_tokens_before_divergence": sum(before) / len(before),
                             "mean_ci95": interval(before), "tokens_before_divergence": before},
            "teacher_forced": {"agree": sum(agree), "positions": positions * len(agree),
                               "agreement": sum(agree) / (positions * len(agree)),
                               "agreement_ci95": interval(agree, ratio_of=[positions] * len(agree)),
                               "agree_per_prompt": agree}}


def paired(mine: dict, theirs: dict, tokens: int) -> dict:
    """Per prompt, mine minus theirs: tokens before divergence, identical continuations (0/1) and positions
    agreeing fed the exact prefix (as a share of them); each mean with its bootstrap 95% interval, and the
    prompts where mine is ahead, behind and equal."""
    def per_prompt(entry: dict) -> dict[str, list[float]]:
        before = entry["free_running"]["tokens_before_divergence"]
        return {"tokens_before_divergence": before, "identical": [float(b == tokens) for b in before],
                "agreement": [a / tokens for a in entry["teacher_forced"]["agree_per_prompt"]]}

    a, b = per_prompt(mine), per_prompt(theirs)
    out = {}
    for name in a:
        diff = [x - y for x, y in zip(a[name], b[name], strict=True)]
        out[name] = {"mean": sum(diff) / len(diff), "ci95": interval(diff), "ahead": sum(d > 0 for d in diff),
                     "behind": sum(d < 0 for d in diff), "equal": sum(d == 0 for d in diff)}
    return out


# -- ablations of auto ---------------------------------------------------------------------------------


class EmulatedLinear:
    """y = x @ W.T with W the file's weights (dequantized) and x block-quantized in torch, a variant of the
    kernel's quantizer: `block` values a scale, ties to even (the kernel's rule and llama.cpp's AVX2 path)
    or away from zero (llama.cpp's reference quantize_row_q8_*_ref), and `llama` as llama.cpp's AVX2
    quantize_row_q8_0/q8_1 store a block: q = round(x * (127 / amax)), the scale d = amax / 127 rounded to
    fp16, and for weights with a minimum (Q4_1, ...) the block sum s = d * sum(q) rounded to fp16 (the
    minimum's term is m * s). The product runs on MKL in fp32: a different summation order from the
    kernel's (which is what `ours_emulated` measures)."""

    def __init__(self, layer, block: int = 32, ties_away: bool = False, llama: bool = False):
        from iterserve.engine.model import cpu_gguf

        self.weight = layer.dense
        self.block, self.ties_away, self.llama = block, ties_away, llama
        self.wmin = None  # [N, K/32]: the minimum per 32 weights, where every part has one
        if llama:
            mins = [cpu_gguf.unpack(b, t)[2] for t, b in layer.parts]
            if all(m is not None and m.dim() == 2 for m in mins):
                self.wmin = torch.cat(mins)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows, k = x.shape
        v = x.float().reshape(rows, k // self.block, self.block)
        amax = v.abs().amax(-1, keepdim=True)
        d = amax / 127.0
        if self.llama:
            inverse = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
        else:
            inverse = torch.where(amax > 0, torch.ones_like(d) / d, torch.zeros_like(d))
        scaled = (v * inverse).double()
        q = (torch.sign(scaled) * torch.floor(scaled.abs() + 0.5) if self.ties_away else torch.round(scaled))
        q = q.clamp(-127, 127).float()
        scale = d.half().float() if self.llama else d
        y = (q * scale).reshape(rows, k) @ self.weight.t()
        if self.wmin is not None:  # m * fp16(d * sum q) where the dense product has m * d16 * sum q
            sums = q.reshape(rows, k // 32, 32).sum(-1)
            s16 = (d.reshape(rows, -1) * sums).half().float()
            y = y + (s16 - scale.reshape(rows, -1) * sums) @ self.wmin.t()
        return y


GROUPS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
ABLATIONS = {
    "fused_ops_off": "torch's norms, rotary and SiLU (as `none` runs them) instead of the fused C kernels",
    "lm_head_exact": "the LM head (Q8_0) on fp32 activations (the dequantized weight)",
    **{f"{g}_exact": f"every layer's {g} on fp32 activations (the dequantized weight)" for g in GROUPS},
    "ours_emulated": "every block linear: the kernel's quantizer (blocks of 32, fp32 scale, ties to even) in "
                     "torch, summed by MKL in fp32: the kernel's summation order against another",
    "ties_away": "as ours_emulated, ties rounded away from zero (llama.cpp's reference quantizer)",
    "llama_quantizer": "as ours_emulated, the blocks stored as llama.cpp's AVX2 quantize_row_q8_0/q8_1 store "
                       "them: q = round(x * 127 / amax), fp16 scale, fp16 block sum for Q4_1's minimum",
    "blocks_of_64": "as ours_emulated, activation blocks of 64",
    "blocks_of_192": "as ours_emulated, activation blocks of 192 (llama.cpp quantizes the activations of "
                     "K-quant weights as Q8_K, blocks of 256; SmolLM2's 576 is no multiple of 256)",
}


@contextlib.contextmanager
def ablated(model, name: str):
    """The auto model with one part changed (ABLATIONS[name]) for the with block."""
    from iterserve.engine.model.quant import GGUFLinear

    saved = [(layer, {g: getattr(layer, g) for g in GROUPS}) for layer in model.layers]
    saved_head, saved_fused = model.lm_head, model.fused

    def replace(make, groups=GROUPS, head=True):
        for layer in model.layers:
            for g in groups:
                if isinstance(getattr(layer, g), GGUFLinear):
                    setattr(layer, g, make(getattr(layer, g)))
        if head and isinstance(model.lm_head, GGUFLinear):
            model.lm_head = make(model.lm_head)

    try:
        if name == "fused_ops_off":
            model.fused = False
        elif name == "lm_head_exact":
            model.lm_head = model.lm_head.dense
        elif name.removesuffix("_exact") in GROUPS:
            replace(lambda layer: layer.dense, groups=(name.removesuffix("_exact"),), head=False)
        elif name == "ours_emulated":
            replace(EmulatedLinear)
        elif name == "ties_away":
            replace(lambda layer: EmulatedLinear(layer, ties_away=True))
        elif name == "llama_quantizer":
            replace(lambda layer: EmulatedLinear(layer, llama=True))
        elif name.startswith("blocks_of_"):
            replace(lambda layer: EmulatedLinear(layer, block=int(name.removeprefix("blocks_of_"))))
        else:
            raise ValueError(f"unknown ablation {name!r}: one of {', '.join(ABLATIONS)}")
        yield model
    finally:
        for layer, groups in saved:
            for g, weight in groups.items():
                setattr(layer, g, weight)
        model.lm_head, model.fused = saved_head, saved_fused


# -- llama.cpp ---------------------------------------------------------------------------------------


def find_llama_server(explicit: str | None, build: bool) -> Path | None:
    """The llama-server binary: given, cached or on PATH, else built (bench/peers/compare.py's build and
    cache), or None with --no-build."""
    from bench.peers import compare

    binary, how = compare.find_llama_server(explicit, build)
    print(f"llama.cpp: {how}", file=sys.stderr, flush=True)
    return binary


def _post(port: int, body: dict) -> dict:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/completion", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.load(response)


def llama_cpp(binary: Path, model: Path, prompts: list[list[int]], exact: list[list[int]],
              new_tokens: int) -> tuple[list[list[int]], list[int], dict]:
    """(greedy ids per prompt, positions agreeing fed the exact prefix per prompt, how the server ran)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryFile() as log:
        command = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-t", "2", "-c", "4096",
                   "-np", "1", "--no-warmup"]
        server = subprocess.Popen(command, stdout=log, stderr=log)
        try:
            deadline = time.monotonic() + 120
            while True:
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                    break
                except OSError:
                    if time.monotonic() > deadline or server.poll() is not None:
                        log.seek(0)
                        tail = log.read().decode(errors="replace")[-2000:]
                        raise SystemExit(f"llama-server did not start:\n{tail}") from None
                    time.sleep(0.5)
            greedy_ids, agree = [], []
            # greedy past the end-of-sequence token, as the engine's greedy() above runs
            base = {"temperature": 0, "top_k": 1, "return_tokens": True, "samplers": ["top_k"], "ignore_eos": True}
            for prompt, reference in zip(prompts, exact, strict=True):
                out = _post(port, {**base, "prompt": prompt, "n_predict": new_tokens, "cache_prompt": False})
                greedy_ids.append(list(out["tokens"])[:new_tokens])
                hits = 0
                for i, token in enumerate(reference):  # the prefix cached: one new token each
                    got = _post(port, {**base, "prompt": prompt + reference[:i], "n_predict": 1,
                                       "cache_prompt": True})["tokens"]
                    hits += bool(got) and got[0] == token
                agree.append(hits)
            return greedy_ids, agree, {"binary": str(binary), "threads": 2,
                                       "command": "llama-server -m <gguf> -t 2 -c 4096 -np 1"}
        finally:
            server.terminate()
            server.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=32, help="greedy tokens per prompt")
    parser.add_argument("--seed", type=int, default=0, help="seed of the generated prompts and the bootstrap")
    parser.add_argument("--per-kind", type=int, default=PER_KIND,
                        help="generated prompts of each kind (free text, code, chat, list) besides the fixed 37")
    parser.add_argument("--modes", default="auto,w8a8,int8,int4", help="modes compared with none (auto: the file's blocks)")
    parser.add_argument("--ablate", nargs="?", const=",".join(ABLATIONS), default="",
                        help=f"run auto with each of these parts changed (default all: {', '.join(ABLATIONS)})")
    parser.add_argument("--llama-server", help="a llama-server binary (default: bench/peers' cache, PATH, or built)")
    parser.add_argument("--no-build", action="store_true", help="skip llama.cpp when no binary is found")
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    modes = [m for m in args.modes.split(",") if m]
    ablations = [a for a in args.ablate.split(",") if a]
    for name in ablations:
        if name not in ABLATIONS:
            raise SystemExit(f"--ablate: unknown {name!r}; one of {', '.join(ABLATIONS)}")
    if ablations and "auto" not in modes:
        raise SystemExit("--ablate changes parts of auto: keep auto in --modes")
    started, seconds = time.monotonic(), {}
    # llama.cpp is found, or built (tens of minutes once per machine), while the modes run
    finding = concurrent.futures.ThreadPoolExecutor(1).submit(find_llama_server, args.llama_server, not args.no_build)
    models, tokenizer, path = build_models(["none", *modes])
    chosen = prompt_set(args.seed, args.per_kind)
    kinds = [kind for kind, _ in chosen]
    prompts = [tokenizer.encode(tokenizer.apply_chat_template(p) if isinstance(p, list) else p) for _, p in chosen]
    france = next(i for i, (_, p) in enumerate(chosen) if isinstance(p, list) and p[0]["content"] == FRANCE)
    tokens = args.tokens
    result = {"model": path.name, "prompts": len(prompts), "prompt_kinds": {k: kinds.count(k) for k in dict.fromkeys(kinds)},
              "seed": args.seed, "tokens": tokens, "bootstrap_resamples": BOOTSTRAP, "france_prompt": FRANCE,
              "modes": {}}

    def stage(name: str, since: float) -> None:
        seconds[name] = round(time.monotonic() - since, 1)
        result["seconds"] = {**seconds, "total": round(time.monotonic() - started, 1)}
        common.write_json(args.json, result)

    with torch.inference_mode():
        since = time.monotonic()
        exact = greedy(models["none"], prompts, tokens)
        sequences = [p + r for p, r in zip(prompts, exact, strict=True)]
        wanted_logits = forced_logits(models["none"], sequences, tokens)
        wanted = [w.argmax(-1) for w in wanted_logits]
        result["modes"]["none"] = {"note": "the exact model: the reference of every figure",
                                   "france_answer": tokenizer.decode(exact[france])}
        stage("none", since)

        def measure(model) -> dict:
            got = greedy(model, prompts, tokens)
            have = forced_logits(model, sequences, tokens)
            entry = figures(exact, got, [int((w == h.argmax(-1)).sum()) for w, h in zip(wanted, have, strict=True)],
                            tokens)
            entry["teacher_forced"]["max_logit_error"] = max(
                float((w - h).abs().max()) for w, h in zip(wanted_logits, have, strict=True))
            entry["france_answer"] = tokenizer.decode(got[france])
            return entry

        for mode in modes:
            since = time.monotonic()
            result["modes"][mode] = measure(models[mode])
            print(f"{mode}: {summary(result['modes'][mode])}", flush=True)
            stage(mode, since)

    binary = finding.result()
    if binary is None:
        result["llama_cpp"] = {"skipped": "no llama-server binary and --no-build"}
        print("llama.cpp: skipped, no llama-server binary", file=sys.stderr)
    else:
        since = time.monotonic()
        got, agree, server = llama_cpp(binary, path, prompts, exact, tokens)
        entry = result["llama_cpp"] = {**figures(exact, got, agree, tokens), "server": server,
                                       "france_answer": tokenizer.decode(got[france])}
        print(f"llama.cpp: {summary(entry)}", flush=True)
        result["paired_with_llama_cpp"] = {f"{mode} - llama.cpp": paired(result["modes"][mode], entry, tokens)
                                           for mode in modes}
        stage("llama.cpp", since)

    if ablations:
        result["ablations"] = {}
        with torch.inference_mode():
            for name in ablations:
                since = time.monotonic()
                with ablated(models["auto"], name) as model:
                    entry = measure(model)
                entry = {"change": ABLATIONS[name], **entry, "minus_auto": paired(entry, result["modes"]["auto"], tokens)}
                if "paired_with_llama_cpp" in result:
                    entry["minus_llama_cpp"] = paired(entry, result["llama_cpp"], tokens)
                result["ablations"][name] = entry
                diff = entry["minus_auto"]
                print(f"ablation {name}: {summary(entry)}; minus auto: "
                      f"{diff['tokens_before_divergence']['mean']:+.2f} tokens {diff['tokens_before_divergence']['ci95']}, "
                      f"{diff['agreement']['mean']:+.4f} agreement {diff['agreement']['ci95']}", flush=True)
                stage(f"ablation {name}", since)

    systems = {**{m: e for m, e in result["modes"].items() if "free_running" in e},
               **({"llama.cpp": result["llama_cpp"]} if "free_running" in result["llama_cpp"] else {})}
    result["mean_tokens_before_divergence_by_kind"] = {
        system: {kind: float(np.mean([b for b, k in zip(e["free_running"]["tokens_before_divergence"], kinds,
                                                         strict=True) if k == kind]))
                 for kind in result["prompt_kinds"]}
        for system, e in systems.items()}
    stage("summary", time.monotonic())


def summary(entry: dict) -> str:
    free, forced = entry["free_running"], entry["teacher_forced"]
    error = f", max logit error {forced['max_logit_error']:.2f}" if "max_logit_error" in forced else ""
    low, high = free["mean_ci95"]
    return (f"{free['exact']}/{free['prompts']} exact, {free['mean_tokens_before_divergence']:.2f} [{low:.2f}, "
            f"{high:.2f}] tokens before divergence; fed the exact prefix {forced['agree']}/{forced['positions']}"
            f"{error}; France: {entry['france_answer'][:60]!r}")


if __name__ == "__main__":
    main()
