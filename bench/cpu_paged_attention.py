"""CPU decode attention: the torch backend's gather + SDPA against a gather-free paged version
that reads the KV blocks in place (torch.compile / inductor turns `k_cache[block_tables]` inside
the score and value reductions into indirect loads, so no padded KV batch is materialised).

SmolLM2-135M's attention shapes (9 query heads, 3 KV heads, head_dim 64, 16-token blocks), one
layer's decode step for several (sequences, context) shapes, the two versions timed interleaved
(min and median of --repeats), the compile time and the largest difference between the outputs.
Used to decide whether the engine takes the compiled path (docs/performance.md).

    python bench/cpu_paged_attention.py --json docs/perf/cpu_paged_attention.json
    python bench/cpu_paged_attention.py --quick
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import common
import torch
import torch.nn.functional as F

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
SHAPES = [(2, 256), (8, 500), (16, 512), (32, 200), (64, 64), (64, 256)]


def make_case(seqs: int, context: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    width = -(-context // BLOCK)
    num_blocks = seqs * width + 8
    k_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen) * 0.1
    v_cache = torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen) * 0.1
    tables = torch.randperm(num_blocks, generator=gen)[: seqs * width].view(seqs, width)  # scattered blocks
    lens = torch.full((seqs,), context)
    query = torch.randn(seqs, HEADS, HEAD_DIM, generator=gen)
    return query, k_cache, v_cache, tables, lens


def gather_sdpa(query, k_cache, v_cache, tables, lens, scale):
    """What engine/attention/torch_backend.py does for one decode bucket."""
    seqs, width = tables.shape
    k = k_cache[tables].view(seqs, width * BLOCK, KV_HEADS, HEAD_DIM).transpose(1, 2)
    v = v_cache[tables].view(seqs, width * BLOCK, KV_HEADS, HEAD_DIM).transpose(1, 2)
    mask = (torch.arange(width * BLOCK)[None, :] < lens[:, None])[:, None, None, :]
    return F.scaled_dot_product_attention(query.unsqueeze(2), k, v, attn_mask=mask, scale=scale,
                                          enable_gqa=True).squeeze(2)


def paged(query, k_cache, v_cache, tables, lens, scale):
    """The same attention written over the block tables; compiled, the gathers become indirect loads."""
    seqs, width = tables.shape
    group = HEADS // KV_HEADS
    q = query.view(seqs, KV_HEADS, group, HEAD_DIM)
    scores = torch.einsum("shgd,swbhd->shgwb", q, k_cache[tables]).reshape(seqs, KV_HEADS, group, -1) * scale
    positions = torch.arange(width * BLOCK)
    scores = scores.masked_fill(positions[None, None, None, :] >= lens[:, None, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).view(seqs, KV_HEADS, group, width, BLOCK)
    return torch.einsum("shgwb,swbhd->shgd", probs, v_cache[tables]).reshape(seqs, HEADS, HEAD_DIM)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="two shapes, 10 repeats")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    common.set_threads(args.threads)
    shapes = SHAPES[:1] + SHAPES[4:5] if args.quick else SHAPES
    repeats = 10 if args.quick else args.repeats
    info = common.machine(args.threads)
    compiled = torch.compile(paged, dynamic=True)
    rows, results = [], []
    with torch.inference_mode():
        for seqs, context in shapes:
            case = make_case(seqs, context, seed=seqs * 1000 + context)
            scale = HEAD_DIM**-0.5
            start = time.perf_counter()
            out = compiled(*case, scale)
            compile_s = time.perf_counter() - start
            error = (out - gather_sdpa(*case, scale)).abs().max().item()
            times: dict[str, list[float]] = {"gather_sdpa": [], "paged_compiled": []}
            for _ in range(repeats):
                for name, fn in (("gather_sdpa", gather_sdpa), ("paged_compiled", compiled)):
                    start = time.perf_counter()
                    fn(*case, scale)
                    times[name].append(time.perf_counter() - start)
            entry = {"seqs": seqs, "context": context, "first_call_s": compile_s, "max_abs_diff": error,
                     **{f"{k}_ms": {"min": min(v) * 1e3, "median": statistics.median(v) * 1e3}
                        for k, v in times.items()}}
            entry["speedup_min"] = entry["gather_sdpa_ms"]["min"] / entry["paged_compiled_ms"]["min"]
            results.append(entry)
            rows.append([f"{seqs} x {context}", entry["gather_sdpa_ms"]["min"], entry["gather_sdpa_ms"]["median"],
                         entry["paged_compiled_ms"]["min"], entry["paged_compiled_ms"]["median"],
                         entry["speedup_min"], compile_s, error])
            print(f"{seqs} x {context} done", file=sys.stderr, flush=True)
    print(common.format_table(["seqs x context", "gather min ms", "median", "paged min ms", "median",
                               "speedup (min)", "first call s", "max |diff|"], rows))
    machine = common.finish_machine(info)
    print(f"load average (1 min) {machine['load_average_at_start'][0]:.1f} -> {machine['load_average_at_end'][0]:.1f}")
    common.write_json(args.json, {"benchmark": "cpu_paged_attention", "threads": args.threads, "repeats": repeats,
                                  "machine": machine, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
