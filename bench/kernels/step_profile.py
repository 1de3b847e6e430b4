"""One decode step of the real model, timed: a tail step (few long sequences left) and a full-batch
step (many short ones), for fp32 / int8 / int4 / w8a8 linears, optionally also with --compile
(engine/model/compiled.py), and with the torch attention backend of an earlier commit
(--baseline-rev) for the before/after comparison. Prints where the time goes (torch.profiler, top
ops) for each.

    python -m bench.kernels.step_profile --threads 1 --compile --json docs/perf/step_profile.json
    python -m bench.kernels.step_profile --baseline-rev cb1c555~1 --modes none,int8
    python -m bench.kernels.step_profile --modes w8a8 --thread-sweep --json docs/perf/step_threads.json

--thread-sweep instead times each mode's decode steps (1..64 sequences at 128 tokens of context) and
one-prompt prefills (128, 512 tokens) with 1 and 2 torch threads, alternating, best of each: what
`--threads auto` (engine/model/threads.py) bases its per-step choice on.

--split-sweep times steps of several sequences (decodes of 4..64 sequences at 128 tokens of context,
prefills of 2..16 prompts of 32 tokens, a mixed step, one 512-token prompt) three ways, alternating:
one call on 1 thread, one call on 2 threads, and split execution (engine/model/split_step.py: two
cost-balanced groups at once, 1 thread each), best of each; what the split threshold is based on.
libgomp reads OMP_WAIT_POLICY when torch loads: run it as `iterserve serve` does, with
OMP_WAIT_POLICY=PASSIVE (the JSON records the policy).

    OMP_WAIT_POLICY=PASSIVE python -m bench.kernels.step_profile --modes w8a8 --split-sweep --json docs/perf/step_split.json
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from bench import common
from bench.kernels import baseline
from iterserve.engine.attention.backend import AttentionMetadata, get_backend
from iterserve.engine.model.llama import LlamaModel
from iterserve.engine.model.loader import load_model
from iterserve.engine.model.registry import resolve_model_path

SCENARIOS = {"tail": (2, 256), "full": (64, 64)}  # (sequences decoding, context length each)
BLOCK = 16


def baseline_backend(rev: str):
    """TorchBackend as it was at rev."""
    return baseline.torch_backend_class(rev)()


def step(model: LlamaModel, caches, seqs: int, context: int):
    blocks_per_seq = -(-context // BLOCK)
    tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(seqs)]
    meta = AttentionMetadata.build([1] * seqs, [context] * seqs, tables, BLOCK)
    ids = torch.randint(100, 250, (seqs,))
    positions = torch.full((seqs,), context - 1)
    return model.compute_logits(model(ids, positions, caches, meta))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline-rev", help="also time the torch backend of this git revision (fp32)")
    parser.add_argument("--baseline-modes", default="none",
                        help="--quantization modes timed with --baseline-rev's backend (default %(default)s)")
    parser.add_argument("--modes", default="none,int8,int4,w8a8", help="--quantization modes (default %(default)s)")
    parser.add_argument("--compile", action="store_true", help="also time each mode with --compile")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1: what `iterserve serve` uses on a 2-CPU machine)")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per case (the minimum is kept)")
    parser.add_argument("--thread-sweep", action="store_true", help="1 vs 2 threads over step sizes (see above)")
    parser.add_argument("--split-sweep", action="store_true",
                        help="split execution vs one call on 1 and 2 threads over step sizes (see above)")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    path = resolve_model_path(None)[0]
    loaded = load_model(path, show_progress=False, keep_q4_1=True)
    cfg = loaded.config
    num_blocks = max(s * -(-c // BLOCK) for s, c in SCENARIOS.values())
    caches = [(torch.randn(num_blocks, BLOCK, cfg.num_kv_heads, cfg.head_dim) * 0.1,
               torch.randn(num_blocks, BLOCK, cfg.num_kv_heads, cfg.head_dim) * 0.1) for _ in range(cfg.num_layers)]
    cases = [(mode, variant, get_backend("torch")) for mode in args.modes.split(",")
             for variant in (("torch", "torch+compile") if args.compile else ("torch",))]
    if args.baseline_rev:
        cases[:0] = [(mode, f"torch@{args.baseline_rev}", baseline_backend(args.baseline_rev))
                     for mode in args.baseline_modes.split(",")]
    results = []
    info = common.machine(args.threads)
    if args.thread_sweep:
        return thread_sweep(args, loaded, info)
    if args.split_sweep:
        return split_sweep(args, loaded, info)
    for mode, backend_name, backend in cases:
        model = LlamaModel.from_weights(cfg, dict(loaded.weights), backend, torch.device("cpu"), torch.float32,
                                        max_positions=512, quantization=mode, q4_1=dict(loaded.q4_1))
        compile_s = None
        if backend_name.endswith("+compile"):
            from iterserve.engine.model.compiled import compile_model

            started = time.perf_counter()
            compile_model(model)
            compile_s = time.perf_counter() - started
        for scenario, (seqs, context) in SCENARIOS.items():
            with torch.inference_mode():
                step(model, caches, seqs, context)
                best = float("inf")
                for _ in range(args.repeats):
                    start = time.perf_counter()
                    step(model, caches, seqs, context)
                    best = min(best, time.perf_counter() - start)
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                    step(model, caches, seqs, context)
            top = [(e.key, e.self_cpu_time_total / 1e3) for e in
                   sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:6]]
            row = {"quantization": mode, "backend": backend_name, "scenario": scenario, "seqs": seqs,
                   "context": context, "step_ms": best * 1e3, "tokens_per_s": seqs / best,
                   "top_ops_ms": top, "compile_s": compile_s, "load_average_1m": os.getloadavg()[0]}
            results.append(row)
            print(f"{mode:5} {backend_name:22} {scenario:5} {seqs:3} seqs x {context}: {best * 1e3:7.1f} ms "
                  f"({seqs / best:6.1f} tok/s)  top: " + ", ".join(f"{k} {v:.1f}" for k, v in top[:4]),
                  flush=True)
        del model
    common.write_json(args.json, {"benchmark": "step_profile", "machine": common.finish_machine(info),
                                  "results": results})
    return 0


SWEEP = (1, 2, 4, 8, 16, 32, 64, "prefill 128", "prefill 512")


def sweep_case(model: LlamaModel, caches, case) -> torch.Tensor:
    """A decode step of `case` sequences at 128 tokens, or a "prefill N" of one N-token prompt."""
    if isinstance(case, int):
        return step(model, caches, case, 128)
    n = int(case.split()[1])
    meta = AttentionMetadata.build([n], [n], [list(range(-(-n // BLOCK)))], BLOCK)
    return model.compute_logits(model(torch.randint(100, 250, (n,)), torch.arange(n), caches, meta)[-1:])


def thread_sweep(args, loaded, info) -> int:
    cfg = loaded.config
    caches = [(torch.randn(64 * 8 + 32, BLOCK, cfg.num_kv_heads, cfg.head_dim) * 0.1,
               torch.randn(64 * 8 + 32, BLOCK, cfg.num_kv_heads, cfg.head_dim) * 0.1) for _ in range(cfg.num_layers)]
    results = []
    for mode in args.modes.split(","):
        model = LlamaModel.from_weights(cfg, dict(loaded.weights), get_backend("torch"), torch.device("cpu"),
                                        torch.float32, max_positions=512, quantization=mode, q4_1=dict(loaded.q4_1))
        for case in SWEEP:
            best = {1: float("inf"), 2: float("inf")}
            with torch.inference_mode():
                for threads in (1, 2) * max(2, args.repeats // 2):
                    torch.set_num_threads(threads)
                    sweep_case(model, caches, case)
                    started = time.perf_counter()
                    sweep_case(model, caches, case)
                    best[threads] = min(best[threads], time.perf_counter() - started)
            results.append({"quantization": mode, "case": case if isinstance(case, str) else f"decode {case} x 128",
                            "t1_ms": best[1] * 1e3, "t2_ms": best[2] * 1e3, "speedup_t2": best[1] / best[2],
                            "load_average_1m": os.getloadavg()[0]})
            r = results[-1]
            print(f"{mode:5} {r['case']:14}: 1 thread {r['t1_ms']:7.1f} ms, 2 threads {r['t2_ms']:7.1f} ms "
                  f"({r['speedup_t2']:.2f}x)", flush=True)
        del model
    common.write_json(args.json, {"benchmark": "step_profile --thread-sweep", "machine": common.finish_machine(info),
                                  "results": results})
    return 0


# (name, chunks as (first position, tokens)): every chunk samples its last row, as a step's last chunks do.
SPLIT_CASES = [(f"decode {n} x 128", [(127, 1)] * n) for n in (4, 16, 24, 32, 48, 64)] + [
    (f"prefill {n} x 32", [(0, 32)] * n) for n in (2, 4, 8, 16)] + [
    ("prefill 8 x 32 + decode 32 x 128", [(0, 32)] * 8 + [(127, 1)] * 32),
    ("prefill 1 x 512", [(0, 512)]),
]


def chunks_step(model: LlamaModel, caches, chunks, first_block: int = 0) -> torch.Tensor:
    """Model + LM head over chunks [(start, tokens)], each sequence in its own blocks from first_block
    on, as the model runner builds a step; logits of each chunk's last row."""
    ids, positions, query_lens, seq_lens, tables, last = [], [], [], [], [], []
    block = first_block
    for start, n in chunks:
        blocks = -(-(start + n) // BLOCK)
        tables.append(list(range(block, block + blocks)))
        block += blocks
        ids += [100 + (start + i) % 150 for i in range(n)]
        positions += range(start, start + n)
        query_lens.append(n)
        seq_lens.append(start + n)
        last.append(len(ids) - 1)
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, BLOCK)
    hidden = model(torch.tensor(ids), torch.tensor(positions), caches, meta)
    return model.compute_logits(hidden[torch.tensor(last)])


def time_split_case(model: LlamaModel, caches, split, chunks, repeats: int):
    """Best times (s) of one call on 1 and 2 threads and of split execution (None when the engine's
    plan would not split), alternating; and the groups' sizes."""
    from iterserve.engine.model.split_step import chunk_cost, plan_split

    groups = plan_split([chunk_cost(start, n, True) for start, n in chunks])
    variants = {"t1": lambda: chunks_step(model, caches, chunks), "t2": lambda: chunks_step(model, caches, chunks)}
    if groups is not None:  # the second group's blocks after the first's: disjoint, as in the engine
        first, second = ([chunks[i] for i in group] for group in groups)
        offset = sum(-(-(start + n) // BLOCK) for start, n in first)
        parts = (lambda: chunks_step(model, caches, first), lambda: chunks_step(model, caches, second, offset))
        variants["split"] = lambda: split.run(parts)
    best = dict.fromkeys(("t1", "t2", "split"), float("inf"))
    with torch.inference_mode():
        for _ in range(max(2, repeats)):
            for variant, run in variants.items():
                torch.set_num_threads(2 if variant == "t2" else 1)
                run()
                started = time.perf_counter()
                run()
                best[variant] = min(best[variant], time.perf_counter() - started)
    return best["t1"], best["t2"], best["split"] if groups else None, [len(g) for g in groups] if groups else None


def split_sweep(args, loaded, info) -> int:
    from iterserve.engine.model.split_step import SPLIT_MIN_TOKENS, StepSplit

    cfg = loaded.config
    caches = [(torch.randn(64 * 8 + 64, BLOCK, cfg.num_kv_heads, cfg.head_dim) * 0.1,
               torch.randn(64 * 8 + 64, BLOCK, cfg.num_kv_heads, cfg.head_dim) * 0.1) for _ in range(cfg.num_layers)]
    split = StepSplit(min_tokens=1)
    results = []
    for mode in args.modes.split(","):
        model = LlamaModel.from_weights(cfg, dict(loaded.weights), get_backend("torch"), torch.device("cpu"),
                                        torch.float32, max_positions=640, quantization=mode, q4_1=dict(loaded.q4_1))
        for name, chunks in SPLIT_CASES:
            t1, t2, parts, groups = time_split_case(model, caches, split, chunks, args.repeats)
            tokens = sum(n for _, n in chunks)
            row = {"quantization": mode, "case": name, "tokens": tokens, "t1_ms": t1 * 1e3, "t2_ms": t2 * 1e3,
                   "split_ms": parts * 1e3 if parts else None, "groups": groups,
                   "split_vs_t2": t2 / parts if parts else None, "split_vs_t1": t1 / parts if parts else None,
                   "split_in_serve": bool(parts) and tokens >= SPLIT_MIN_TOKENS, "load_average_1m": os.getloadavg()[0]}
            results.append(row)
            split_text = (f"split {row['split_ms']:7.1f} ms ({row['split_vs_t2']:.2f}x vs 2 threads"
                          f"{', serve splits it' if row['split_in_serve'] else ''})" if parts else "split: not split")
            print(f"{mode:5} {name:32}: 1 thread {row['t1_ms']:7.1f} ms, 2 threads {row['t2_ms']:7.1f} ms, "
                  + split_text, flush=True)
        del model
    split.close()
    info = common.finish_machine(info)
    info["omp_wait_policy"] = os.environ.get("OMP_WAIT_POLICY", "unset")
    info["gomp_spincount"] = os.environ.get("GOMP_SPINCOUNT", "unset")
    common.write_json(args.json, {"benchmark": "step_profile --split-sweep", "machine": info, "results": results})
    return 0

if __name__ == "__main__":
    sys.exit(main())
