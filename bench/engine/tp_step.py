"""Tensor parallelism on a CPU: the engine's step time at --tensor-parallel-size 2 against 1, in
steady decode at several batch sizes and in one prefill step, and the share of rank 0's step spent
inside collectives (engine/distributed/group.py sums the time in every all-reduce and gather).

TP=1 runs torch on --threads threads (default 1: on a small shared machine more threads spin
against other work); each TP=2 rank takes half the cores (engine/distributed/tensor_parallel.py),
one each on a 2-core machine, so TP=2 has twice the compute and 2x is the ideal speed-up. The model has SmolLM2-135M's shape with 8 heads and 4 KV
heads (SmolLM2's own 9 and 3 do not split in 2), random weights, dense fp32 (tensor parallelism
shards dense weights only). Rank 0's collective time includes waiting for the
slower rank, so it measures communication plus imbalance. On a machine shared with other work the
figures are provisional: the JSON records the load average at the start and the end.

The pipeline arm (`pipeline` in the JSON): PP=2 (two ranks of 15 layers, one thread each) in three
arms, interleaved at each size: `unsplit`, one micro-batch per step (the stages take turns);
`always split`, two per step (stage 0 computes the second half of the batch while stage 1 computes
the first: engine/distributed/pipeline.py); `policy`, two only for a step of at least
--pipeline-micro-batch-min-tokens query tokens (default EngineConfig's), else one. Its decode
sizes (--pipeline-batches) bracket the default threshold; its prefill step is PREFILL_LEN tokens.

    python -m bench.engine.tp_step --json docs/perf/tp_step.json --plot docs/perf/tp_step.png
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from bench import common
from iterserve.engine.config import EngineConfig
from iterserve.engine.llm_engine import LLMEngine
from iterserve.engine.sampling_params import SamplingParams
from iterserve.engine.step_log import as_record

PROMPT_LEN = 32
PREFILL_LEN = 256
# PP=2 arms: (name, --pipeline-micro-batches, --pipeline-micro-batch-min-tokens; None: the flag's default)
PIPELINE_ARMS = (("unsplit", 1, 0), ("always split", 2, 0), ("policy", 2, None))
# SmolLM2-135M's shape (hidden 576, MLP 1536, 30 layers, its vocabulary) with 8 heads of 64 and 4 KV
# heads, so that 2 ranks divide them (SmolLM2's own 9 heads and 3 KV heads split only by 3).
SHAPE = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=8,
             num_key_value_heads=4, head_dim=64, max_position_embeddings=2048, tie_word_embeddings=True)


def random_llama(directory: Path) -> Path:
    """A Llama of SHAPE with random weights (step time does not depend on them) and the embedded tokenizer."""
    import torch
    import transformers

    from iterserve.engine.model.registry import resolve_model_path
    from iterserve.engine.model.tokenizer import Tokenizer

    if (directory / "config.json").exists():
        return directory
    tokenizer = Tokenizer.from_gguf(resolve_model_path(None)[0])
    config = transformers.LlamaConfig(vocab_size=tokenizer.vocab_size, bos_token_id=tokenizer.bos_token_id,
                                      eos_token_id=tokenizer.eos_token_id, **SHAPE)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory)
    tokenizer.backend.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": tokenizer.token(tokenizer.eos_token_id), "bos_token": tokenizer.token(tokenizer.bos_token_id)}))
    return directory


def measure(tp: int, batch: int, steps: int, model: str, threads: int, pp: int = 1, micro: int | None = None,
            min_tokens: int | None = 0) -> dict:
    """Median model time per decode step with `batch` running sequences, and of one prefill step."""
    import torch

    if tp * pp == 1:
        torch.set_num_threads(threads)
    if min_tokens is None:
        min_tokens = EngineConfig.pipeline_micro_batch_min_tokens
    config = EngineConfig(model=model, tensor_parallel_size=tp, pipeline_parallel_size=pp,
                          pipeline_micro_batches=micro, pipeline_micro_batch_min_tokens=min_tokens,
                          quantization="none", dtype="float32", device="cpu",
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
        engine.step()
        while last_record(engine)["prefill_tokens"]:  # the prompts (several steps above 8 sequences)
            engine.step()
        for _ in range(3):  # a few warm decodes
            engine.step()
        times, comm = [], []
        for _ in range(steps):
            before = group.seconds if group else 0.0
            engine.step()
            times.append(engine.last_timing.model_s)
            comm.append((group.seconds - before) if group else 0.0)
        return {"tp": tp, "pp": pp, "micro_batches": micro or pp, "micro_batch_min_tokens": min_tokens, "batch": batch,
                "decode_step_ms": 1000 * statistics.median(times),
                "decode_collective_share": statistics.median(c / t for c, t in zip(comm, times, strict=True)),
                "prefill_tokens": PREFILL_LEN, "prefill_step_ms": 1000 * prefill_s,
                "prefill_collective_share": prefill_comm / prefill_s}
    finally:
        engine.close()


def last_record(engine: LLMEngine) -> dict:
    records, _, _ = engine.step_records.after(engine.step_records.last_seq - 1, 1)
    return as_record(records[0])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_common_args(parser)
    parser.add_argument("--batches", default="1,4,16", help="running sequences per decode step")
    parser.add_argument("--steps", type=int, default=20, help="measured decode steps per point")
    parser.add_argument("--pipeline-batches", default="4,16,32,64",
                        help="running sequences per decode step in the PP=2 arm (around the policy's threshold)")
    parser.add_argument("--no-pipeline", dest="pipeline", action="store_false",
                        help="skip the PP=2 arm (unsplit, always split, policy)")
    parser.add_argument("--model", help="a model whose heads 2 divides (default: a random Llama of SmolLM2-135M's "
                                            "shape with 8 heads and 4 KV heads, built in a temporary folder)")
    args = parser.parse_args(argv)
    if args.model is None:
        folder = tempfile.TemporaryDirectory(prefix="iterserve-tp-step-")
        args.model = str(random_llama(Path(folder.name)))
        label = "random Llama, SmolLM2-135M's shape, 8 heads / 4 KV heads"
    else:
        label = args.model
    batches = [1, 4] if args.quick else [int(b) for b in args.batches.split(",")]
    pipeline_batches = [4] if args.quick else [int(b) for b in args.pipeline_batches.split(",")]
    steps = 6 if args.quick else args.steps
    info = common.machine(args.threads)
    info["tp2_threads_per_rank"] = max(1, (os.cpu_count() or 1) // 2)
    rows = []
    for batch in batches:
        for tp in (1, 2):  # interleaved, so a change in the machine's load hits both sizes alike
            rows.append(measure(tp, batch, steps, args.model, args.threads))
            print(rows[-1], file=sys.stderr, flush=True)
    pipeline_rows = []
    for batch in pipeline_batches if args.pipeline else []:
        for arm, micro, min_tokens in PIPELINE_ARMS:
            row = measure(1, batch, steps, args.model, args.threads, pp=2, micro=micro, min_tokens=min_tokens)
            pipeline_rows.append({"arm": arm} | row)
            print(pipeline_rows[-1], file=sys.stderr, flush=True)
    by = {(r["tp"], r["batch"]): r for r in rows}
    table = [[b, by[1, b]["decode_step_ms"], by[2, b]["decode_step_ms"],
              by[1, b]["decode_step_ms"] / by[2, b]["decode_step_ms"], by[2, b]["decode_collective_share"]]
             for b in batches]
    print(common.format_table(["batch", "TP=1 ms", "TP=2 ms", "speed-up", "TP=2 in collectives"], table))
    prefill = [by[1, batches[0]]["prefill_step_ms"], by[2, batches[0]]["prefill_step_ms"]]
    print(f"prefill of {PREFILL_LEN} tokens: TP=1 {prefill[0]:.0f} ms, TP=2 {prefill[1]:.0f} ms "
          f"({by[2, batches[0]]['prefill_collective_share']:.0%} in collectives)")
    pipe = {(r["arm"], r["batch"]): r for r in pipeline_rows}
    if pipeline_rows:
        names = [arm for arm, _, _ in PIPELINE_ARMS]
        print(common.format_table(
            ["batch"] + [f"PP=2 {name} ms" for name in names] + [f"{name} speed-up" for name in names[1:]],
            [[b] + [pipe[name, b]["decode_step_ms"] for name in names]
             + [pipe["unsplit", b]["decode_step_ms"] / pipe[name, b]["decode_step_ms"] for name in names[1:]]
             for b in pipeline_batches]))
        first = pipeline_batches[0]
        print(f"prefill of {PREFILL_LEN} tokens at PP=2: "
              + ", ".join(f"{name} {pipe[name, first]['prefill_step_ms']:.0f} ms" for name in names))
    machine = common.finish_machine(info)
    # Busier than the benchmark's own two ranks at either end: other work shared the cores.
    shared = max(machine["load_average_at_start"][0], machine["load_average_at_end"][0]) > info["cpus"] + 1
    common.write_json(args.json, {
        "benchmark": "tp_step", "provisional": shared,
        "note": ("shared machine: figures are noisy; " if shared else "")
        + "compare TP=1 and TP=2 within this run only",
        "model": label, "shape": SHAPE, "backend": "gloo", "machine": machine, "results": rows,
        "pipeline": pipeline_rows})
    if args.plot:
        plt = common.pyplot()
        fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
        for tp in (1, 2):
            left.plot(batches, [by[tp, b]["decode_step_ms"] for b in batches], marker="o", label=f"TP={tp}")
        left.set_xlabel("running sequences (decode)")
        left.set_ylabel("model time per step (ms)")
        left.set_xscale("log", base=2)
        left.legend()
        left.set_title(f"135M Llama, fp32, {info['cpus']} CPUs" + (" (provisional)" if shared else ""))
        right.bar([str(b) for b in batches], [100 * by[2, b]["decode_collective_share"] for b in batches])
        right.set_xlabel("running sequences (decode)")
        right.set_ylabel("% of rank 0's TP=2 step in collectives")
        common.save_figure(fig, args.plot)


if __name__ == "__main__":
    main()
