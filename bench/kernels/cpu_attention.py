"""CPU decode attention, one layer: the torch backend's gather + SDPA (its path before the paged
kernel, `TorchBackend(paged_decode=False)`) against cpu_paged's kernel reading the blocks in place
(`TorchBackend()`, the default), through the backend's own `attend` as the model calls it.

SmolLM2-135M's attention shapes (9 query heads, 3 KV heads, head_dim 64, 16-token blocks), fp32,
scattered block tables, for batches 1..64 x contexts 16..512 (all sequences the same length) plus
mixed-length batches (lengths drawn uniformly, as under continuous batching). Each timing walks
--layers separate KV caches, as a step walks the model's layers, so the KV is not read from a warm
cache; the per-layer time is reported (min and median of --repeats, the two paths interleaved),
with the largest difference between their outputs. --kernel-threads N also times the kernel
splitting the decodes over N pthreads (the backend runs it on one). Records the CPU model, its
SIMD flags and the load average.

    python -m bench.kernels.cpu_attention --json docs/perf/cpu_attention.json
    python -m bench.kernels.cpu_attention --quick
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

import torch

from bench import common
from iterserve.engine.attention import cpu_paged
from iterserve.engine.attention.backend import AttentionMetadata
from iterserve.engine.attention.torch_backend import TorchBackend
from iterserve.machine import cpu_flags

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
BATCHES, CONTEXTS = (1, 4, 16, 64), (16, 64, 128, 256, 512)
MIXED = ((16, (16, 512)), (64, (16, 512)), (64, (20, 200)))  # (sequences, length range)
SIMD_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512_bf16", "amx_tile")


def make_case(seq_lens: list[int], layers: int, seed: int):
    """Per-layer KV caches with each sequence's blocks scattered, the query, and the step's metadata
    (one per path, as each step builds its own)."""
    gen = torch.Generator().manual_seed(seed)
    counts = [-(-n // BLOCK) for n in seq_lens]
    num_blocks = sum(counts) + 8
    caches = [(torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen) * 0.1,
               torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen) * 0.1) for _ in range(layers)]
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables, used = [], 0
    for count in counts:
        tables.append(order[used:used + count])
        used += count
    query = torch.randn(len(seq_lens), HEADS, HEAD_DIM, generator=gen)
    metas = [AttentionMetadata.build([1] * len(seq_lens), seq_lens, tables, BLOCK) for _ in range(2)]
    return query, caches, metas


class KernelThreads:
    """cpu_paged's kernel called directly with `threads` pthreads (every row a decode, in order)."""

    def __init__(self, threads: int):
        self.threads = threads

    def attend(self, query, k_cache, v_cache, meta, scale):
        out = torch.empty_like(query)
        index = torch.arange(meta.num_seqs)
        cpu_paged.paged_decode(query, k_cache, v_cache, meta.block_tables, meta.seq_lens, index, index, scale, out,
                               threads=self.threads)
        return out


def time_layers(backend, query, caches, meta, scale) -> float:
    start = time.perf_counter()
    for k_cache, v_cache in caches:
        backend.attend(query, k_cache, v_cache, meta, scale)
    return (time.perf_counter() - start) / len(caches)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="batches 1 and 64, contexts 64 and 512, 5 repeats")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--layers", type=int, default=8, help="separate KV caches walked per timing (default 8)")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--kernel-threads", type=int, default=1,
                        help="also time the kernel split over this many pthreads (default 1: not timed)")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    common.set_threads(args.threads)
    batches, contexts = ((1, 64), (64, 512)) if args.quick else (BATCHES, CONTEXTS)
    repeats = 5 if args.quick else args.repeats
    rng = random.Random(0)
    cases = [(f"{b} x {c}", [c] * b) for b in batches for c in contexts]
    for seqs, (low, high) in MIXED[:1] if args.quick else MIXED:
        cases.append((f"{seqs} x {low}..{high}", [rng.randint(low, high) for _ in range(seqs)]))
    info = common.machine(args.threads)
    info["cpu_flags"] = [f for f in SIMD_FLAGS if f in cpu_flags()]
    info["torch_cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    started = time.perf_counter()
    kernel = cpu_paged.load()
    info["kernel_build_or_load_s"] = time.perf_counter() - started
    if kernel is None:
        print("cpu_paged's kernel is unavailable (no C compiler?): nothing to compare", file=sys.stderr)
        return 1
    paths = {"gather_sdpa": TorchBackend(paged_decode=False), "paged_kernel": TorchBackend()}
    threaded = f"paged_kernel_{args.kernel_threads}_threads"
    if args.kernel_threads > 1:
        paths[threaded] = KernelThreads(args.kernel_threads)
    scale = HEAD_DIM**-0.5
    rows, results = [], []
    with torch.inference_mode():
        for label, seq_lens in cases:
            query, caches, metas = make_case(seq_lens, args.layers, seed=len(seq_lens) * 1000 + sum(seq_lens))
            metas += metas[1:2] * (len(paths) - 2)  # the threaded kernel builds no plan
            outputs = [backend.attend(query, *caches[0], meta, scale)
                       for backend, meta in zip(paths.values(), metas, strict=True)]
            error = max((out - outputs[0]).abs().max().item() for out in outputs[1:])
            times: dict[str, list[float]] = {name: [] for name in paths}
            for _ in range(repeats):
                for (name, backend), meta in zip(paths.items(), metas, strict=True):
                    times[name].append(time_layers(backend, query, caches, meta, scale))
            entry = {"case": label, "seqs": len(seq_lens), "seq_lens": seq_lens, "max_abs_diff": error,
                     **{f"{name}_ms": {"min": min(t) * 1e3, "median": statistics.median(t) * 1e3}
                        for name, t in times.items()}}
            entry["speedup_min"] = entry["gather_sdpa_ms"]["min"] / entry["paged_kernel_ms"]["min"]
            entry["speedup_median"] = entry["gather_sdpa_ms"]["median"] / entry["paged_kernel_ms"]["median"]
            results.append(entry)
            rows.append([label, entry["gather_sdpa_ms"]["min"], entry["gather_sdpa_ms"]["median"],
                         entry["paged_kernel_ms"]["min"], entry["paged_kernel_ms"]["median"],
                         entry["speedup_min"], entry["speedup_median"], error]
                        + ([entry[f"{threaded}_ms"]["min"], entry[f"{threaded}_ms"]["median"]]
                           if args.kernel_threads > 1 else []))
            print(f"{label} done", file=sys.stderr, flush=True)
    print(common.format_table(["seqs x context", "gather+SDPA min ms", "median", "paged kernel min ms", "median",
                               "speedup (min)", "(median)", "max |diff|"]
                              + ([f"kernel {args.kernel_threads} threads min ms", "median"]
                                 if args.kernel_threads > 1 else []), rows))
    machine = common.finish_machine(info)
    print(f"{machine['cpu_model']} {' '.join(machine['cpu_flags'])}; per layer, {args.threads} thread(s); "
          f"load average (1 min) {machine['load_average_at_start'][0]:.1f} -> {machine['load_average_at_end'][0]:.1f}")
    common.write_json(args.json, {"benchmark": "cpu_attention", "threads": args.threads, "layers": args.layers,
                                  "kernel_threads": args.kernel_threads,
                                  "repeats": repeats, "shape": {"heads": HEADS, "kv_heads": KV_HEADS,
                                                                "head_dim": HEAD_DIM, "block_size": BLOCK},
                                  "machine": machine, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
