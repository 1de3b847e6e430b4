"""KV memory waste on the "zipf" workload: allocated block capacity against tokens actually stored,
after every engine step, for several block sizes; and what reserving a max-length slab per
request (the pre-paging way) would have held for the same schedule.

The engine runs with its real scheduler and block manager and the fake executor: with EOS ignored
every request's length is fixed, so block allocation does not depend on which tokens the model
picks, and the fake executor gives exactly the allocation the real model would, in seconds.

    python -m bench.engine.kv_waste --json docs/perf/kv_waste.json --plot docs/perf/kv_waste.png
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

from bench import common
from bench.engine import systems
from iterserve.engine.config import EngineConfig
from iterserve.engine.fake_executor import FakeExecutor, FakeTokenizer
from iterserve.engine.llm_engine import LLMEngine

TARGET_WASTE = 0.04
MAX_MODEL_LEN = 2048
KV_POOL_TOKENS = 11_648  # iterserve's default 512MiB pool for SmolLM2-135M in fp32


@dataclass
class Tally:
    steps: int = 0
    stored: int = 0  # token-steps whose KV is in the cache
    capacity: int = 0  # token-steps of allocated block capacity
    reserved_max_len: int = 0  # token-steps a max_model_len slab per running request would hold
    reserved_output_cap: int = 0  # ... a prompt + output-cap slab (what max_tokens=256 asks for)
    reserved_exact: int = 0  # ... a prompt + exact output length slab (an oracle that knows each length)
    peak_waste: float = 0.0

    def record(self, engine: LLMEngine) -> None:
        block_size = engine.config.block_size
        stored = capacity = reserve_len = reserve_cap = reserve_exact = 0
        for seq in engine.scheduler.running:
            if not seq.block_table:
                continue
            stored += seq.num_computed_tokens
            capacity += len(seq.block_table) * block_size
            reserve_len += engine.config.max_model_len
            reserve_cap += seq.num_prompt_tokens + common.MAX_OUTPUT_TOKENS
            reserve_exact += seq.num_prompt_tokens + seq.params.max_tokens
        if capacity:
            self.steps += 1
            self.stored += stored
            self.capacity += capacity
            self.reserved_max_len += reserve_len
            self.reserved_output_cap += reserve_cap
            self.reserved_exact += reserve_exact
            self.peak_waste = max(self.peak_waste, 1 - stored / capacity)


def configure(parser: argparse.ArgumentParser) -> None:
    common.add_common_args(parser)
    parser.add_argument("--requests", type=int, help="number of requests (default 64; quick: 16)")
    parser.add_argument("--batch-cap", type=int, default=16, help="max running requests (default 16)")
    parser.add_argument("--block-sizes", default="8,16,32", help="block sizes to compare (default 8,16,32)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    configure(parser)
    args = parser.parse_args(argv)
    requests = args.requests or (16 if args.quick else 64)
    block_sizes = [int(b) for b in args.block_sizes.split(",")]
    machine = common.machine(args.threads)
    workload = common.zipf_workload(requests, args.seed)

    results = {}
    for block_size in block_sizes:
        tally = Tally()
        systems.run_iterserve(_engine(block_size, args.batch_cap), workload, tally.record)
        results[str(block_size)] = {
            "steps": tally.steps,
            "mean_waste": 1 - tally.stored / tally.capacity,
            "peak_waste": tally.peak_waste,
            "mean_tokens_stored": tally.stored / tally.steps,
            "mean_capacity_allocated": tally.capacity / tally.steps,
            "static_max_model_len_waste": 1 - tally.stored / tally.reserved_max_len,
            "static_max_model_len_reserved_x": tally.reserved_max_len / tally.stored,
            "static_output_cap_waste": 1 - tally.stored / tally.reserved_output_cap,
            "static_output_cap_reserved_x": tally.reserved_output_cap / tally.stored,
            "static_exact_length_waste": 1 - tally.stored / tally.reserved_exact,
        }
    default = results.get("16") or next(iter(results.values()))
    report = {
        "benchmark": "kv_waste",
        "workload": {"name": "zipf", "requests": requests, "batch_cap": args.batch_cap,
                     "max_output_tokens": common.MAX_OUTPUT_TOKENS, "max_model_len": MAX_MODEL_LEN,
                     "prompt_len_range": list(common.PROMPT_LEN_RANGE), "executor": "fake (exact allocation)"},
        "machine": common.finish_machine(machine),
        "block_sizes": results,
        "targets": {"mean KV waste (block 16)": {"target_below": TARGET_WASTE, "measured": default["mean_waste"],
                                                 "met": default["mean_waste"] < TARGET_WASTE}},
    }
    print(_table(report))
    common.write_json(args.json, report)
    if args.plot:
        _plot(report, args.plot)
    return 0


def _engine(block_size: int, cap: int) -> LLMEngine:
    config = EngineConfig(model="fake", max_num_seqs=cap, block_size=block_size, max_model_len=MAX_MODEL_LEN,
                          num_kv_blocks=KV_POOL_TOKENS // block_size, num_cpu_blocks=0)
    config = config.resolve()
    return LLMEngine(config, FakeExecutor(config.num_kv_blocks), FakeTokenizer())


def _table(report: dict) -> str:
    rows = [[size, r["mean_waste"] * 100, r["peak_waste"] * 100, r["mean_tokens_stored"],
             r["mean_capacity_allocated"], r["static_exact_length_waste"] * 100,
             r["static_output_cap_waste"] * 100, r["static_max_model_len_waste"] * 100]
            for size, r in report["block_sizes"].items()]
    table = common.format_table(["block size", "paged waste %", "peak %", "tokens stored", "capacity",
                                 "static exact-len %", "static +256 %", "static max_len %"], rows)
    t = next(iter(report["targets"].values()))
    return (f"{table}\n\ntarget mean KV waste < {t['target_below']:.0%} at block size 16: "
            f"measured {t['measured']:.2%} ({'met' if t['met'] else 'missed'})")


def _plot(report: dict, path: str) -> None:
    plt = common.pyplot()
    sizes = list(report["block_sizes"])
    labels = [f"paged, block {s}" for s in sizes] + [
        "static: prompt + exact output", f"static: prompt + {common.MAX_OUTPUT_TOKENS}", "static: max_model_len"]
    block16 = report["block_sizes"].get("16") or report["block_sizes"][sizes[0]]
    values = [report["block_sizes"][s]["mean_waste"] * 100 for s in sizes]
    values += [block16[k] * 100 for k in ("static_exact_length_waste", "static_output_cap_waste",
                                          "static_max_model_len_waste")]
    fig, ax = plt.subplots(figsize=(7, 3.4))
    bars = ax.barh(labels, values, color=["tab:green"] * len(sizes) + ["tab:gray"] * 3)
    for bar in bars:
        ax.annotate(f"{bar.get_width():.1f}%", (bar.get_width(), bar.get_y() + bar.get_height() / 2),
                    va="center", fontsize=8, xytext=(3, 0), textcoords="offset points")
    ax.axvline(TARGET_WASTE * 100, color="tab:red", linestyle="--", linewidth=1, label="4% target")
    ax.set_xlabel("KV memory reserved but not holding a token (%), mean over steps")
    ax.set_xlim(0, 110)
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title(f"zipf: {report['workload']['requests']} requests, batch cap {report['workload']['batch_cap']}",
                 fontsize=9)
    common.save_figure(fig, path)


if __name__ == "__main__":
    sys.exit(main())
