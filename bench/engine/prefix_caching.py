"""Prefix caching on a multi-turn chat workload, and its cost when nothing is shared.

Chat: conversations that all open with the same 300-token system prompt arrive one per measured
system-prompt prefill time; each turn sends the whole conversation so far (system prompt, earlier
user messages and the engine's own replies) plus a new user message, as soon as the previous reply
has finished. Reported with caching on and off, on the same weights and arrival schedule: TTFT
p50/p95 (all turns, and first turns apart), generated tokens per second over the run, and the
prefix cache hit rate in prompt tokens. No sharing: random prompts, all at once, caching on vs off;
the throughput ratio (target: under 2% lost) and the engine's own bookkeeping time per step.

Configurations run in alternating order, each on a fresh engine (an empty cache), so a change in
the machine's other load does not favour one of them; compare the ratios within one run.

    python -m bench.engine.prefix_caching --json docs/perf/prefix_caching.json --plot docs/perf/prefix_caching.png
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from dataclasses import dataclass

from bench import common
from bench.engine import systems
from iterserve.engine.loadgen import PROMPT_TOKEN_RANGE, percentiles
from iterserve.engine.sampling_params import SamplingParams

SYSTEM_PROMPT_TOKENS = 300
USER_TOKENS = (20, 60)
REPLY_TOKENS = (16, 48)
MAX_MODEL_LEN = 1024
TARGET_MAX_OVERHEAD = 0.02
CONFIGS = {"off": False, "on": True}


@dataclass(frozen=True)
class Conversation:
    start_s: float
    user_messages: list[list[int]]
    reply_lens: list[int]


def configure(parser: argparse.ArgumentParser) -> None:
    common.add_common_args(parser)
    parser.add_argument("--conversations", type=int, help="chat conversations per run (default 6; quick: 3)")
    parser.add_argument("--turns", type=int, help="turns per conversation (default 4; quick: 2)")
    parser.add_argument("--rounds", type=int, help="runs per configuration, alternating order (default 2; quick: 1)")
    parser.add_argument("--random-requests", type=int,
                        help="requests of the no-sharing workload (default 24; quick: 8)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    configure(parser)
    args = parser.parse_args(argv)
    num_conversations = args.conversations or (3 if args.quick else 6)
    turns = args.turns or (2 if args.quick else 4)
    rounds = args.rounds or (1 if args.quick else 2)
    num_random = args.random_requests or (8 if args.quick else 24)
    common.set_threads(args.threads)
    machine = common.machine(args.threads)

    runner = systems.load_runner(max_num_seqs=32, max_model_len=MAX_MODEL_LEN)
    rng = random.Random(args.seed)
    system_prompt = [rng.randint(*PROMPT_TOKEN_RANGE) for _ in range(SYSTEM_PROMPT_TOKENS)]
    prefill_s = _calibrate(runner, system_prompt)
    conversations = _conversations(rng, num_conversations, turns, prefill_s)
    random_workload = common.zipf_workload(num_random, seed=args.seed + 1, max_output=64)
    print(f"a {SYSTEM_PROMPT_TOKENS}-token prefill takes {prefill_s:.2f} s; {num_conversations} conversations x "
          f"{turns} turns; {num_random} unshared requests; {rounds} round(s)", file=sys.stderr)

    chat: dict[str, list[dict]] = {name: [] for name in CONFIGS}
    unshared: dict[str, list[dict]] = {name: [] for name in CONFIGS}
    for round_index in range(rounds):
        order = list(CONFIGS) if round_index % 2 == 0 else list(reversed(CONFIGS))
        for name in order:
            print(f"round {round_index + 1}/{rounds}: caching {name}: chat ...", file=sys.stderr, flush=True)
            chat[name].append(_chat(systems.iterserve_engine(runner, enable_prefix_caching=CONFIGS[name]),
                                    system_prompt, conversations))
        for name in reversed(order):
            print(f"round {round_index + 1}/{rounds}: caching {name}: no sharing ...", file=sys.stderr, flush=True)
            unshared[name].append(_unshared(systems.iterserve_engine(runner, enable_prefix_caching=CONFIGS[name]),
                                            random_workload))
    report = _report(chat, unshared, machine, num_conversations, turns, num_random, prefill_s, rounds)
    report["outputs_identical_on_and_off"] = _same_tokens(chat, unshared)
    print(_table(report))
    common.write_json(args.json, report)
    if args.plot:
        _plot(report, args.plot)
    return 0


def _calibrate(runner, system_prompt: list[int]) -> float:
    engine = systems.iterserve_engine(runner, enable_prefix_caching=False)
    systems.run_iterserve(engine, [common.Request(system_prompt[:64], 2)])  # warm-up
    return systems.run_iterserve(engine, [common.Request(system_prompt, 1)]).seconds


def _conversations(rng: random.Random, count: int, turns: int, prefill_s: float) -> list[Conversation]:
    """Conversations start one system-prompt prefill apart, on average (Poisson)."""
    out, t = [], 0.0
    for _ in range(count):
        users = [[rng.randint(*PROMPT_TOKEN_RANGE) for _ in range(rng.randint(*USER_TOKENS))] for _ in range(turns)]
        out.append(Conversation(t, users, [rng.randint(*REPLY_TOKENS) for _ in range(turns)]))
        t += rng.expovariate(1 / prefill_s)
    return out


def _chat(engine, system_prompt: list[int], conversations: list[Conversation]) -> dict:
    """Replay the conversations in real time; a turn is sent when the previous reply has finished."""
    start = engine.clock()
    history = {i: list(system_prompt) for i in range(len(conversations))}
    active: dict[str, tuple[int, int, float, list[int]]] = {}  # request id -> conversation, turn, sent, prompt
    records: list[dict] = []
    replies: dict[tuple[int, int], list[int]] = {}
    waiting_to_start = list(reversed(range(len(conversations))))

    def send(index: int, turn: int, now: float) -> None:
        prompt = history[index] + conversations[index].user_messages[turn]
        params = SamplingParams(temperature=0.0, max_tokens=conversations[index].reply_lens[turn], ignore_eos=True)
        request_id = engine.add_request(None, params, prompt, arrival_time=now)
        active[request_id] = (index, turn, now, prompt)

    generated = 0
    while waiting_to_start or active:
        now = engine.clock()
        while waiting_to_start and conversations[waiting_to_start[-1]].start_s <= now - start:
            index = waiting_to_start.pop()
            send(index, 0, start + conversations[index].start_s)
        if not active:
            time.sleep(min(0.05, max(0.0, conversations[waiting_to_start[-1]].start_s - (now - start))))
            continue
        outputs = engine.step()
        now = engine.clock()
        for output in outputs:
            index, turn, sent, prompt = active[output.request_id]
            generated += len(output.outputs[0].new_token_ids)
            if output.outputs[0].new_token_ids and len(output.outputs[0].token_ids) == 1:
                records.append({"conversation": index, "turn": turn, "prompt_tokens": len(prompt),
                                "ttft_s": now - sent})
            if output.finished:
                del active[output.request_id]
                replies[(index, turn)] = output.outputs[0].token_ids
                history[index] = prompt + output.outputs[0].token_ids
                if turn + 1 < len(conversations[index].user_messages):
                    send(index, turn + 1, now)
    seconds = engine.clock() - start
    stats = engine.stats()
    return {"seconds": seconds, "generated_tokens": generated, "records": records,
            "prefix_cache_queries": stats.prefix_cache_queries, "prefix_cache_hits": stats.prefix_cache_hits,
            "preemptions": stats.num_preemptions, "replies": replies}


def _unshared(engine, workload: list[common.Request]) -> dict:
    bookkeeping = []
    prefix_s = _time_prefix_work(engine.block_manager)
    result = systems.run_iterserve(engine, workload, on_step=lambda e: bookkeeping.append(
        e.last_timing.schedule_s + e.last_timing.postprocess_s))
    stats = engine.stats()
    return {"seconds": result.seconds, "generated_tokens": result.generated_tokens, "steps": result.steps,
            "bookkeeping_s_per_step": statistics.fmean(bookkeeping), "outputs": result.outputs,
            "prefix_cache_hits": stats.prefix_cache_hits, "prefix_cache_s": sum(prefix_s),
            "prefix_cache_share": sum(prefix_s) / result.seconds}


def _time_prefix_work(block_manager) -> list[float]:
    """Wrap the block manager's prefix-cache calls (lookups at admission, naming computed blocks
    after each step) with timers: the work caching adds, measured directly rather than as a
    throughput difference that this machine's other load can swamp."""
    spent: list[float] = []
    for name in ("match_prefix", "start_with_prefix", "cache_computed_blocks"):
        method = getattr(block_manager, name)

        def timed(*args, _method=method):
            started = time.perf_counter()
            try:
                return _method(*args)
            finally:
                spent.append(time.perf_counter() - started)

        setattr(block_manager, name, timed)
    return spent


def _same_tokens(chat: dict, unshared: dict) -> bool:
    """Greedy replies must not depend on caching (else the runs did different work)."""
    same = True
    for runs, key in ((chat, "replies"), (unshared, "outputs")):
        reference = runs["off"][0][key]
        for name, results in runs.items():
            if any(result[key] != reference for result in results):
                print(f"WARNING: caching {name}: outputs differ from caching off", file=sys.stderr)
                same = False
    return same


def _report(chat: dict, unshared: dict, machine: dict, num_conversations: int, turns: int, num_random: int,
            prefill_s: float, rounds: int) -> dict:
    configs = {}
    for name in CONFIGS:
        records = [r for run in chat[name] for r in run["records"]]
        ttft = [r["ttft_s"] for r in records]
        first = [r["ttft_s"] for r in records if r["turn"] == 0]
        later = [r["ttft_s"] for r in records if r["turn"] > 0]
        queries = sum(run["prefix_cache_queries"] for run in chat[name])
        hits = sum(run["prefix_cache_hits"] for run in chat[name])
        throughput = [run["generated_tokens"] / run["seconds"] for run in chat[name]]
        plain = [run["generated_tokens"] / run["seconds"] for run in unshared[name]]
        configs[name] = {
            "chat": {"ttft_s": percentiles(ttft), "first_turn_ttft_s": percentiles(first),
                     "later_turn_ttft_s": percentiles(later), "ttft_samples_s": ttft,
                     "generated_tokens_per_s": statistics.median(throughput), "runs_tokens_per_s": throughput,
                     "hit_rate": hits / queries if queries else 0.0, "prefix_cache_hits": hits,
                     "prefix_cache_queries": queries,
                     "preemptions": sum(run["preemptions"] for run in chat[name])},
            "no_sharing": {"generated_tokens_per_s": statistics.median(plain), "runs_tokens_per_s": plain,
                           "bookkeeping_ms_per_step": 1e3 * statistics.fmean(
                               run["bookkeeping_s_per_step"] for run in unshared[name]),
                           "prefix_cache_share_of_run": statistics.fmean(
                               run["prefix_cache_share"] for run in unshared[name]),
                           "prefix_cache_hits": sum(run["prefix_cache_hits"] for run in unshared[name])},
        }
    on, off = configs["on"], configs["off"]
    overhead = 1 - on["no_sharing"]["generated_tokens_per_s"] / off["no_sharing"]["generated_tokens_per_s"]
    direct = on["no_sharing"]["prefix_cache_share_of_run"]
    return {
        "benchmark": "prefix_caching",
        "workload": {"system_prompt_tokens": SYSTEM_PROMPT_TOKENS, "conversations": num_conversations,
                     "turns": turns, "user_tokens": list(USER_TOKENS), "reply_tokens": list(REPLY_TOKENS),
                     "system_prefill_s": prefill_s, "rounds": rounds, "no_sharing_requests": num_random,
                     "no_sharing_output": "zipf over 1..64", "max_model_len": MAX_MODEL_LEN},
        "machine": common.finish_machine(machine),
        "configs": configs,
        "ratios": {
            "chat_ttft_p50_on_over_off": on["chat"]["ttft_s"]["p50"] / off["chat"]["ttft_s"]["p50"],
            "chat_ttft_p95_on_over_off": on["chat"]["ttft_s"]["p95"] / off["chat"]["ttft_s"]["p95"],
            "chat_throughput_on_over_off": on["chat"]["generated_tokens_per_s"] / off["chat"]["generated_tokens_per_s"],
            "no_sharing_throughput_on_over_off": 1 - overhead,
        },
        "targets": {
            "no-sharing throughput lost to prefix caching": {
                "target_at_most": TARGET_MAX_OVERHEAD, "measured": overhead, "met": overhead <= TARGET_MAX_OVERHEAD},
            "no-sharing run time spent in prefix-cache work (timed directly)": {
                "target_at_most": TARGET_MAX_OVERHEAD, "measured": direct, "met": direct <= TARGET_MAX_OVERHEAD}},
    }


def _table(report: dict) -> str:
    rows = []
    for name, r in report["configs"].items():
        c, u = r["chat"], r["no_sharing"]
        later = c["later_turn_ttft_s"]["p50"]
        rows.append([name, c["ttft_s"]["p50"] * 1e3, c["ttft_s"]["p95"] * 1e3, later and later * 1e3,
                     c["generated_tokens_per_s"], c["hit_rate"] * 100, u["generated_tokens_per_s"],
                     u["bookkeeping_ms_per_step"]])
    table = common.format_table(["caching", "chat TTFT p50 ms", "p95 ms", "later turns p50 ms", "chat tok/s",
                                 "hit rate %", "no-sharing tok/s", "bookkeeping ms/step"], rows)
    ratios = report["ratios"]
    t, direct = report["targets"].values()
    m = report["machine"]
    same = "identical" if report["outputs_identical_on_and_off"] else "DIFFERENT"
    return (f"{table}\n\ngreedy outputs with caching on and off: {same}\non/off: chat TTFT p50 x{ratios['chat_ttft_p50_on_over_off']:.2f}, p95 "
            f"x{ratios['chat_ttft_p95_on_over_off']:.2f}, chat throughput x{ratios['chat_throughput_on_over_off']:.2f},"
            f" no-sharing throughput x{ratios['no_sharing_throughput_on_over_off']:.3f}\n"
            f"target no-sharing loss <= {t['target_at_most']:.0%}: {t['measured']:+.1%} "
            f"({'met' if t['met'] else 'missed'}); run time in prefix-cache work, timed directly: "
            f"{direct['measured']:.3%} ({'met' if direct['met'] else 'missed'})\nload average at start {m['load_average_at_start']}, "
            f"at end {m['load_average_at_end']}")


def _plot(report: dict, path: str) -> None:
    plt = common.pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.4))
    for name, r in report["configs"].items():
        samples = sorted(r["chat"]["ttft_samples_s"])
        left.step(samples, [(i + 1) / len(samples) for i in range(len(samples))], where="post",
                  label=f"caching {name}" + (f" (hit rate {r['chat']['hit_rate']:.0%})" if name == "on" else ""))
    left.set_xscale("log")
    left.xaxis.set_minor_formatter(plt.NullFormatter())  # minor labels collide on a narrow range
    left.set_xlabel("chat TTFT (s)")
    left.set_ylabel("fraction of requests")
    left.legend(fontsize=7)
    ratios = report["ratios"]
    labels = ["chat TTFT p50", "chat TTFT p95", "chat tok/s", "no-sharing tok/s"]
    values = [ratios["chat_ttft_p50_on_over_off"], ratios["chat_ttft_p95_on_over_off"],
              ratios["chat_throughput_on_over_off"], ratios["no_sharing_throughput_on_over_off"]]
    right.bar(range(len(values)), values, color=["tab:blue", "tab:blue", "tab:green", "tab:gray"])
    right.axhline(1.0, color="black", linewidth=0.8)
    right.set_xticks(range(len(values)), labels, fontsize=7)
    right.set_ylabel("caching on / off")
    w = report["workload"]
    fig.suptitle(f"{w['conversations']} conversations x {w['turns']} turns, {w['system_prompt_tokens']}-token "
                 "shared system prompt", fontsize=9)
    common.save_figure(fig, path)


if __name__ == "__main__":
    sys.exit(main())
