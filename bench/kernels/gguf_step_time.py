"""Step time of the embedded SmolLM2-135M per --quantization mode (none: dequantized fp32; gguf: the
file's own Q4_1 / Q8_0 blocks, what `auto` runs; w8a8), for
decode steps of 1..64 sequences at a context of --context tokens and one prefill chunk: the model's
forward and logits of the sampled rows, medians of --repeats steps. The modes alternate step by step
in one process, so a busy machine slows them alike: read the ratios.

    .venv/bin/python -m bench.kernels.gguf_step_time --json docs/perf/gguf_step_time.json
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench import common


def main() -> None:
    from bench.kernels.gguf_accuracy import build_models, caches
    from iterserve.engine.attention.backend import AttentionMetadata

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", default="none,gguf,w8a8")
    parser.add_argument("--batches", default="1,4,16,64")
    parser.add_argument("--prefill", type=int, default=256, help="tokens of the prefill step")
    parser.add_argument("--context", type=int, default=128, help="tokens already cached per decode sequence")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="cpu: the calling thread's CPU time (with --threads 1 every step runs on it), which a "
                             "machine loaded by other work inflates far less than the wall clock")
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.clock == "cpu" and args.threads != 1:
        raise SystemExit("--clock cpu measures the calling thread: use it with --threads 1")
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    common.set_threads(args.threads)
    from iterserve.engine.model import cpu_gguf, cpu_w8a8

    cpu_w8a8.set_threads(args.threads)
    machine = common.machine(args.threads)
    modes = args.modes.split(",")
    models, _, path = build_models(modes)
    shapes = [("decode", int(b)) for b in args.batches.split(",")] + [("prefill", args.prefill)]
    results = []
    with torch.inference_mode():
        for kind, size in shapes:
            seqs = size if kind == "decode" else 1
            per_seq = -(-(args.context + size + 1) // 16)
            tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(seqs)]
            if kind == "decode":
                meta = AttentionMetadata.build([1] * seqs, [args.context + 1] * seqs, tables, 16)
                ids, positions, sampled = torch.randint(0, 40000, (seqs,)), torch.full((seqs,), args.context), seqs
            else:
                meta = AttentionMetadata.build([size], [size], tables, 16)
                ids, positions, sampled = torch.randint(0, 40000, (size,)), torch.arange(size), 1
            pools = {mode: caches(models[mode], per_seq * seqs) for mode in modes}
            times = {mode: [] for mode in modes}
            for _ in range(args.repeats + 1):
                for mode in modes:
                    start = clock()
                    hidden = models[mode](ids, positions, pools[mode], meta)
                    models[mode].compute_logits(hidden[-sampled:])
                    times[mode].append(clock() - start)
            row = {"step": kind, "size": size}
            for mode in modes:
                row[f"{mode}_ms"] = statistics.median(times[mode][1:]) * 1e3
            for mode in modes:
                row[f"{mode}_vs_none"] = row["none_ms"] / row[f"{mode}_ms"] if "none" in modes else None
            results.append(row)
            print(kind, size, " ".join(f"{m} {row[f'{m}_ms']:.1f} ms" for m in modes), flush=True)
    common.write_json(args.json, {"model": path.name, "threads": args.threads, "context": args.context,
                                  "clock": args.clock, "isa": cpu_gguf.isa_path(),
                                  "results": results, "machine": common.finish_machine(machine)})


if __name__ == "__main__":
    main()
