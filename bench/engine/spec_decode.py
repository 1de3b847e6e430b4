"""Speculative decoding (n-gram prompt lookup) on vs off, in one run, on the embedded model.

Three chat workloads: code editing (rewrite a given function: the answer repeats much of the
prompt), summarisation (a passage, then "summarise"), free chat (short open questions). Each runs
closed-loop at concurrency 1, 4, 16 and 64 (max_num_seqs = concurrency, all requests queued at
once), greedy, once with --speculative-config off and once on (the default policy: proposals only
while at most disable_by_batch_size sequences run), alternating which goes first. Reported per
cell: generated tokens per second, ITL p50/p95 (per token: the gap between a request's
consecutive outputs divided by the tokens the later one carried, as a streaming client sees it),
the acceptance rate (accepted / proposed tokens), the mean tokens per verification round, and the
speed-up on/off. The outputs on and off are compared token for token (greedy is lossless).

The machine's load average is recorded; figures on a shared machine are noisy, compare ratios
within one run.

    python -m bench.engine.spec_decode --json docs/perf/spec_decode.json --plot docs/perf/spec_decode.png
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from bench import common
from bench.engine import systems
from iterserve.engine.loadgen import percentiles
from iterserve.engine.sampling_params import SamplingParams

CONCURRENCY = (1, 4, 16, 64)
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
FUNCTIONS = [
    "def total_price(items, tax_rate):\n    total = 0\n    for item in items:\n        total = total + item.price * "
    "item.quantity\n    total = total + total * tax_rate\n    return total\n",
    "def read_config(path):\n    result = {}\n    with open(path) as handle:\n        for line in handle:\n"
    "            key, value = line.strip().split('=')\n            result[key] = value\n    return result\n",
    "def count_words(text):\n    counts = {}\n    for word in text.split():\n        word = word.lower()\n"
    "        counts[word] = counts.get(word, 0) + 1\n    return counts\n",
    "def find_max(numbers):\n    best = numbers[0]\n    for number in numbers:\n        if number > best:\n"
    "            best = number\n    return best\n",
]
EDITS = ["Add type hints to this function and return it in full", "Rename the variables to longer names and return "
         "the whole function", "Add a docstring to this function and return the whole function"]
PASSAGES = [
    "The city council met on Tuesday to discuss the new bus routes. After two hours of debate, members voted to "
    "add three routes connecting the northern suburbs with the city centre. The routes will start in March and "
    "run every fifteen minutes during the day. Residents had asked for better connections for years.",
    "Honeybees communicate the location of flowers through a waggle dance. The angle of the dance relative to "
    "vertical shows the direction of the food relative to the sun, and the length of the waggle shows the "
    "distance. Other bees follow the dancer and then fly out to find the flowers themselves.",
    "The company reported higher sales in the third quarter, driven by strong demand for its new laptops. Profits "
    "rose by twelve percent compared with the same period last year. The chief executive said the firm would "
    "hire two hundred engineers next year and open a new office in Lisbon.",
]
QUESTIONS = ["What is your favourite season and why?", "Give me three tips for sleeping better.",
             "How do airplanes stay in the air?", "What should I cook for dinner tonight?",
             "Why do cats purr?", "Tell me a fun fact about the ocean."]


def workloads(tokenizer) -> dict[str, list[list[int]]]:
    def chat(text: str) -> list[int]:
        return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}]),
                                add_special_tokens=False)

    code = [chat(f"{edit}:\n```python\n{fn}```") for fn in FUNCTIONS for edit in EDITS]
    summary = [chat(f"Summarize this text in two sentences:\n\n{p}") for p in PASSAGES]
    free = [chat(q) for q in QUESTIONS]
    return {"code editing": code, "summarisation": summary, "free chat": free}


def run(engine, prompts: list[list[int]], max_tokens: int) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    ids = [engine.add_request(None, params, p) for p in prompts]
    last: dict[str, float] = {}
    itl: list[float] = []
    outputs: dict[str, list[int]] = {}
    started = time.perf_counter()
    while len(outputs) < len(ids):
        results = engine.step()
        now = time.perf_counter()
        for out in results:
            new = len(out.outputs[0].new_token_ids)
            if new and out.request_id in last:
                itl.extend([(now - last[out.request_id]) / new] * new)
            if new:
                last[out.request_id] = now
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
    seconds = time.perf_counter() - started
    generated = sum(len(outputs[i]) for i in ids)
    stats = engine.stats()
    spread = percentiles(itl)
    p50, p95 = spread["p50"], spread["p95"]
    return {"seconds": seconds, "generated_tokens": generated, "tokens_per_s": generated / seconds,
            "itl_p50_ms": p50 * 1000 if p50 is not None else None,
            "itl_p95_ms": p95 * 1000 if p95 is not None else None, "steps": engine.num_steps,
            "draft_tokens": stats.spec_num_draft_tokens, "accepted_tokens": stats.spec_num_accepted_tokens,
            "drafts": stats.spec_num_drafts, "outputs": [outputs[i] for i in ids]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_common_args(parser)
    parser.add_argument("--max-tokens", type=int, help="tokens per answer (default 96; quick: 40)")
    parser.add_argument("--requests-per-slot", type=int,
                        help="requests per unit of concurrency (default 2; quick: 1); at least 2 requests")
    parser.add_argument("--concurrency", type=int, nargs="+", default=list(CONCURRENCY))
    args = parser.parse_args(argv)
    max_tokens = args.max_tokens or (40 if args.quick else 96)
    per_slot = args.requests_per_slot or (1 if args.quick else 2)
    common.set_threads(args.threads)
    machine = common.machine(args.threads)
    runner = systems.load_runner(max_num_seqs=max(args.concurrency), max_model_len=1024)
    prompts = workloads(runner.tokenizer)
    systems.run_iterserve(systems.iterserve_engine(runner), [common.Request(prompts["free chat"][0], 4)])  # warm-up
    cells = []
    for name, pool in prompts.items():
        for concurrency in args.concurrency:
            count = max(2, per_slot * concurrency)
            batch = [pool[i % len(pool)] for i in range(count)]
            order = ["off", "on"] if len(cells) % 2 == 0 else ["on", "off"]
            result = {}
            for mode in order:
                engine = systems.iterserve_engine(runner, max_num_seqs=concurrency,
                                                  speculative_config=json.dumps(SPEC) if mode == "on" else None)
                result[mode] = run(engine, batch, max_tokens)
            on, off = result["on"], result["off"]
            cell = {"workload": name, "concurrency": concurrency, "requests": count,
                    "identical_outputs": on.pop("outputs") == off.pop("outputs"),
                    "speedup": on["tokens_per_s"] / off["tokens_per_s"],
                    "acceptance_rate": on["accepted_tokens"] / on["draft_tokens"] if on["draft_tokens"] else None,
                    "tokens_per_round": 1 + on["accepted_tokens"] / on["drafts"] if on["drafts"] else None,
                    "on": on, "off": off, "load_1m": os.getloadavg()[0]}
            cells.append(cell)
            print(f"{name:14s} c={concurrency:3d}  off {off['tokens_per_s']:6.1f} tok/s  on {on['tokens_per_s']:6.1f} "
                  f"tok/s  x{cell['speedup']:.2f}  acceptance {cell['acceptance_rate']}  "
                  f"identical {cell['identical_outputs']}", flush=True)
    report = {"benchmark": "spec_decode", "provisional": True, "speculative_config": SPEC,
              "max_tokens": max_tokens, "machine": common.finish_machine(machine), "cells": cells,
              "note": "shared, loaded machine: absolute figures are noisy; compare on/off within a cell",
              "summary": {"mean_speedup_by_concurrency": {
                  c: statistics.mean(x["speedup"] for x in cells if x["concurrency"] == c) for c in args.concurrency},
                  "all_identical": all(x["identical_outputs"] for x in cells)}}
    print(common.format_table(["workload", "conc", "off tok/s", "on tok/s", "speedup", "accept", "ITL p50 off/on ms"],
                              [[x["workload"], x["concurrency"], x["off"]["tokens_per_s"], x["on"]["tokens_per_s"],
                                x["speedup"], x["acceptance_rate"],
                                f"{x['off']['itl_p50_ms']:.0f}/{x['on']['itl_p50_ms']:.0f}"] for x in cells]))
    common.write_json(args.json, report)
    if args.plot:
        plot(cells, args.plot, args.concurrency)
    return 0 if report["summary"]["all_identical"] else 1


def plot(cells: list[dict], path: str, concurrency: list[int]) -> None:
    plt = common.pyplot()
    names = list(dict.fromkeys(x["workload"] for x in cells))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name in names:
        mine = [x for x in cells if x["workload"] == name]
        line, = axes[0].plot([x["concurrency"] for x in mine], [x["speedup"] for x in mine], marker="o", label=name)
        axes[1].plot([x["concurrency"] for x in mine], [x["on"]["itl_p50_ms"] for x in mine], marker="o",
                     color=line.get_color(), label=f"{name}, on")
        axes[1].plot([x["concurrency"] for x in mine], [x["off"]["itl_p50_ms"] for x in mine], marker="x",
                     linestyle="--", color=line.get_color(), label=f"{name}, off")
    axes[0].axhline(1.0, color="grey", linewidth=0.8)
    axes[0].set(xscale="log", xlabel="concurrency", ylabel="tokens/s on / off", title="speculation speed-up")
    axes[1].set(xscale="log", yscale="log", xlabel="concurrency", ylabel="ITL p50 (ms)", title="inter-token latency")
    for ax in axes:
        ax.set_xticks(concurrency, [str(c) for c in concurrency])
        ax.legend(fontsize=7)
    common.save_figure(fig, path)


if __name__ == "__main__":
    sys.exit(main())
