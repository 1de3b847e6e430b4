"""Accuracy of each --quantization mode on the embedded SmolLM2-135M against the exact model (`none`:
the GGUF's weights dequantized to fp32), side by side with llama.cpp on the same prompts, in the two
forms that matter:

- free-running greedy text, the form a user sees: every prompt continued greedily for --tokens
  tokens by each mode (all prompts in one batch, one token each per step, as the engine runs them);
  per mode the prompts whose continuation equals the exact one, and the mean number of tokens
  before the first divergence;
- per position with the exact prefix fed (teacher-forced): each prompt plus the exact continuation
  in one prefill; the share of positions where the mode's argmax is the exact model's, and the
  largest |logit error|.

llama.cpp's `llama-server` serves the same GGUF file on 127.0.0.1 (built from the llama-cpp-python
sdist and cached as bench/peers/compare.py does, unless --llama-server or --no-build): its greedy
token ids (`return_tokens`) free-running from the same prompt ids, and its argmax fed the exact
prefix (n_predict 1 per prefix). Each system's answer to the chat "What is the capital of France?"
is recorded as text.

    .venv/bin/python -m bench.kernels.gguf_accuracy --json docs/perf/gguf_accuracy.json
"""

from __future__ import annotations

import argparse
import concurrent.futures
import itertools
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

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


def build_models(modes: list[str]):
    from iterserve.engine.attention.backend import get_backend
    from iterserve.engine.model.architectures import model_class
    from iterserve.engine.model.loader import load_model
    from iterserve.engine.model.quant import effective_mode
    from iterserve.engine.model.registry import resolve_model_path
    from iterserve.engine.model.tokenizer import Tokenizer

    path = resolve_model_path(None)[0]
    loaded = load_model(path, show_progress=False, keep_blocks=True)
    models = {mode: model_class(loaded.config).from_weights(
        loaded.config, dict(loaded.weights), get_backend("torch"), torch.device("cpu"), torch.float32,
        max_positions=1024, quantization=effective_mode(mode, True, torch.device("cpu"), "auto"),
        gguf_blocks=dict(loaded.gguf_blocks))
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


def forced_logits(model, tokens: list[int], positions: int) -> torch.Tensor:
    """Logits predicting each of the last `positions` tokens, the whole sequence in one prefill."""
    from iterserve.engine.attention.backend import AttentionMetadata

    blocks = -(-len(tokens) // 16)
    meta = AttentionMetadata.build([len(tokens)], [len(tokens)], [list(range(blocks))], 16)
    hidden = model(torch.tensor(tokens), torch.arange(len(tokens)), caches(model, blocks), meta)
    return model.compute_logits(hidden[-positions - 1:-1]).float()


def free_running(exact: list[list[int]], got: list[list[int]]) -> dict:
    before = []
    for a, b in zip(exact, got, strict=True):
        first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        before.append(first)
    return {"exact": sum(a == b for a, b in zip(exact, got, strict=True)), "prompts": len(exact),
            "mean_tokens_before_divergence": sum(before) / len(before), "tokens_before_divergence": before}


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


def llama_cpp(binary: Path, model: Path, prompts: list[list[int]], exact: list[list[int]], new_tokens: int) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryFile() as log:
        server = subprocess.Popen([str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
                                   "-t", "2", "-c", "4096", "--no-warmup"], stdout=log, stderr=log)
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
            greedy_ids, agree, total = [], 0, 0
            # greedy past the end-of-sequence token, as the engine's greedy() above runs
            base = {"temperature": 0, "top_k": 1, "return_tokens": True, "cache_prompt": False, "samplers": ["top_k"],
                    "ignore_eos": True}
            for prompt, reference in zip(prompts, exact, strict=True):
                out = _post(port, {**base, "prompt": prompt, "n_predict": new_tokens})
                greedy_ids.append(list(out["tokens"])[:new_tokens])
                for i, token in enumerate(reference):
                    got = _post(port, {**base, "prompt": prompt + reference[:i], "n_predict": 1})["tokens"]
                    agree += bool(got) and got[0] == token
                    total += 1
            return {"free_running": free_running(exact, greedy_ids), "greedy_ids": greedy_ids,
                    "teacher_forced": {"agree": agree, "positions": total, "agreement": agree / total},
                    "server": {"binary": str(binary), "threads": 2, "command": "llama-server -m <gguf> -t 2 -c 4096"}}
        finally:
            server.terminate()
            server.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=32, help="greedy tokens per prompt")
    parser.add_argument("--modes", default="auto,w8a8", help="modes compared with none (auto: the file's blocks)")
    parser.add_argument("--llama-server", help="a llama-server binary (default: bench/peers' cache, PATH, or built)")
    parser.add_argument("--no-build", action="store_true", help="skip llama.cpp when no binary is found")
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    modes = args.modes.split(",")
    started = time.monotonic()
    # llama.cpp is found, or built (tens of minutes once per machine), while the modes run
    finding = concurrent.futures.ThreadPoolExecutor(1).submit(find_llama_server, args.llama_server, not args.no_build)
    models, tokenizer, path = build_models(["none", *modes])
    chats = [tokenizer.apply_chat_template([{"role": "user", "content": c}]) for c in CHATS]
    prompts = [tokenizer.encode(p) for p in PROMPTS + chats]
    france = len(PROMPTS) + CHATS.index(FRANCE)
    with torch.inference_mode():
        exact = greedy(models["none"], prompts, args.tokens)
        wanted = [forced_logits(models["none"], p + r, len(r)) for p, r in zip(prompts, exact, strict=True)]
        result = {"model": path.name, "prompts": len(prompts), "tokens": args.tokens,
                  "france_prompt": FRANCE, "modes": {"none": {
                      "note": "the exact model: the reference of every figure",
                      "france_answer": tokenizer.decode(exact[france])}}}
        for mode in modes:
            got = greedy(models[mode], prompts, args.tokens)
            agree, total, worst = 0, 0, 0.0
            for prompt, reference, want in zip(prompts, exact, wanted, strict=True):
                have = forced_logits(models[mode], prompt + reference, len(reference))
                agree += int((want.argmax(-1) == have.argmax(-1)).sum())
                total += len(reference)
                worst = max(worst, float((want - have).abs().max()))
            result["modes"][mode] = {"free_running": free_running(exact, got),
                                     "teacher_forced": {"agree": agree, "positions": total, "agreement": agree / total,
                                                        "max_logit_error": worst},
                                     "france_answer": tokenizer.decode(got[france])}
            print(f"{mode}: {summary(result['modes'][mode])}", flush=True)
            common.write_json(args.json, result)  # each mode as it finishes
    binary = finding.result()
    if binary is None:
        result["llama_cpp"] = {"skipped": "no llama-server binary and --no-build"}
        print("llama.cpp: skipped, no llama-server binary", file=sys.stderr)
    else:
        result["llama_cpp"] = llama_cpp(binary, path, prompts, exact, args.tokens)
        result["llama_cpp"]["france_answer"] = tokenizer.decode(result["llama_cpp"].pop("greedy_ids")[france])
        print(f"llama.cpp: {summary(result['llama_cpp'])}", flush=True)
    result["seconds"] = time.monotonic() - started
    common.write_json(args.json, result)


def summary(entry: dict) -> str:
    free, forced = entry["free_running"], entry["teacher_forced"]
    error = f", max logit error {forced['max_logit_error']:.2f}" if "max_logit_error" in forced else ""
    return (f"{free['exact']}/{free['prompts']} exact, {free['mean_tokens_before_divergence']:.1f} tokens before "
            f"divergence; fed the exact prefix {forced['agree']}/{forced['positions']}{error}; "
            f"France: {entry['france_answer']!r}")


if __name__ == "__main__":
    main()
