"""Offline throughput on the "zipf" workload: iterserve continuous batching against its own static
mode, HuggingFace `generate` over padded static batches, and HuggingFace's continuous batching.

Every system gets the same prompts, the same exact output lengths (EOS ignored), the same weights,
dtype and torch threads, and the same cap on requests batched together. Useful tokens are the
requested output tokens; tokens a static batch computes past a request's length do not count.

    python -m bench.engine.throughput --json docs/perf/throughput.json --plot docs/perf/throughput.png
"""

from __future__ import annotations

import argparse
import sys

from bench import common
from bench.engine import systems

CONTINUOUS = "iterserve-continuous"
QUICK_PROMPT_LEN = (8, 32)
TARGETS = {"iterserve-static": 4.0, "hf-generate-static": 6.0, "hf-generate-batch": 2.0}


def configure(parser: argparse.ArgumentParser) -> None:
    common.add_common_args(parser)
    parser.add_argument("--requests", type=int, help="number of requests (default 64; quick: 8)")
    parser.add_argument("--batch-cap", type=int, help="max requests batched together, every system (default 16; quick: 4)")
    parser.add_argument("--max-output", type=int, help="Zipf output length cap (default 256; quick: 16)")
    parser.add_argument("--systems", default="all",
                        help="comma-separated subset of: " + ", ".join([CONTINUOUS, *TARGETS]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    configure(parser)
    args = parser.parse_args(argv)
    requests = args.requests or (8 if args.quick else 64)
    cap = args.batch_cap or (4 if args.quick else 16)
    max_output = args.max_output or (16 if args.quick else common.MAX_OUTPUT_TOKENS)
    prompt_len = QUICK_PROMPT_LEN if args.quick else common.PROMPT_LEN_RANGE
    wanted = [CONTINUOUS, *TARGETS] if args.systems == "all" else args.systems.split(",")
    unknown = set(wanted) - {CONTINUOUS, *TARGETS}
    if unknown:
        parser.error(f"--systems: unknown {sorted(unknown)}; choose from {CONTINUOUS}, {', '.join(TARGETS)}")

    common.set_threads(args.threads)
    machine = common.machine(args.threads)
    workload = common.zipf_workload(requests, args.seed, prompt_len, max_output)
    runner = systems.load_runner(max_num_seqs=cap, max_model_len=1024)
    config = runner.config
    print(f"{requests} requests, output lengths Zipf capped at {max_output} "
          f"({sum(r.output_len for r in workload)} useful tokens), batch cap {cap}, "
          f"{args.threads} torch thread(s)", file=sys.stderr)

    results = {}
    warmup = common.zipf_workload(2, args.seed + 1, max_output=4)
    for name in wanted:
        run = _runner_for(name, runner, cap)
        run(warmup)
        print(f"running {name} ...", file=sys.stderr, flush=True)
        results[name] = run(workload)
        print(f"  {results[name].seconds:.1f} s", file=sys.stderr)

    report = _report(results, workload, machine, requests, cap, max_output, prompt_len, config)
    print(_table(report))
    common.write_json(args.json, report)
    if args.plot:
        _plot(report, args.plot)
    return 0


def _runner_for(name: str, runner, cap: int):
    config = runner.config
    if name == CONTINUOUS:
        engine = systems.iterserve_engine(runner, scheduling="continuous")
        return lambda workload: systems.run_iterserve(engine, workload)
    if name == "iterserve-static":
        engine = systems.iterserve_engine(runner, scheduling="static")
        return lambda workload: systems.run_iterserve(engine, workload)
    hf = _hf(runner)
    if name == "hf-generate-static":
        return lambda workload: systems.run_hf_generate_static(hf, workload, cap)
    return lambda workload: systems.run_hf_generate_batch(
        hf, workload, cap, config.max_num_batched_tokens, runner.num_kv_blocks, config.block_size)


_HF_MODEL = []


def _hf(runner):
    if not _HF_MODEL:
        _HF_MODEL.append(systems.hf_model(runner))
    return _HF_MODEL[0]


def _report(results, workload, machine, requests, cap, max_output, prompt_len, config) -> dict:
    useful = sum(r.output_len for r in workload)
    reference = results.get(CONTINUOUS)
    out = {}
    for name, result in results.items():
        lengths_ok = all(len(o) == r.output_len for o, r in zip(result.outputs, workload, strict=True))
        out[name] = {
            "useful_tokens": sum(len(o) for o in result.outputs),
            "generated_tokens": result.generated_tokens,
            "exact_output_lengths": lengths_ok,
            "total_time_s": result.seconds,
            "useful_tokens_per_s": useful / result.seconds,
        }
        if reference is not None:
            out[name]["continuous_speedup"] = result.seconds / reference.seconds
            out[name]["identical_outputs_vs_continuous"] = sum(
                a == b for a, b in zip(result.outputs, reference.outputs, strict=True)) / len(workload)
    targets = {}
    if reference is not None:
        for name, target in TARGETS.items():
            if name in out:
                measured = out[name]["continuous_speedup"]
                targets[f"continuous vs {name}"] = {"target_x": target, "measured_x": measured,
                                                     "met": measured >= target}
    return {
        "benchmark": "throughput",
        "workload": {"name": "zipf", "requests": requests, "batch_cap": cap, "max_output_tokens": max_output,
                     "prompt_len_range": list(prompt_len), "useful_tokens": useful,
                     "max_num_batched_tokens": config.max_num_batched_tokens, "block_size": config.block_size,
                     "dtype": "float32"},
        "machine": common.finish_machine(machine),
        "systems": out,
        "targets": targets,
    }


def _table(report: dict) -> str:
    rows = [[name, s["useful_tokens"], s["generated_tokens"], s["total_time_s"], s["useful_tokens_per_s"],
             s.get("continuous_speedup")] for name, s in report["systems"].items()]
    table = common.format_table(
        ["system", "useful tok", "computed tok", "time s", "useful tok/s", "continuous is x faster"], rows)
    lines = [table, ""]
    for label, t in report["targets"].items():
        lines.append(f"target {label}: >= {t['target_x']}x, measured {t['measured_x']:.2f}x "
                     f"({'met' if t['met'] else 'missed'})")
    return "\n".join(lines)


def _plot(report: dict, path: str) -> None:
    plt = common.pyplot()
    names = list(report["systems"])
    values = [report["systems"][n]["useful_tokens_per_s"] for n in names]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    bars = ax.bar(names, values, color=["tab:green" if n == CONTINUOUS else "tab:gray" for n in names])
    for bar, name in zip(bars, names, strict=True):
        speedup = report["systems"][name].get("continuous_speedup")
        label = f"{bar.get_height():.1f}" + (f"\ncontinuous {speedup:.2f}x" if speedup and name != CONTINUOUS else "")
        ax.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom",
                    fontsize=8)
    w = report["workload"]
    ax.set_ylabel("useful output tokens / s")
    ax.set_title(f"zipf: {w['requests']} requests, outputs <= {w['max_output_tokens']}, batch cap {w['batch_cap']}, "
                 f"{report['machine']['torch_threads']} thread(s) CPU", fontsize=9)
    ax.tick_params(axis="x", labelsize=8)
    ax.margins(y=0.2)
    common.save_figure(fig, path)


if __name__ == "__main__":
    sys.exit(main())
