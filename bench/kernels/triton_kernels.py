"""Times every Triton kernel against the torch reference backend on a CUDA GPU.

Decode attention runs over a grid of batch sizes x context lengths and reports the achieved memory
bandwidth: bytes of K and V read (each sequence's context, once per KV head) over the kernel time.
Extend attention times one prefill chunk per sequence over a cached prefix; the row-wise ops time a
step of `batch` decode tokens and a 2048-token prefill step. Results print as a table and, with
--json, are written as JSON.

    python -m bench.kernels.triton_kernels --json bench/results/kernels.json

Without a CUDA device it says so and exits 0. --cpu-smoke instead runs a tiny grid on CPU through
the Triton interpreter (timings meaningless) to check that this script works.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from functools import partial
from pathlib import Path

DTYPES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ints = lambda text: [int(v) for v in text.split(",")]  # noqa: E731
    parser.add_argument("--batch-sizes", type=ints, default=[1, 8, 32, 128], help="comma-separated")
    parser.add_argument("--context-lens", type=ints, default=[512, 2048, 8192], help="comma-separated")
    parser.add_argument("--num-heads", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=4096, help="hidden size for rms_norm")
    parser.add_argument("--intermediate", type=int, default=14336, help="MLP width for silu_and_mul")
    parser.add_argument("--prefill-chunk", type=int, default=512, help="new tokens per sequence in extend")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="tiny grid on CPU through the Triton interpreter, to test this script")
    args = parser.parse_args(argv)
    if args.num_heads % args.num_kv_heads:
        parser.error(f"--num-heads ({args.num_heads}) must be a multiple of --num-kv-heads ({args.num_kv_heads})")
    if args.cpu_smoke:
        args.batch_sizes, args.context_lens = [1, 3], [17, 40]
        args.num_heads, args.num_kv_heads, args.head_dim = 4, 2, 64
        args.hidden, args.intermediate, args.prefill_chunk, args.dtype = 64, 96, 8, "fp32"
    return args


class Timer:
    """Median milliseconds per call: CUDA events through triton's do_bench, or wall time on CPU."""

    def __init__(self, device: str):
        self.device = device

    def __call__(self, fn) -> float:
        if self.device == "cuda":
            from triton.testing import do_bench

            return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))
        fn()
        times = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return sorted(times)[1]


def paged_batch(torch, query_lens, seq_lens, args, dtype, device):
    """KV caches and metadata for one step, blocks handed out in shuffled order."""
    from iterserve.engine.attention.backend import AttentionMetadata

    bs = args.block_size
    needed = [-(-s // bs) for s in seq_lens]
    order = torch.randperm(sum(needed)).tolist()
    tables, start = [], 0
    for n in needed:
        tables.append(order[start:start + n])
        start += n
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, bs, device)
    shape = (sum(needed), bs, args.num_kv_heads, args.head_dim)
    k_cache = torch.randn(shape, dtype=dtype, device=device)
    v_cache = torch.randn(shape, dtype=dtype, device=device)
    query = torch.randn(sum(query_lens), args.num_heads, args.head_dim, dtype=dtype, device=device)
    return meta, k_cache, v_cache, query


def bench_attention(torch, args, dtype, device, timer, triton_backend, torch_backend) -> list[dict]:
    rows = []
    scale = args.head_dim ** -0.5
    itemsize = torch.empty((), dtype=dtype).element_size()
    for batch in args.batch_sizes:
        for context in args.context_lens:
            meta, k_cache, v_cache, query = paged_batch(torch, [1] * batch, [context] * batch, args, dtype, device)
            got = triton_backend.attend(query, k_cache, v_cache, meta, scale)
            want = torch_backend.attend(query, k_cache, v_cache, meta, scale)
            kv_bytes = 2 * batch * context * args.num_kv_heads * args.head_dim * itemsize
            t_triton = timer(partial(triton_backend.attend, query, k_cache, v_cache, meta, scale))
            t_torch = timer(partial(torch_backend.attend, query, k_cache, v_cache, meta, scale))
            rows.append(dict(kernel="decode_attention", batch=batch, context=context, triton_ms=t_triton,
                             torch_ms=t_torch, kv_bytes=kv_bytes, triton_gbps=kv_bytes / t_triton / 1e6,
                             torch_gbps=kv_bytes / t_torch / 1e6,
                             max_abs_error=(got.float() - want.float()).abs().max().item()))

            chunk = min(args.prefill_chunk, context)
            meta, k_cache, v_cache, query = paged_batch(torch, [chunk] * batch, [context] * batch, args, dtype, device)
            t_triton = timer(partial(triton_backend.attend, query, k_cache, v_cache, meta, scale))
            t_torch = timer(partial(torch_backend.attend, query, k_cache, v_cache, meta, scale))
            rows.append(dict(kernel=f"extend_attention (chunk {chunk})", batch=batch, context=context,
                             triton_ms=t_triton, torch_ms=t_torch))
            del query, k_cache, v_cache, meta, got, want
            if device == "cuda":
                torch.cuda.empty_cache()
    return rows


def bench_row_ops(torch, args, dtype, device, timer, triton_backend, torch_backend) -> list[dict]:
    from iterserve.engine.attention.backend import AttentionMetadata

    rows = []
    token_counts = sorted(set(args.batch_sizes) | {2048 if device == "cuda" else 8})
    for tokens in token_counts:
        x = torch.randn(tokens, args.hidden, dtype=dtype, device=device)
        query = torch.randn(tokens, args.num_heads, args.head_dim, dtype=dtype, device=device)
        key = torch.randn(tokens, args.num_kv_heads, args.head_dim, dtype=dtype, device=device)
        blocks = -(-tokens // args.block_size) + 1
        k_cache = torch.zeros(blocks, args.block_size, args.num_kv_heads, args.head_dim, dtype=dtype, device=device)
        cases = {  # name: (backend method, its arguments)
            "rms_norm+residual": ("rms_norm", (x, torch.randn(args.hidden, dtype=dtype, device=device), 1e-6,
                                               torch.randn_like(x))),
            "silu_and_mul": ("silu_and_mul", (torch.randn(tokens, 2 * args.intermediate, dtype=dtype, device=device),)),
            "rotary": ("rotary", (query, key, torch.randint(0, 4096, (tokens,), device=device),
                                  torch.randn(4096, args.head_dim, dtype=torch.float32, device=device))),
            "write_kv": ("write_kv", (key, key, k_cache, torch.zeros_like(k_cache),
                                      AttentionMetadata.build([tokens], [tokens], [list(range(blocks))],
                                                              args.block_size, device))),
        }
        for name, (method, call_args) in cases.items():
            rows.append(dict(kernel=name, batch=tokens, context=None,
                             triton_ms=timer(partial(getattr(triton_backend, method), *call_args)),
                             torch_ms=timer(partial(getattr(torch_backend, method), *call_args))))
    return rows


def format_table(rows: list[dict]) -> str:
    headers = ["kernel", "tokens/seqs", "context", "triton ms", "torch ms", "speedup", "triton GB/s", "torch GB/s"]
    cells = []
    for r in rows:
        cells.append([r["kernel"], str(r["batch"]), str(r["context"] or "-"), f"{r['triton_ms']:.4f}",
                      f"{r['torch_ms']:.4f}", f"{r['torch_ms'] / r['triton_ms']:.2f}x",
                      f"{r['triton_gbps']:.4g}" if "triton_gbps" in r else "-",
                      f"{r['torch_gbps']:.4g}" if "torch_gbps" in r else "-"])
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(headers, widths, strict=True)))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True)))
              for row in cells]
    return "\n".join(lines)


def write_json(path: str | None, data: dict) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.cpu_smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    import torch

    if not args.cpu_smoke and not torch.cuda.is_available():
        message = "no CUDA device: the kernel benchmark needs a GPU and was not run"
        print(message)
        write_json(args.json, {"skipped": message})
        return 0
    device = "cpu" if args.cpu_smoke else "cuda"
    dtype = getattr(torch, DTYPES[args.dtype])
    torch.manual_seed(0)

    from iterserve.engine.attention.torch_backend import TorchBackend
    from iterserve.engine.attention.triton_backend import TritonBackend

    backends = (TritonBackend(), TorchBackend())
    timer = Timer(device)
    rows = bench_attention(torch, args, dtype, device, timer, *backends)
    rows += bench_row_ops(torch, args, dtype, device, timer, *backends)
    print(format_table(rows))
    device_name = torch.cuda.get_device_name() if device == "cuda" else "cpu (triton interpreter)"
    decode = [r for r in rows if r["kernel"] == "decode_attention"]
    best = max(decode, key=lambda r: r["triton_gbps"])
    print(f"\n{device_name}: decode attention peaks at {best['triton_gbps']:.4g} GB/s of K/V "
          f"(batch {best['batch']}, context {best['context']}); max |triton - torch| "
          f"{max(r['max_abs_error'] for r in decode):.3g}")
    write_json(args.json, {
        "device": device_name, "dtype": args.dtype, "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "shape": {k: getattr(args, k) for k in ("num_heads", "num_kv_heads", "head_dim", "block_size",
                                                "hidden", "intermediate", "prefill_chunk")},
        "results": rows,
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
