"""Chunked prefill and tail latency: many short chat requests (Poisson arrivals) with a few long
prompts arriving among them; TTFT of the short requests (p50/p95) with chunked prefill off and on
at several step budgets, plus their inter-token latency and the long prompts' own TTFT.

Every configuration replays the same arrival schedule on the same engine weights. The schedule is
paced from a measured long prefill, so the machine is busy but not overloaded whatever its speed.
Arrival times are the scheduled ones: a request that "arrives" while a step is running waits for
that step, as it would in a server.

    python -m bench.engine.chunked_prefill --json docs/perf/chunked_prefill.json --plot docs/perf/chunked_prefill.png
"""

from __future__ import annotations

import argparse
import itertools
import random
import sys
import time
from collections import defaultdict
from dataclasses import dataclass

from bench import common
from bench.engine import systems
from iterserve.engine.loadgen import PROMPT_TOKEN_RANGE, percentiles

TARGET_CUT = 0.5
MAX_MODEL_LEN = 2048
SHORT_PROMPT = (16, 48)
SHORT_OUTPUT = (8, 24)


@dataclass(frozen=True)
class Arrival:
    at_s: float
    kind: str  # "short" or "long"
    request: common.Request


def configure(parser: argparse.ArgumentParser) -> None:
    common.add_common_args(parser)
    parser.add_argument("--long-len", type=int, help="long prompt tokens (default 1024; quick: 256; at most 2047)")
    parser.add_argument("--long-prompts", type=int, help="long prompts per run (default 3; quick: 1)")
    parser.add_argument("--short-requests", type=int, help="short requests per run (default 30; quick: 6)")
    parser.add_argument("--rounds", type=int, help="replays of the schedule per configuration, in alternating "
                        "order; percentiles pool them (default 2; quick: 1)")
    parser.add_argument("--budgets", help="chunked-prefill step budgets (default 512,256,128; quick: 128)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    configure(parser)
    args = parser.parse_args(argv)
    long_len = args.long_len or (256 if args.quick else 1024)
    if not 0 < long_len < MAX_MODEL_LEN:
        parser.error(f"--long-len must be in [1, {MAX_MODEL_LEN - 1}] (max_model_len {MAX_MODEL_LEN})")
    num_long = args.long_prompts or (1 if args.quick else 3)
    num_short = args.short_requests or (6 if args.quick else 30)
    rounds = args.rounds or (1 if args.quick else 2)
    budgets = [int(b) for b in (args.budgets or ("128" if args.quick else "512,256,128")).split(",")]
    common.set_threads(args.threads)
    machine = common.machine(args.threads)

    runner = systems.load_runner(max_num_seqs=32, max_model_len=MAX_MODEL_LEN)
    configs = {"off": {"chunked_prefill": False, "max_num_batched_tokens": MAX_MODEL_LEN}}
    # Each budget with the engine's default per-prompt chunk cap while others wait, and the largest
    # budget without it, to show what the cap adds to chunking alone.
    configs.update({f"chunk {b}": {"chunked_prefill": True, "max_num_batched_tokens": b} for b in budgets})
    configs[f"chunk {max(budgets)}, no cap"] = {"chunked_prefill": True, "max_num_batched_tokens": max(budgets),
                                                "long_prefill_token_threshold": 0}
    engines = {name: systems.iterserve_engine(runner, **options) for name, options in configs.items()}

    long_prefill_s = _calibrate(engines["off"], long_len)
    arrivals = _schedule(args.seed, long_len, num_long, num_short, long_prefill_s)
    print(f"a {long_len}-token prefill takes {long_prefill_s:.2f} s; {num_long} long prompts and {num_short} "
          f"short requests over {arrivals[-1].at_s:.0f} s per configuration", file=sys.stderr)

    # Rounds alternate the order of the configurations, so a change in the machine's other load
    # during the run does not favour whichever configuration ran first.
    runs: dict[str, list[dict[int, list[float]]]] = {name: [] for name in engines}
    for round_index in range(rounds):
        order = list(engines) if round_index % 2 == 0 else list(reversed(engines))
        for name in order:
            print(f"round {round_index + 1}/{rounds}: chunked prefill {name} ...", file=sys.stderr, flush=True)
            runs[name].append(_replay(engines[name], arrivals))
    results = {name: _summarize(replays, arrivals) for name, replays in runs.items()}
    caps = {name: engine.config.long_prefill_token_threshold for name, engine in engines.items()}
    report = _report(results, arrivals, machine, long_len, long_prefill_s, rounds, caps)
    print(_table(report))
    common.write_json(args.json, report)
    if args.plot:
        _plot(report, args.plot)
    return 0


def _calibrate(engine, long_len: int) -> float:
    rng = random.Random(7)
    warm = common.Request([rng.randint(*PROMPT_TOKEN_RANGE) for _ in range(64)], 2)
    systems.run_iterserve(engine, [warm])
    long = common.Request([rng.randint(*PROMPT_TOKEN_RANGE) for _ in range(long_len)], 1)
    return systems.run_iterserve(engine, [long]).seconds


def _schedule(seed: int, long_len: int, num_long: int, num_short: int, long_prefill_s: float) -> list[Arrival]:
    """Long prompts every 3 long-prefill times, the first after 1; short requests spread over the
    same span as a Poisson process."""
    rng = random.Random(seed)
    span = 3 * long_prefill_s * num_long
    arrivals = [Arrival(long_prefill_s * (1 + 3 * k), "long",
                        common.Request([rng.randint(*PROMPT_TOKEN_RANGE) for _ in range(long_len)], 8))
                for k in range(num_long)]
    t = 0.0
    for _ in range(num_short):
        t += rng.expovariate(num_short / span)
        prompt = [rng.randint(*PROMPT_TOKEN_RANGE) for _ in range(rng.randint(*SHORT_PROMPT))]
        arrivals.append(Arrival(t, "short", common.Request(prompt, rng.randint(*SHORT_OUTPUT))))
    return sorted(arrivals, key=lambda a: a.at_s)


def _replay(engine, arrivals: list[Arrival]) -> dict[int, list[float]]:
    """Feed the arrivals in real time; returns each arrival's token times, relative to its arrival."""
    pending = list(reversed(range(len(arrivals))))
    ids: dict[str, int] = {}
    token_times: dict[int, list[float]] = defaultdict(list)
    start = engine.clock()
    while pending or engine.has_unfinished_requests():
        now = engine.clock()
        while pending and arrivals[pending[-1]].at_s <= now - start:
            index = pending.pop()
            arrival = arrivals[index]
            request_id = engine.add_request(None, systems.params_for(arrival.request),
                                            arrival.request.prompt_token_ids, arrival_time=start + arrival.at_s)
            ids[request_id] = index
        if not engine.has_unfinished_requests():
            time.sleep(min(0.05, max(0.0, arrivals[pending[-1]].at_s - (now - start))))
            continue
        outputs = engine.step()
        now = engine.clock()
        for output in outputs:
            if output.outputs[0].new_token_ids:
                index = ids[output.request_id]
                token_times[index].append(now - start - arrivals[index].at_s)
    return token_times


def _summarize(replays: list[dict[int, list[float]]], arrivals: list[Arrival]) -> dict:
    out = {}
    for kind in ("short", "long"):
        indexes = [i for i, a in enumerate(arrivals) if a.kind == kind]
        for token_times in replays:
            for i in indexes:
                if len(token_times[i]) != arrivals[i].request.output_len:
                    raise RuntimeError(f"request {i} produced {len(token_times[i])} tokens, "
                                       f"expected {arrivals[i].request.output_len}")
        ttft = [token_times[i][0] for token_times in replays for i in indexes]
        itl = [b - a for token_times in replays for i in indexes for a, b in itertools.pairwise(token_times[i])]
        out[kind] = {"requests": len(indexes), "samples": len(ttft), "ttft_s": percentiles(ttft),
                     "itl_s": percentiles(itl), "ttft_samples_s": ttft}
    return out


def _report(results: dict, arrivals: list[Arrival], machine: dict, long_len: int, long_prefill_s: float,
            rounds: int, caps: dict[str, int]) -> dict:
    off_p95 = results["off"]["short"]["ttft_s"]["p95"]
    for result in results.values():
        p95 = result["short"]["ttft_s"]["p95"]
        result["short_p95_ttft_cut_vs_off"] = 1 - p95 / off_p95 if off_p95 else None
    shipped = [n for n in results if n != "off"]
    best_name = max(shipped, key=lambda n: results[n]["short_p95_ttft_cut_vs_off"])
    best = results[best_name]["short_p95_ttft_cut_vs_off"]
    return {
        "benchmark": "chunked_prefill",
        "workload": {"long_prompt_tokens": long_len, "long_prompts": sum(a.kind == "long" for a in arrivals),
                     "short_requests": sum(a.kind == "short" for a in arrivals),
                     "short_prompt_tokens": list(SHORT_PROMPT), "short_output_tokens": list(SHORT_OUTPUT),
                     "long_prefill_s": long_prefill_s, "span_s": arrivals[-1].at_s, "max_model_len": MAX_MODEL_LEN,
                     "rounds": rounds},
        "machine": common.finish_machine(machine),
        "configs": results,
        "prefill_caps": caps,
        "targets": {"short p95 TTFT cut by chunked prefill": {
            "target_at_least": TARGET_CUT, "best_config": best_name, "measured": best, "met": best >= TARGET_CUT}},
    }


def _table(report: dict) -> str:
    rows = []
    for name, r in report["configs"].items():
        short, long = r["short"], r["long"]
        rows.append([name, short["ttft_s"]["p50"] * 1e3, short["ttft_s"]["p95"] * 1e3,
                     short["itl_s"]["p50"] * 1e3, short["itl_s"]["p95"] * 1e3, long["ttft_s"]["p50"] * 1e3,
                     None if name == "off" else r["short_p95_ttft_cut_vs_off"] * 100])
    table = common.format_table(["chunked prefill", "short TTFT p50 ms", "p95 ms", "short ITL p50 ms", "p95 ms",
                                 "long TTFT p50 ms", "p95 TTFT cut %"], rows)
    t = next(iter(report["targets"].values()))
    note = "\nper-prompt chunk cap while others wait: " + ", ".join(
        f"{name} {cap or 'none'}" for name, cap in report["prefill_caps"].items())
    return (f"{table}{note}\n\ntarget short-request p95 TTFT cut >= {t['target_at_least']:.0%}: best "
            f"{t['best_config']} {t['measured']:.0%} ({'met' if t['met'] else 'missed'})")


def _plot(report: dict, path: str) -> None:
    plt = common.pyplot()
    names = list(report["configs"])
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.4))
    for name in names:
        samples = sorted(report["configs"][name]["short"]["ttft_samples_s"])
        left.step(samples, [(i + 1) / len(samples) for i in range(len(samples))], where="post", label=name)
    left.set_xscale("log")
    left.set_xlabel("short-request TTFT (s)")
    left.set_ylabel("fraction of short requests")
    left.legend(fontsize=7, title="chunked prefill", title_fontsize=7)
    p50 = [report["configs"][n]["short"]["ttft_s"]["p50"] for n in names]
    p95 = [report["configs"][n]["short"]["ttft_s"]["p95"] for n in names]
    x = range(len(names))
    right.bar([i - 0.2 for i in x], p50, width=0.4, label="p50")
    right.bar([i + 0.2 for i in x], p95, width=0.4, label="p95")
    right.set_xticks(list(x), [n.replace(", ", ",\n") for n in names], fontsize=7)
    right.set_ylabel("short-request TTFT (s)")
    right.legend(fontsize=7)
    w = report["workload"]
    fig.suptitle(f"{w['short_requests']} short requests + {w['long_prompts']} x {w['long_prompt_tokens']}-token "
                 "prompts", fontsize=9)
    common.save_figure(fig, path)


if __name__ == "__main__":
    sys.exit(main())
