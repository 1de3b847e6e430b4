"""One linear of the embedded model's shapes on each GGUF block format (engine/model/cpu_gguf.py)
against fp32 (torch, the dequantized weight: `--quantization none`) and the w8a8 kernel, over row
counts from a one-sequence decode step to a prefill chunk: median time per call, GFLOP/s
(2 x rows x N x K), the weight bytes read per second (the bound of small-row calls) and the speed
against fp32 in the same run (speed_vs_fp32). From the kernel's panel threshold on, "Q4_1 row tiles"
and "Q8_0 row tiles" time the same formats on the per-row tiles (cpu_gguf.linear(panel_rows=...)): what
the panels gain in the same run.

Every format runs the same weight (random, quantized by gguf's quantizers for the 32-weight
formats; random valid blocks for the K-quants, whose speed does not depend on the values).
Times are medians of --repeats calls after a warm-up, in one process, all variants interleaved per
shape so a busy machine slows them alike: compare the ratios, not the absolute figures.

The shapes are SmolLM2-135M's: q/o (576 x 576), the fused gate/up (3072 x 576), down (576 x 1536) and
the tied LM head (49152 x 576, the file's Q8_0; only --head-rows, as it runs on the sampled rows).
`peaks` records what bounds a call: this CPU's int8 multiply-adds per second on one thread (a tiny
loop of independent vpdpbusd, or vpmaddubsw + vpmaddwd + vpaddd, chains), its fp32 FMA peak, and
the read bandwidth of one thread over a buffer larger than the caches.

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

SHAPES = {"q/o 576x576": (576, 576), "gate_up 3072x576": (3072, 576), "down 576x1536": (576, 1536),
          "lm_head 49152x576": (49152, 576)}
HEAD = "lm_head 49152x576"

PEAK_SOURCE = r"""
#include <immintrin.h>
#include <stdint.h>
/* 8 independent chains of 32 int8 multiply-adds per step; the operands made opaque every step so the
   products cannot be hoisted. Returns a checksum. */
int32_t int8_loop(const int8_t* a, int64_t steps) {
    __m256i x0 = _mm256_loadu_si256((const __m256i*)a), x1 = _mm256_add_epi8(x0, x0);
    __m256i x2 = _mm256_add_epi8(x1, x0), x3 = _mm256_add_epi8(x2, x0);
    __m256i y0 = _mm256_sub_epi8(x3, x1), y1 = _mm256_sub_epi8(x2, x1);
    __m256i acc[8];
    for (int j = 0; j < 8; j++) acc[j] = _mm256_set1_epi32(j);
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t i = 0; i < steps; i++) {
        __asm__ volatile("" : "+x"(x0), "+x"(x1), "+x"(x2), "+x"(x3), "+x"(y0), "+x"(y1));
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define DOT(acc, x, y) acc = _mm256_dpbusd_epi32(acc, x, y)
#else
#define DOT(acc, x, y) acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(x, y), ones))
#endif
        DOT(acc[0], x0, y0); DOT(acc[1], x1, y0); DOT(acc[2], x2, y0); DOT(acc[3], x3, y0);
        DOT(acc[4], x0, y1); DOT(acc[5], x1, y1); DOT(acc[6], x2, y1); DOT(acc[7], x3, y1);
    }
    __m256i t = acc[0];
    for (int j = 1; j < 8; j++) t = _mm256_add_epi32(t, acc[j]);
    return _mm256_extract_epi32(t, 0);
}

/* 8 independent chains of 8 fp32 FMAs per step */
float fp32_loop(const float* a, int64_t steps) {
    __m256 x = _mm256_loadu_ps(a), y = _mm256_loadu_ps(a + 8), acc[8];
    for (int j = 0; j < 8; j++) acc[j] = _mm256_set1_ps((float)j);
    for (int64_t i = 0; i < steps; i++)
        for (int j = 0; j < 8; j++) acc[j] = _mm256_fmadd_ps(acc[j], x, y);
    __m256 t = acc[0];
    for (int j = 1; j < 8; j++) t = _mm256_add_ps(t, acc[j]);
    return _mm256_cvtss_f32(t);
}
"""


def peaks() -> dict:
    """One thread's int8 multiply-add and fp32 FMA peaks (per second) and read bandwidth (bytes/s)."""
    import ctypes

    from iterserve.engine import native
    from iterserve.engine.model import cpu_gguf

    isa = cpu_gguf.isa_path()
    lib = native.build(f"gguf_peak_{isa.replace('-', '_')}", PEAK_SOURCE, cpu_gguf.ISA_FLAGS[isa])
    out = {"isa": isa}
    if lib is not None:
        lib.int8_loop.argtypes = lib.fp32_loop.argtypes = [ctypes.c_void_p, ctypes.c_int64]
        lib.int8_loop.restype, lib.fp32_loop.restype = ctypes.c_int32, ctypes.c_float
        a = torch.arange(64, dtype=torch.float32)
        steps = 20_000_000
        for name, fn, macs in (("int8_macs_per_s", lib.int8_loop, 8 * 32), ("fp32_fmas_per_s", lib.fp32_loop, 8 * 8)):
            seconds = min(timed_once(lambda fn=fn: fn(a.data_ptr(), steps)) for _ in range(3))
            out[name] = steps * macs / seconds
    big = torch.ones(64 << 20)  # 256 MB
    seconds = min(timed_once(big.sum) for _ in range(3))
    out["read_bytes_per_s"] = big.numel() * 4 / seconds
    return out


def timed_once(fn) -> float:
    """The calling thread's CPU time of one call (a loaded machine inflates it less than the wall clock)."""
    start = time.thread_time()
    fn()
    return time.thread_time() - start
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
    parser.add_argument("--rows", default="1,8,16,64,256,512")
    parser.add_argument("--head-rows", default="1,64", help="rows of the LM head shape (it runs on the sampled rows)")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="subset of: " + ", ".join(SHAPES))
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
    shapes = {name: SHAPES[name] for name in args.shapes.split(",")}
    machine = common.machine(args.threads)
    peak = peaks()
    print("peaks", {k: f"{v:.3g}" if isinstance(v, float) else v for k, v in peak.items()}, flush=True)
    results = []
    for shape_name, (n, k) in shapes.items():
        torch.manual_seed(0)
        dense = torch.randn(n, k) / 8
        qweight, wscale, wsum = cpu_w8a8.quantize_weight(dense)
        # K-quants need K in whole 256-weight super-blocks (llama.cpp stores such tensors in another format)
        formats = {name: blocks_for(name, n, k) for name in FORMATS
                   if name in wanted and k % cpu_gguf.block_shape(cpu_gguf.BY_NAME[name])[0] == 0
                   and (shape_name != HEAD or name == "Q8_0")}
        for rows in ([int(r) for r in args.head_rows.split(",")] if shape_name == HEAD else rows_list):
            x = torch.randn(rows, k)
            variants = {"fp32": (lambda x=x, w=dense: F.linear(x, w), n * k * 4),
                        "w8a8": (lambda x=x, w=(qweight, wscale, wsum): cpu_w8a8.linear(x, *w, args.threads), n * k)}
            for name, blocks in formats.items():
                variants[name] = (lambda x=x, b=blocks, t=cpu_gguf.BY_NAME[name]:
                                  cpu_gguf.linear(x, b, t, args.threads), blocks.numel())
            for name in ("Q4_1", "Q8_0"):  # the file's formats on the row tiles, where the panels serve
                if name in formats and rows >= cpu_gguf.panel_rows(cpu_gguf.BY_NAME[name]):
                    variants[f"{name} row tiles"] = (
                        lambda x=x, b=formats[name], t=cpu_gguf.BY_NAME[name]:
                        cpu_gguf.linear(x, b, t, args.threads, panel_rows=1 << 30),
                        formats[name].numel())
            for variant, (fn, nbytes) in variants.items():
                seconds = timed(fn, args.repeats, clock)
                results.append({"shape": shape_name, "rows": rows, "variant": variant, "ms": seconds * 1e3,
                                "gflops": 2 * rows * n * k / seconds / 1e9, "weight_gbps": nbytes / seconds / 1e9,
                                "weight_bytes": nbytes})
            line = {r["variant"]: r["ms"] for r in results if r["shape"] == shape_name and r["rows"] == rows}
            print(shape_name, rows, " ".join(f"{v} {ms:.3f}" for v, ms in line.items()), flush=True)
    fp32 = {(r["shape"], r["rows"]): r["ms"] for r in results if r["variant"] == "fp32"}
    for r in results:  # > 1: faster than --quantization none's fp32 linear in the same run
        r["speed_vs_fp32"] = fp32[r["shape"], r["rows"]] / r["ms"]
    data = {"threads": args.threads, "isa": cpu_gguf.isa_path(), "clock": args.clock, "peaks": peak, "results": results,
            "machine": common.finish_machine(machine)}
    common.write_json(args.json, data)
    if args.plot:
        plt = common.pyplot()
        fig, axes = plt.subplots(1, len(shapes), figsize=(6 * len(shapes), 4), sharey=True, squeeze=False)
        for ax, shape_name in zip(axes[0], shapes, strict=True):
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
        axes[0][0].legend(fontsize=7)
        common.save_figure(fig, args.plot)


if __name__ == "__main__":
    main()
