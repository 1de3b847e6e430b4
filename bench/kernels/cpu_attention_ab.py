"""The paged decode attention kernel (engine/attention/cpu_paged.py) against its own source at an
earlier git revision: both compiled here, timed interleaved on SmolLM2-135M's attention shapes,
each timing walking 30 separate KV caches (as a step walks the layers, so the KV comes from
memory) with scattered block tables; best of --repeats per layer, and the largest difference
between the two outputs. Not run in CI.

    python -m bench.kernels.cpu_attention_ab --rev HEAD~1
"""

from __future__ import annotations

import argparse
import ctypes
import random
import subprocess
import time

import torch

from bench import common
from iterserve.engine import native
from iterserve.engine.attention import cpu_paged
from iterserve.engine.attention.backend import AttentionMetadata

HEADS, KV_HEADS, HEAD_DIM, BLOCK, LAYERS = 9, 3, 64, 16, 30
CASES = ((64, 64), (32, 48), (16, 128), (2, 256))  # (sequences, context tokens each)


def kernel_at(rev: str | None):
    if rev is None:
        source = cpu_paged._SOURCE
    else:
        text = subprocess.run(["git", "show", f"{rev}:engine/attention/cpu_paged.py"], check=True, text=True,
                              capture_output=True, cwd=common.REPO).stdout
        source = text.split('_SOURCE = r"""', 1)[1].split('"""', 1)[0]
    lib = native.build("paged_decode_ab", source)
    if lib is None:
        raise SystemExit("no C compiler: nothing to compare")
    fn = lib.paged_decode_attention
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fn.argtypes = [ptr, i64, ptr, ptr, ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, i64, ctypes.c_float, ptr, i64,
                   i64]
    return fn


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rev", default="HEAD~1", help="the revision to compare with (default %(default)s)")
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    info = common.machine(1)
    kernels = {args.rev: kernel_at(args.rev), "working tree": kernel_at(None)}
    rng = random.Random(0)
    results = []
    for seqs, context in CASES:
        per_seq = -(-context // BLOCK)
        blocks = list(range(2 * seqs * per_seq))
        rng.shuffle(blocks)
        caches = [(torch.randn(len(blocks), BLOCK, KV_HEADS, HEAD_DIM), torch.randn(len(blocks), BLOCK, KV_HEADS,
                   HEAD_DIM)) for _ in range(LAYERS)]
        meta = AttentionMetadata.build([1] * seqs, [context] * seqs,
                                       [blocks[i * per_seq:(i + 1) * per_seq] for i in range(seqs)], BLOCK)
        query, index = torch.randn(seqs, HEADS, HEAD_DIM), torch.arange(seqs)
        outs = {name: torch.empty_like(query) for name in kernels}
        best = dict.fromkeys(kernels, float("inf"))
        for _ in range(args.repeats):
            for name, fn in kernels.items():
                out = outs[name]
                start = time.perf_counter()
                for k_cache, v_cache in caches:
                    fn(query.data_ptr(), query.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
                       meta.block_tables.data_ptr(), meta.block_tables.stride(0), meta.seq_lens.data_ptr(),
                       index.data_ptr(), index.data_ptr(), seqs, HEADS, KV_HEADS, HEAD_DIM, BLOCK, HEAD_DIM**-0.5,
                       out.data_ptr(), out.stride(0), 1)
                best[name] = min(best[name], (time.perf_counter() - start) / LAYERS)
        old, new = best[args.rev], best["working tree"]
        diff = (outs[args.rev] - outs["working tree"]).abs().max().item()
        results.append({"sequences": seqs, "context": context, "old_ms": old * 1e3, "new_ms": new * 1e3,
                        "speedup": old / new, "max_abs_diff": diff})
        print(f"{seqs:3} x {context:3}: {args.rev} {old * 1e3:6.3f} ms, working tree {new * 1e3:6.3f} ms per layer "
              f"({old / new:.2f}x), max |diff| {diff:.1e}", flush=True)
    common.write_json(args.json, {"benchmark": "cpu_attention_ab", "rev": args.rev,
                                  "machine": common.finish_machine(info), "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
