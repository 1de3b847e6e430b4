"""The mixture-of-experts experts on CPU: the engine's grouped path against transformers' own
Qwen3-MoE experts and a per-token loop, at the row counts a step sees (1 = one decode, more =
decodes of many sequences or a prefill chunk).

Kernels, on the same random fp32 weights and routing (softmax top-k of a random router):
  grouped       engine/model/moe.py experts_grouped: pairs sorted by expert, each chosen expert
                run once over all its tokens (its weights read once per step)
  transformers  transformers' Qwen3MoeExperts.forward (eager): also one pass per chosen expert,
                found through a one-hot mask of every (token, slot, expert)
  per-token     each token's k experts one at a time (an expert's weights read once per token
                that chose it): what grouping saves
Each time is the median of repeats after a warm-up; ratio = transformers ms / kernel ms (> 1:
faster). The default shape is Qwen3-30B-A3B's layer at half width and half the experts (hidden
1024, expert width 384, 64 experts, top 8).

    python -m bench.kernels.moe_experts --json docs/perf/moe_experts.json --plot docs/perf/moe_experts.png
    python -m bench.kernels.moe_experts --quick
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from bench import common
from iterserve.engine.model.layers import linear
from iterserve.engine.model.moe import experts_grouped, route

ROWS = (1, 4, 16, 64, 256)
QUICK_ROWS = (1, 16, 64)
KERNELS = ("grouped", "transformers", "per-token")


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def per_token(x, gate_up, down, weights, ids):
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for slot in range(ids.shape[1]):
            e = int(ids[t, slot])
            h = silu_and_mul(F.linear(x[t:t + 1], gate_up[e]))
            out[t] += (F.linear(h, down[e]) * weights[t, slot])[0]
    return out


def transformers_experts(gate_up: torch.Tensor, down: torch.Tensor, top_k: int):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    config = Qwen3MoeConfig(hidden_size=gate_up.shape[2], moe_intermediate_size=down.shape[2],
                            num_experts=gate_up.shape[0], num_experts_per_tok=top_k)
    module = Qwen3MoeExperts(config).eval()
    with torch.no_grad():
        module.gate_up_proj.copy_(gate_up)
        module.down_proj.copy_(down)
    return lambda x, w, i: module(x, i, w)


def kernels(x, weights, ids, gate_up, down, reference) -> dict:
    return {"grouped": lambda: experts_grouped(x, gate_up, down, weights, ids, silu_and_mul, linear),
            "transformers": lambda: reference(x, weights, ids),
            "per-token": lambda: per_token(x, gate_up, down, weights, ids)}


def timed(fn, budget: float) -> float:
    fn()  # warm-up
    times = []
    deadline = time.perf_counter() + budget
    while len(times) < 3 or (time.perf_counter() < deadline and len(times) < 50):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_common_args(parser)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--expert-width", type=int, default=384)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--rows", help="comma-separated row counts (default 1,4,16,64,256; quick 1,16,64)")
    args = parser.parse_args(argv)
    common.set_threads(args.threads)
    if args.quick:
        args.experts = min(args.experts, 16)
    rows_list = [int(r) for r in args.rows.split(",")] if args.rows else (QUICK_ROWS if args.quick else ROWS)
    info = common.machine(args.threads)
    gen = torch.Generator().manual_seed(args.seed)
    hidden, width, experts = args.hidden, args.expert_width, args.experts
    gate_up = torch.randn(experts, 2 * width, hidden, generator=gen) / hidden**0.5
    down = torch.randn(experts, hidden, width, generator=gen) / width**0.5
    router = torch.randn(experts, hidden, generator=gen) / hidden**0.5
    reference = transformers_experts(gate_up, down, args.top_k)
    budget = 0.2 if args.quick else 1.0
    results = []
    with torch.inference_mode():
        for rows in rows_list:
            x = torch.randn(rows, hidden, generator=gen)
            weights, ids = route(x, router, args.top_k, normalize=True)
            fns = kernels(x, weights, ids, gate_up, down, reference)
            torch.testing.assert_close(fns["grouped"](), fns["transformers"](), rtol=1e-4, atol=1e-4)
            ms = {k: timed(fns[k], budget) for k in KERNELS}
            chosen = int(ids.unique().numel())
            row = {"rows": rows, "experts_chosen": chosen, "ms": ms,
                   "ratio": {k: ms["transformers"] / ms[k] for k in KERNELS}}
            results.append(row)
            print(f"rows {rows:4d} ({chosen} experts chosen): " + "  ".join(
                f"{k} {ms[k]:.2f} ms (x{row['ratio'][k]:.2f})" for k in KERNELS), file=sys.stderr)
    print(common.format_table(["rows", "experts chosen", *(f"{k} ms" for k in KERNELS), "grouped vs transformers"],
                              [[r["rows"], r["experts_chosen"], *(r["ms"][k] for k in KERNELS),
                                r["ratio"]["grouped"]] for r in results]))
    common.write_json(args.json, {"benchmark": "moe_experts", "quick": args.quick,
                                  "shape": {"hidden": hidden, "expert_width": width, "experts": experts,
                                            "top_k": args.top_k},
                                  "machine": common.finish_machine(info), "results": results})
    if args.plot:
        plt = common.pyplot()
        fig, ax = plt.subplots(figsize=(6, 4))
        for k in KERNELS:
            ax.plot([r["rows"] for r in results], [r["ms"][k] for r in results], marker="o", label=k)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("rows in the step")
        ax.set_ylabel("ms per MoE block (experts only)")
        ax.set_title(f"{experts} experts top-{args.top_k}, hidden {hidden}, width {width}, "
                     f"{args.threads} thread(s)")
        ax.legend()
        common.save_figure(fig, args.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
