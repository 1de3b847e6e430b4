"""Tensor parallelism on a CPU: the engine's step time at --tensor-parallel-size 2 against 1, in
steady decode at several batch sizes and in one prefill step, and the share of rank 0's step spent
inside collectives (engine/distributed/group.py sums the time in every all-reduce and gather).

Both sizes use the same cores: TP=1 runs torch on all of them, TP=2 gives each rank its half
(engine/distributed/tensor_parallel.py). The model is the embedded SmolLM2-135M, dense fp32
(tensor parallelism shards dense weights only). Rank 0's collective time includes waiting for the
slower rank, so it measures communication plus imbalance. On a machine shared with other work the
figures are provisional: the JSON records the load average at the start and the end.

    python -m bench.engine.tp_step --json docs/perf/tp_step.json --plot docs/perf/tp_step.png
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

from bench import common
from iterserve.engine.config import EngineConfig
from iterserve.engine.llm_engine import LLMEngine
from iterserve.engine.sampling_params import SamplingParams

PROMPT_LEN = 32
PREFILL_LEN = 256


def measure(tp: int, batch: int, steps: int, model: str) -> dict:
    """Median model time per decode step with `batch` running sequences, and of one prefill step."""
    import torch

    if tp == 1:
        torch.set_num_threads(os.cpu_count() or 1)
    config = EngineConfig(model=model, tensor_parallel_size=tp, quantization="none", dtype="float32", device="cpu",
                          attention_backend="torch", max_num_seqs=max(batch, 1), num_kv_blocks=batch * 8 + 40,
                          max_model_len=512, max_num_batched_tokens=PREFILL_LEN, enable_prefix_caching=False)
    engine = LLMEngine.from_config(config)
    try:
        group = getattr(engine.executor, "group", None)
        # one prefill step of PREFILL_LEN tokens
        engine.add_request(None, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
                           [100 + j % 150 for j in range(PREFILL_LEN)])
        comm0 = group.seconds if group else 0.0
        engine.step()
        prefill_s = engine.last_timing.model_s
        prefill_comm = (group.seconds - comm0) if group else 0.0
        while engine.has_unfinished_requests():
            engine.step()
        params = SamplingParams(temperature=0, max_tokens=steps + PROMPT_LEN + 8, ignore_eos=True)
        for i in range(batch):
            engine.add_request(None, params, [100 + (i * 7 + j) % 150 for j in range(PROMPT_LEN)])
        for _ in range(4):  # the prompts, then a few warm decodes
            engine.step()
        times, comm = [], []
        for _ in range(steps):
            before = group.seconds if group else 0.0
            engine.step()
            times.append(engine.last_timing.model_s)
            comm.append((group.seconds - before) if group else 0.0)
        return {"tp": tp, "batch": batch, "decode_step_ms": 1000 * statistics.median(times),
                "decode_collective_share": statistics.median(c / t for c, t in zip(comm, times, strict=True)),
                "prefill_tokens": PREFILL_LEN, "prefill_step_ms": 1000 * prefill_s,
                "prefill_collective_share": prefill_comm / prefill_s}
    finally:
        engine.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_common_args(parser)
    parser.add_argument("--batches", default="1,4,16", help="running sequences per decode step")
    parser.add_argument("--steps", type=int, default=20, help="measured decode steps per point")
    parser.add_argument("--model", default="smollm2-135m")
    args = parser.parse_args(argv)
    batches = [1, 4] if args.quick else [int(b) for b in args.batches.split(",")]
    steps = 6 if args.quick else args.steps
    info = common.machine(os.cpu_count() or 1)
    rows = []
    for batch in batches:
        for tp in (1, 2):  # interleaved, so a change in the machine's load hits both sizes alike
            rows.append(measure(tp, batch, steps, args.model))
            print(rows[-1], file=sys.stderr, flush=True)
    by = {(r["tp"], r["batch"]): r for r in rows}
    table = [[b, by[1, b]["decode_step_ms"], by[2, b]["decode_step_ms"],
              by[1, b]["decode_step_ms"] / by[2, b]["decode_step_ms"], by[2, b]["decode_collective_share"]]
             for b in batches]
    print(common.format_table(["batch", "TP=1 ms", "TP=2 ms", "speed-up", "TP=2 in collectives"], table))
    prefill = [by[1, batches[0]]["prefill_step_ms"], by[2, batches[0]]["prefill_step_ms"]]
    print(f"prefill of {PREFILL_LEN} tokens: TP=1 {prefill[0]:.0f} ms, TP=2 {prefill[1]:.0f} ms "
          f"({by[2, batches[0]]['prefill_collective_share']:.0%} in collectives)")
    common.write_json(args.json, {
        "benchmark": "tp_step", "provisional": True,
        "note": "shared machine: figures are noisy; compare TP=1 and TP=2 within this run only",
        "model": args.model, "backend": "gloo", "machine": common.finish_machine(info), "results": rows})
    if args.plot:
        plt = common.pyplot()
        fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
        for tp in (1, 2):
            left.plot(batches, [by[tp, b]["decode_step_ms"] for b in batches], marker="o", label=f"TP={tp}")
        left.set_xlabel("running sequences (decode)")
        left.set_ylabel("model time per step (ms)")
        left.set_xscale("log", base=2)
        left.legend()
        left.set_title(f"{args.model}, fp32, {info['cpus']} CPUs (provisional)")
        right.bar([str(b) for b in batches], [100 * by[2, b]["decode_collective_share"] for b in batches])
        right.set_xlabel("running sequences (decode)")
        right.set_ylabel("% of rank 0's TP=2 step in collectives")
        common.save_figure(fig, args.plot)


if __name__ == "__main__":
    main()
