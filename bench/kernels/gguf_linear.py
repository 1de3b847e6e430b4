"""One linear of the embedded model's shapes on each GGUF block format (engine/model/cpu_gguf.py)
against fp32 (torch, the dequantized weight: `--quantization none`) and the w8a8 kernel, over row
counts from a one-sequence decode step to a prefill chunk: median time per call, GFLOP/s
(2 x rows x N x K), the weight bytes read per second (the bound of small-row calls) and the speed
against fp32 in the same run (speed_vs_fp32).

Every format runs the same weight (random, quantized by gguf's quantizers for the 32-weight
formats; random valid blocks for the K-quants, whose speed does not depend on the values).
Times are medians of --repeats calls after a warm-up, in one process, all variants interleaved per
shape so a busy machine slows them alike: compare the ratios, not the absolute figures.

    .venv/bin/python -m bench.kernels.gguf_linear --json docs/perf/gguf_linear.json --plot docs/perf/gguf_linear.png
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
import torch.nn.functional as F

from bench import common

SHAPES = {"gate_up 3072x576": (3072, 576), "down 576x1536": (576, 1536)}
FORMATS = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")


def blocks_for(name: str, n: int, k: int) -> torch.Tensor:
    import gguf.quants

    from iterserve.engine.model import cpu_gguf

    rng = np.random.default_rng(0)
    weights, nbytes = cpu_gguf.block_shape(cpu_gguf.BY_NAME[name])
    if weights == 32:
        w = (rng.standard_normal((n * k // 32, 32)) / 8).astype(np.float32)
        raw = getattr(gguf.quants, name).quantize_blocks(w)
    else:
        raw = rng.integers(0, 256, (n * k // weights, nbytes), dtype=np.uint8)
        scale = (rng.random((raw.shape[0], 2)) * 0.02).astype(np.float16).view(np.uint8)
        at, width = {"Q6_K": (208, 2), "Q3_K": (108, 2), "Q2_K": (80, 4)}.get(name, (0, 4))
        raw[:, at:at + width] = scale[:, :width]
    return torch.from_numpy(np.ascontiguousarray(raw.reshape(n, -1)))


def timed(fn, repeats: int, clock=time.perf_counter) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = clock()
        fn()
        times.append(clock() - start)
    return statistics.median(times)


def main() -> None:
    from iterserve.engine.model import cpu_gguf, cpu_w8a8

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,8,64,512")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--formats", default=",".join(FORMATS), help="GGUF formats timed beside fp32 and w8a8")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="cpu: the calling thread's CPU time (with --threads 1 every product runs on it), which a "
                             "machine loaded by other work inflates far less than the wall clock")
    parser.add_argument("--json")
    parser.add_argument("--plot")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if cpu_gguf.load() is None:
        raise SystemExit("the GGUF kernel cannot be built here (needs AVX2/F16C and a C compiler)")
    if args.clock == "cpu" and args.threads != 1:
        raise SystemExit("--clock cpu measures the calling thread: use it with --threads 1")
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    wanted = args.formats.split(",")
    rows_list = [int(r) for r in args.rows.split(",")]
    machine = common.machine(args.threads)
    results = []
    for shape_name, (n, k) in SHAPES.items():
        torch.manual_seed(0)
        dense = torch.randn(n, k) / 8
        qweight, wscale, wsum = cpu_w8a8.quantize_weight(dense)
        # K-quants need K in whole 256-weight super-blocks (llama.cpp stores such tensors in another format)
        formats = {name: blocks_for(name, n, k) for name in FORMATS
                   if name in wanted and k % cpu_gguf.block_shape(cpu_gguf.BY_NAME[name])[0] == 0}
        for rows in rows_list:
            x = torch.randn(rows, k)
            variants = {"fp32": (lambda x=x, w=dense: F.linear(x, w), n * k * 4),
                        "w8a8": (lambda x=x, w=(qweight, wscale, wsum): cpu_w8a8.linear(x, *w, args.threads), n * k)}
            for name, blocks in formats.items():
                variants[name] = (lambda x=x, b=blocks, t=cpu_gguf.BY_NAME[name]:
                                  cpu_gguf.linear(x, b, t, args.threads), blocks.numel())
            for variant, (fn, nbytes) in variants.items():
                seconds = timed(fn, args.repeats, clock)
                results.append({"shape": shape_name, "rows": rows, "variant": variant, "ms": seconds * 1e3,
                                "gflops": 2 * rows * n * k / seconds / 1e9, "weight_gbps": nbytes / seconds / 1e9})
            line = {r["variant"]: r["ms"] for r in results if r["shape"] == shape_name and r["rows"] == rows}
            print(shape_name, rows, " ".join(f"{v} {ms:.3f}" for v, ms in line.items()), flush=True)
    fp32 = {(r["shape"], r["rows"]): r["ms"] for r in results if r["variant"] == "fp32"}
    for r in results:  # > 1: faster than --quantization none's fp32 linear in the same run
        r["speed_vs_fp32"] = fp32[r["shape"], r["rows"]] / r["ms"]
    data = {"threads": args.threads, "isa": cpu_gguf.isa_path(), "clock": args.clock, "results": results,
            "machine": common.finish_machine(machine)}
    common.write_json(args.json, data)
    if args.plot:
        plt = common.pyplot()
        fig, axes = plt.subplots(1, len(SHAPES), figsize=(6 * len(SHAPES), 4), sharey=True)
        for ax, shape_name in zip(axes, SHAPES, strict=True):
            for variant in ("fp32", "w8a8", *FORMATS):
                points = [(r["rows"], r["gflops"]) for r in results if r["shape"] == shape_name
                          and r["variant"] == variant]
                if not points:
                    continue
                ax.plot(*zip(*points, strict=True), marker="o", label=variant,
                        linestyle="--" if variant in ("fp32", "w8a8") else "-")
            ax.set_xscale("log", base=2)
            ax.set_title(f"{shape_name}, {args.threads} threads ({cpu_gguf.isa_path()})")
            ax.set_xlabel("rows per call")
            ax.set_ylabel("GFLOP/s")
        axes[0].legend(fontsize=7)
        common.save_figure(fig, args.plot)


if __name__ == "__main__":
    main()
