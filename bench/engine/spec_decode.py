"""Speculative decoding (n-gram prompt lookup) on vs off, in one run, on the embedded model.

Three chat workloads: code editing (rewrite a given function: the answer repeats much of the
prompt), summarisation (a passage, then "summarise"), free chat (short open questions). Three modes:

- matrix (default): each workload closed-loop at concurrency 1, 4, 16 and 64 (max_num_seqs =
  concurrency, all requests queued at once), greedy, once with --speculative-config off and once
  on (the default policy: proposals only while at most disable_by_batch_size sequences run),
  alternating which goes first. Reported per cell: generated tokens per second, ITL p50/p95 (per
  token: the gap between a request's consecutive outputs divided by the tokens the later one
  carried, as a streaming client sees it), the acceptance rate (accepted / proposed tokens), the
  mean tokens per verification round, and the speed-up on/off. The outputs on and off are compared
  token for token (greedy is lossless). --quick: concurrency 1 and 4, shorter answers.
- crossover: where speculation stops paying on this machine. Per batch size b (default 1, 2, 3, 4,
  6, 8, 12), b code-editing requests run together for a fixed number of tokens (EOS ignored, so the
  batch stays at b), speculation forced on at every batch size vs off, in alternating rounds;
  reported: decode tokens/s on and off (from the step where every request has its first token to
  the end), per wall second and per CPU second of the engine thread (on a loaded machine the
  latter is far less disturbed), their ratio per round and its median, the acceptance rate. The
  crossover is the smallest b whose median ratio is below 1; the CPU default of
  disable_by_batch_size is the largest b below it (engine/spec_decode/config.py). Also reported:
  the largest b whose mean ratio minus two standard errors is at least 1 (pays beyond the noise).
- offswitch: the off-switch at full batch. 64 requests (all three workloads) at concurrency 64 for
  a fixed number of tokens, speculation on with the default policy (the off-switch engaged) vs off,
  in alternating rounds; reported (wall and CPU time): the decode tokens/s ratio per round pair,
  its mean with a 2-standard-error band, and the round-to-round spread of each side (the noise the
  ratio is within or not).

The machine's load average is recorded; figures on a shared machine are noisy, compare ratios
within one run.

    python -m bench.engine.spec_decode --json docs/perf/spec_decode.json --plot docs/perf/spec_decode.png
    python -m bench.engine.spec_decode --mode crossover --json docs/perf/spec_decode_crossover.json
    python -m bench.engine.spec_decode --mode offswitch --json docs/perf/spec_decode_offswitch.json
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
QUICK_CONCURRENCY = (1, 4)
CROSSOVER_BATCHES = (1, 2, 3, 4, 6, 8, 12)
FULL_BATCH = 64
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


def run(engine, prompts: list[list[int]], max_tokens: int, ignore_eos: bool = False) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    ids = [engine.add_request(None, params, p) for p in prompts]
    last: dict[str, float] = {}
    itl: list[float] = []
    outputs: dict[str, list[int]] = {}
    decode_start, decode_tokens = None, 0  # decode phase: from the step where every request has a token
    decode_cpu_start = None  # the engine thread's CPU time then (torch runs on it with --threads 1)
    before = engine.stats()
    started = time.perf_counter()
    while len(outputs) < len(ids):
        results = engine.step()
        now = time.perf_counter()
        for out in results:
            new = len(out.outputs[0].new_token_ids)
            if new and out.request_id in last:
                itl.extend([(now - last[out.request_id]) / new] * new)
                if decode_start is not None:
                    decode_tokens += new
            if new:
                last[out.request_id] = now
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
        if decode_start is None and len(last) == len(ids):
            decode_start, decode_cpu_start = now, time.thread_time()
    seconds = time.perf_counter() - started
    decode_seconds = time.perf_counter() - decode_start if decode_start is not None else 0.0
    decode_cpu = time.thread_time() - decode_cpu_start if decode_cpu_start is not None else 0.0
    generated = sum(len(outputs[i]) for i in ids)
    stats = engine.stats()
    spread = percentiles(itl)
    p50, p95 = spread["p50"], spread["p95"]
    return {"seconds": seconds, "generated_tokens": generated, "tokens_per_s": generated / seconds,
            "decode_tokens_per_s": decode_tokens / decode_seconds if decode_seconds > 0 and decode_tokens else None,
            "decode_tokens_per_cpu_s": decode_tokens / decode_cpu if decode_cpu > 0 and decode_tokens else None,
            "itl_p50_ms": p50 * 1000 if p50 is not None else None,
            "itl_p95_ms": p95 * 1000 if p95 is not None else None, "steps": engine.num_steps,
            "draft_tokens": stats.spec_num_draft_tokens - before.spec_num_draft_tokens,
            "accepted_tokens": stats.spec_num_accepted_tokens - before.spec_num_accepted_tokens,
            "drafts": stats.spec_num_drafts - before.spec_num_drafts, "outputs": [outputs[i] for i in ids]}


def engine_for(runner, concurrency: int, spec: dict | None):
    return systems.iterserve_engine(runner, max_num_seqs=concurrency,
                                    speculative_config=json.dumps(spec) if spec is not None else None)


CLOCKS = {"wall": "decode_tokens_per_s", "cpu": "decode_tokens_per_cpu_s"}


def rounds(runner, batch: list[list[int]], concurrency: int, spec: dict, max_tokens: int, count: int) -> dict:
    """count rounds of off and on, alternating which goes first; per round both results, and per
    clock (wall time; the engine thread's CPU time, which other processes on a loaded machine
    disturb far less) the on/off ratio of decode tokens per second."""
    per_round = []
    for index in range(count):
        result = {}
        for mode in (("off", "on") if index % 2 == 0 else ("on", "off")):
            result[mode] = run(engine_for(runner, concurrency, spec if mode == "on" else None), batch, max_tokens,
                               ignore_eos=True)
        identical = result["on"].pop("outputs") == result["off"].pop("outputs")
        ratios = {clock: result["on"][key] / result["off"][key] for clock, key in CLOCKS.items()}
        per_round.append({**result, "identical_outputs": identical, "load_1m": os.getloadavg()[0], "ratio": ratios})
        print(f"  c={concurrency:3d} round {index + 1}/{count}: decode tok/s off {result['off']['decode_tokens_per_s']:6.1f}"
              f" on {result['on']['decode_tokens_per_s']:6.1f} (x{ratios['wall']:.3f}); per CPU second off "
              f"{result['off']['decode_tokens_per_cpu_s']:6.1f} on {result['on']['decode_tokens_per_cpu_s']:6.1f} "
              f"(x{ratios['cpu']:.3f})  load {per_round[-1]['load_1m']:.1f}", flush=True)
    drafts = sum(r["on"]["draft_tokens"] for r in per_round)
    cell = {"concurrency": concurrency, "requests": len(batch), "rounds": per_round,
            "acceptance_rate": sum(r["on"]["accepted_tokens"] for r in per_round) / drafts if drafts else None,
            "draft_tokens": drafts, "identical_outputs": all(r["identical_outputs"] for r in per_round)}
    for clock, key in CLOCKS.items():
        ratios = [r["ratio"][clock] for r in per_round]
        on = [r["on"][key] for r in per_round]
        off = [r["off"][key] for r in per_round]
        cell[clock] = {"ratio_median": statistics.median(ratios), "ratio_mean": statistics.mean(ratios),
                       "ratio_min": min(ratios), "ratio_max": max(ratios),
                       "ratio_stdev": statistics.stdev(ratios) if len(ratios) > 1 else None,
                       "ratio_95_half_width": 2 * statistics.stdev(ratios) / len(ratios) ** 0.5
                       if len(ratios) > 1 else None,
                       "on_mean": statistics.mean(on), "off_mean": statistics.mean(off),
                       "on_relative_spread": relative_spread(on), "off_relative_spread": relative_spread(off)}
    return cell


def relative_spread(values: list[float]) -> float | None:
    """Round-to-round noise: the standard deviation over the mean."""
    return statistics.stdev(values) / statistics.mean(values) if len(values) > 1 else None


def crossover(args, runner, prompts) -> dict:
    spec = {**SPEC, "disable_by_batch_size": 1 << 20}  # speculate at every batch size
    max_tokens = args.max_tokens or (32 if args.quick else 48)
    count = args.rounds or (2 if args.quick else 4)
    batches = args.concurrency or ([1, 2, 4] if args.quick else list(CROSSOVER_BATCHES))
    pool = prompts["code editing"]
    cells = []
    for b in batches:
        cells.append(rounds(runner, [pool[i % len(pool)] for i in range(b)], b, spec, max_tokens, count))
        if args.json:  # what is measured so far, in case a long run on a loaded machine is cut short
            common.write_json(args.json, {"benchmark": "spec_decode_crossover", "partial": True, "cells": cells})
    summary = crossover_summary(cells)
    print(common.format_table(
        ["batch", "off tok/s", "on tok/s", "on/off wall", "min", "max", "on/off CPU", "min", "max", "accept"],
        [[c["concurrency"], c["wall"]["off_mean"], c["wall"]["on_mean"], c["wall"]["ratio_median"],
          c["wall"]["ratio_min"], c["wall"]["ratio_max"], c["cpu"]["ratio_median"], c["cpu"]["ratio_min"],
          c["cpu"]["ratio_max"], c["acceptance_rate"]] for c in cells]))
    print(f"crossover (smallest batch whose median on/off < 1): wall {summary['wall']['crossover_batch']}, "
          f"CPU time {summary['cpu']['crossover_batch']}")
    return {"mode": "crossover", "workload": "code editing", "speculative_config": spec, "max_tokens": max_tokens,
            "rounds_per_batch": count, "cells": cells, "summary": summary}


def crossover_summary(cells: list[dict]) -> dict:
    """Per clock: the crossover (the smallest batch whose median on/off ratio is below 1), the
    largest batch below it (the CPU default of disable_by_batch_size), and the largest batch below
    it where speculation pays beyond the noise (mean ratio minus two standard errors of the
    per-round ratios at least 1)."""
    summary = {"all_identical": all(c["identical_outputs"] for c in cells)}
    for clock in CLOCKS:
        losing = [c["concurrency"] for c in cells if c[clock]["ratio_median"] < 1]
        below = [c for c in cells if not losing or c["concurrency"] < losing[0]]
        clear = [c["concurrency"] for c in below
                 if c[clock]["ratio_95_half_width"] is not None
                 and c[clock]["ratio_mean"] - c[clock]["ratio_95_half_width"] >= 1]
        summary[clock] = {"crossover_batch": losing[0] if losing else None,
                          "largest_paying_batch": max((c["concurrency"] for c in below), default=None),
                          "largest_clearly_paying_batch": max(clear, default=None)}
    return summary


def offswitch(args, runner, prompts) -> dict:
    concurrency = (args.concurrency or [FULL_BATCH])[0]
    max_tokens = args.max_tokens or (16 if args.quick else 32)
    count = args.rounds or (2 if args.quick else 4)
    pool = [p for name in prompts for p in prompts[name]]
    batch = [pool[i % len(pool)] for i in range(concurrency)]
    cell = rounds(runner, batch, concurrency, SPEC, max_tokens, count)  # SPEC: the default off-switch
    summary = {"draft_tokens": cell["draft_tokens"], "all_identical": cell["identical_outputs"],
               "within_noise_rule": "|mean ratio - 1| <= 2 x stdev of the per-round ratios / sqrt(rounds)"}
    for clock in CLOCKS:
        stats = cell[clock]
        half = stats["ratio_95_half_width"]
        summary[clock] = {"ratio_mean": stats["ratio_mean"], "ratio_95_half_width": half,
                          "within_noise": half is not None and abs(stats["ratio_mean"] - 1) <= half,
                          "off_relative_spread": stats["off_relative_spread"],
                          "on_relative_spread": stats["on_relative_spread"]}
        print(f"full batch {concurrency}, {clock}: on/off decode tokens/s x{stats['ratio_mean']:.3f} +- {half} "
              f"(rounds {stats['ratio_min']:.3f}-{stats['ratio_max']:.3f}); round-to-round spread off "
              f"{stats['off_relative_spread']}, on {stats['on_relative_spread']}; "
              f"within noise: {summary[clock]['within_noise']}")
    print(f"draft tokens with the off-switch engaged: {cell['draft_tokens']}")
    return {"mode": "offswitch", "workloads": list(prompts), "speculative_config": SPEC, "max_tokens": max_tokens,
            "rounds": count, "cell": cell, "summary": summary}


def matrix(args, runner, prompts) -> dict:
    max_tokens = args.max_tokens or (32 if args.quick else 96)
    per_slot = args.requests_per_slot or (1 if args.quick else 2)
    concurrency = args.concurrency or list(QUICK_CONCURRENCY if args.quick else CONCURRENCY)
    cells = []
    for name, pool in prompts.items():
        for c in concurrency:
            count = max(2, per_slot * c)
            batch = [pool[i % len(pool)] for i in range(count)]
            order = ["off", "on"] if len(cells) % 2 == 0 else ["on", "off"]
            result = {}
            for mode in order:
                result[mode] = run(engine_for(runner, c, SPEC if mode == "on" else None), batch, max_tokens)
            on, off = result["on"], result["off"]
            cell = {"workload": name, "concurrency": c, "requests": count,
                    "identical_outputs": on.pop("outputs") == off.pop("outputs"),
                    "speedup": on["tokens_per_s"] / off["tokens_per_s"],
                    "acceptance_rate": on["accepted_tokens"] / on["draft_tokens"] if on["draft_tokens"] else None,
                    "tokens_per_round": 1 + on["accepted_tokens"] / on["drafts"] if on["drafts"] else None,
                    "on": on, "off": off, "load_1m": os.getloadavg()[0]}
            cells.append(cell)
            print(f"{name:14s} c={c:3d}  off {off['tokens_per_s']:6.1f} tok/s  on {on['tokens_per_s']:6.1f} "
                  f"tok/s  x{cell['speedup']:.2f}  acceptance {cell['acceptance_rate']}  "
                  f"identical {cell['identical_outputs']}", flush=True)
    print(common.format_table(["workload", "conc", "off tok/s", "on tok/s", "speedup", "accept", "ITL p50 off/on ms"],
                              [[x["workload"], x["concurrency"], x["off"]["tokens_per_s"], x["on"]["tokens_per_s"],
                                x["speedup"], x["acceptance_rate"],
                                f"{x['off']['itl_p50_ms']:.0f}/{x['on']['itl_p50_ms']:.0f}"] for x in cells]))
    return {"mode": "matrix", "speculative_config": SPEC, "max_tokens": max_tokens, "requests_per_slot": per_slot,
            "cells": cells,
            "summary": {"mean_speedup_by_concurrency": {
                c: statistics.mean(x["speedup"] for x in cells if x["concurrency"] == c) for c in concurrency},
                "all_identical": all(x["identical_outputs"] for x in cells)}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_common_args(parser)
    parser.add_argument("--mode", choices=("matrix", "crossover", "offswitch"), default="matrix",
                        help="matrix: workloads x concurrency on vs off; crossover: the batch size where "
                             "speculation stops paying; offswitch: full batch, the off-switch engaged vs off")
    parser.add_argument("--max-tokens", type=int,
                        help="tokens per answer (matrix 96, quick 32; crossover 48, quick 32; offswitch 32, quick 16)")
    parser.add_argument("--requests-per-slot", type=int,
                        help="matrix: requests per unit of concurrency (default 2; quick: 1); at least 2 requests")
    parser.add_argument("--rounds", type=int, help="crossover/offswitch: off/on round pairs (default 4; quick: 2)")
    parser.add_argument("--concurrency", type=int, nargs="+",
                        help="matrix: concurrency levels (1 4 16 64; quick: 1 4); crossover: batch sizes "
                             "(1 2 3 4 6 8 12; quick: 1 2 4); offswitch: the full batch (64)")
    args = parser.parse_args(argv)
    common.set_threads(args.threads)
    machine = common.machine(args.threads)
    largest = max(args.concurrency or [FULL_BATCH if args.mode != "crossover" else max(CROSSOVER_BATCHES)])
    runner = systems.load_runner(max_num_seqs=largest, max_model_len=1024)
    prompts = workloads(runner.tokenizer)
    systems.run_iterserve(systems.iterserve_engine(runner), [common.Request(prompts["free chat"][0], 4)])  # warm-up
    started = time.perf_counter()
    result = {"matrix": matrix, "crossover": crossover, "offswitch": offswitch}[args.mode](args, runner, prompts)
    report = {"benchmark": "spec_decode" if args.mode == "matrix" else f"spec_decode_{args.mode}", **result,
              "quick": args.quick, "seconds": time.perf_counter() - started,
              "machine": common.finish_machine(machine),
              "note": ("one run per cell (matrix) or alternating rounds: compare on/off within a cell or round; "
                       "cells where no draft was proposed show the run-to-run noise (the load average is in "
                       "machine and per cell)")}
    common.write_json(args.json, report)
    if args.plot:
        {"matrix": plot, "crossover": plot_crossover, "offswitch": plot_offswitch}[args.mode](report, args.plot)
    return 0 if report["summary"]["all_identical"] else 1


def plot(report: dict, path: str) -> None:
    cells = report["cells"]
    concurrency = sorted({x["concurrency"] for x in cells})
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


def plot_crossover(report: dict, path: str) -> None:
    plt = common.pyplot()
    cells = report["cells"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for cell in cells:
        for clock, color in (("wall", "tab:blue"), ("cpu", "tab:orange")):
            ax.scatter([cell["concurrency"]] * len(cell["rounds"]), [r["ratio"][clock] for r in cell["rounds"]],
                       color=color, s=10, alpha=0.5)
    for clock, color in (("wall", "tab:blue"), ("cpu", "tab:orange")):
        ax.plot([c["concurrency"] for c in cells], [c[clock]["ratio_median"] for c in cells], marker="o", color=color,
                label=f"median, {'wall time' if clock == 'wall' else 'engine CPU time'}")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set(xlabel="batch size", ylabel="decode tokens/s on / off", title="where n-gram speculation stops paying")
    ax.legend()
    common.save_figure(fig, path)


def plot_offswitch(report: dict, path: str) -> None:
    plt = common.pyplot()
    rounds_ = report["cell"]["rounds"]
    fig, ax = plt.subplots(figsize=(6, 4))
    x = range(1, len(rounds_) + 1)
    ax.plot(x, [r["off"]["decode_tokens_per_s"] for r in rounds_], marker="x", label="off, wall")
    ax.plot(x, [r["on"]["decode_tokens_per_s"] for r in rounds_], marker="o", label="on (off-switch engaged), wall")
    ax.plot(x, [r["off"]["decode_tokens_per_cpu_s"] for r in rounds_], marker="x", linestyle="--", label="off, CPU")
    ax.plot(x, [r["on"]["decode_tokens_per_cpu_s"] for r in rounds_], marker="o", linestyle="--", label="on, CPU")
    ax.set(xlabel="round", ylabel="decode tokens per second", title=f"full batch ({report['cell']['concurrency']})")
    ax.legend()
    common.save_figure(fig, path)


if __name__ == "__main__":
    sys.exit(main())
