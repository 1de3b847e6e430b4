"""Quantized linear kernels against fp32 sgemm, at every row count the engine sees, on SmolLM2-135M's
shapes (qkv 576->960, o 576->576, gate_up 576->3072, down 1536->576, lm_head 576->49152 on the
sampled rows), with 1 and 2 torch threads.

Kernels (random weights and activations of the real shapes; the time of a kernel does not depend
on the values):
  fp32          F.linear with the fp32 weight (MKL sgemm): the exact-parity reference
  int8-wo       torch._weight_int8pack_mm: int8 weight, per-channel scales, bf16 activations
  int4-wo       torch._weight_int4pack_mm_for_cpu: Q4_1-style 32-weight groups, bf16 activations
  w8a8          `--quantization w8a8` (engine/model/quant.py W8A8Linear): iterserve's C kernel
                (engine/model/cpu_w8a8.py), every row quantized on its own scale (batch-independent),
                on as many threads as torch has
  w8a8-fbgemm   torch.ops.quantized.linear_dynamic, fbgemm's dynamic int8 linear (8-bit activations
                quantized per TENSOR: one scale for the whole batch), what w8a8 ran before its own kernel
  w8a8-intmm    per-row int8 activations through torch._int_mm (int8 x int8 -> int32), the obvious
                alternative (10-60x slower than fp32 on this torch's CPU path: not in the default set)
  fp16-fbgemm   torch.ops.quantized.linear_dynamic_fp16: fp16 weight, fp32 activations
Each time is the median of repeats after a warm-up; ratio = fp32 ms / kernel ms (> 1: faster).

    python -m bench.kernels.quant_linear --json docs/perf/quant_linear.json
    python -m bench.kernels.quant_linear --quick
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings

import torch
import torch.nn.functional as F

from bench import common
from iterserve.engine.model.quant import Int8Linear, W8A8Linear, int4_from_dense

SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576), "lm_head": (576, 49152)}
ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
QUICK_ROWS = (1, 8, 64, 256)
KERNELS = ("fp32", "int8-wo", "int4-wo", "w8a8", "w8a8-fbgemm", "w8a8-intmm", "fp16-fbgemm")
DEFAULT_KERNELS = tuple(k for k in KERNELS if k != "w8a8-intmm")  # 10-60x slower than fp32: --kernels to include


def build(kernel: str, weight: torch.Tensor):
    """A callable x -> x @ weight.T for the kernel, or None where this torch lacks it."""
    if kernel == "fp32":
        return lambda x: F.linear(x, weight)
    if kernel == "int8-wo":
        return Int8Linear(weight, dense_above=1 << 30).quantized
    if kernel == "int4-wo":
        return int4_from_dense(weight, dense_above=1 << 30).quantized
    if kernel == "w8a8":
        return W8A8Linear(weight)
    if kernel == "w8a8-intmm":
        layer = W8A8Linear(weight)
        qweight_t = layer.qweight.t()

        def intmm(x):
            row_scale = x.abs().amax(dim=1, keepdim=True).clamp_(min=1e-12).div_(127.0)
            out = torch._int_mm(torch.round(x / row_scale).to(torch.int8), qweight_t).float()
            return out.mul_(row_scale).mul_(layer.wscale)
        return intmm
    with warnings.catch_warnings():  # quantized tensors are deprecated in favour of torchao
        warnings.simplefilter("ignore")
        try:
            if kernel == "w8a8-fbgemm":
                layer = W8A8Linear(weight)
                q = torch._make_per_channel_quantized_tensor(layer.qweight, layer.wscale.double(),
                                                             torch.zeros(len(layer.wscale), dtype=torch.long), 0)
                packed = torch.ops.quantized.linear_prepack(q, None)
                return lambda x: torch.ops.quantized.linear_dynamic(x, packed, False)
            if kernel == "fp16-fbgemm":
                packed = torch.ops.quantized.linear_prepack_fp16(weight, None)
                return lambda x: torch.ops.quantized.linear_dynamic_fp16(x, packed)
        except (RuntimeError, AttributeError):
            return None
    raise SystemExit(f"unknown kernel {kernel!r}; one of {', '.join(KERNELS)}")


def time_ms(fn, x: torch.Tensor, budget_s: float) -> float:
    fn(x)
    times, started = [], time.perf_counter()
    while len(times) < 3 or (time.perf_counter() - started < budget_s and len(times) < 200):
        t0 = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"rows {QUICK_ROWS} only, shorter timing")
    parser.add_argument("--threads", default="1,2", help="torch thread counts to time (default %(default)s)")
    parser.add_argument("--kernels", default=",".join(DEFAULT_KERNELS),
                        help=f"comma-separated from {', '.join(KERNELS)} (default: all but w8a8-intmm)")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="default: all")
    parser.add_argument("--rows", help="comma-separated row counts (default: 1..512 in powers of two)")
    parser.add_argument("--lm-head-max-rows", type=int, default=256,
                        help="lm_head runs on the sampled rows only (one per sequence): rows above this are skipped")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    rows_list = [int(r) for r in args.rows.split(",")] if args.rows else (QUICK_ROWS if args.quick else ROWS)
    budget = 0.1 if args.quick else 0.3
    threads_list = [int(t) for t in args.threads.split(",")]
    info = common.machine(threads_list[0])
    info["torch_cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    torch.manual_seed(0)
    results = []
    for shape in args.shapes.split(","):
        in_f, out_f = SHAPES[shape]
        weight = torch.randn(out_f, in_f) * in_f**-0.5
        fns = {k: build(k, weight) for k in args.kernels.split(",")}
        for threads in threads_list:
            torch.set_num_threads(threads)
            for rows in rows_list:
                if shape == "lm_head" and rows > args.lm_head_max_rows:
                    continue
                x = torch.randn(rows, in_f)
                with torch.inference_mode():
                    times = {k: time_ms(fn, x, budget) for k, fn in fns.items() if fn is not None}
                base = times.get("fp32")
                for kernel, ms in times.items():
                    results.append({"shape": shape, "in": in_f, "out": out_f, "rows": rows, "threads": threads,
                                    "kernel": kernel, "ms": ms, "speedup_vs_fp32": base / ms if base else None})
                best = min(times, key=times.get)
                print(f"{shape:8} t{threads} rows {rows:4}: " + "  ".join(
                    f"{k} {v:.3f}" + (f" ({base / v:.2f}x)" if base and k != "fp32" else "") for k, v in times.items())
                    + f"  best {best}", flush=True)
    common.write_json(args.json, {"benchmark": "quant_linear", "quick": args.quick,
                                  "machine": common.finish_machine(info), "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
