"""Scheduler overhead: time per engine step spent scheduling and on bookkeeping after the model
(advancing sequences, detokenizing, building outputs) against time in the model, at 8/32/64/128
running sequences in steady decode.

The engine times every step itself (`LLMEngine.last_timing`: schedule_s, model_s, postprocess_s;
no profiler); each part is the median over the measured steps. Two runs per size:
  real  - the embedded model on the CPU; model time is split further into the forward pass, the
          logits and the rest of the executor (input lists, attention metadata, sampling);
  fake  - the fake executor (no model, zero step time) with the real tokenizer: bookkeeping alone,
          many steps, put against the real model's step time and against a GPU-class step
          (the engine's fake step time: 2 ms + 0.3 ms per decode token).

    python -m bench.engine.scheduler_overhead --json docs/perf/scheduler_overhead.json --plot docs/perf/scheduler_overhead.png
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from bench import common
from bench.engine import systems
from iterserve.engine.config import EngineConfig
from iterserve.engine.fake_executor import FakeExecutor, LinearStepTime
from iterserve.engine.llm_engine import LLMEngine
from iterserve.engine.model.registry import resolve_model_path
from iterserve.engine.model.tokenizer import Tokenizer

TARGET_FRACTION = 0.03
TARGET_SEQS = 64
PROMPT_LEN = 32
GPU_CLASS_STEP = LinearStepTime(base_s=0.002, per_decode_token_s=0.0003)


class TimedModel:
    """Wraps the runner's model to time the forward pass and the logits separately."""

    def __init__(self, model):
        self.model = model
        self.forward_s = 0.0
        self.logits_s = 0.0

    def __call__(self, *args):
        started = time.perf_counter()
        hidden = self.model(*args)
        self.forward_s += time.perf_counter() - started
        return hidden

    def compute_logits(self, hidden):
        started = time.perf_counter()
        logits = self.model.compute_logits(hidden)
        self.logits_s += time.perf_counter() - started
        return logits

    def __getattr__(self, name):
        return getattr(self.model, name)


def configure(parser: argparse.ArgumentParser) -> None:
    common.add_common_args(parser)
    parser.add_argument("--seqs", help="running-sequence counts (default 8,32,64,128; quick: 8,32)")
    parser.add_argument("--real-steps", type=int, help="measured decode steps with the real model (default 8; quick: 3)")
    parser.add_argument("--fake-steps", type=int, default=200, help="measured steps with the fake executor")
    parser.add_argument("--fake-repeats", type=int, default=5,
                        help="fake-executor runs per size; each figure is the median over them (default 5)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    configure(parser)
    args = parser.parse_args(argv)
    sizes = [int(n) for n in (args.seqs or ("8,32" if args.quick else "8,32,64,128")).split(",")]
    real_steps = args.real_steps or (3 if args.quick else 8)
    common.set_threads(args.threads)
    machine = common.machine(args.threads)

    tokenizer = Tokenizer.from_gguf(resolve_model_path(None)[0])
    runner = systems.load_runner(max_num_seqs=max(sizes), max_num_batched_tokens=max(512, *sizes),
                                 max_model_len=1024)
    timed = TimedModel(runner.model)
    runner.model = timed
    warm = systems.iterserve_engine(runner)
    systems.run_iterserve(warm, common.zipf_workload(2, 1, max_output=4))

    results = {}
    for n in sizes:
        print(f"{n} running sequences ...", file=sys.stderr, flush=True)
        real = _measure(systems.iterserve_engine(runner, max_num_seqs=n, max_num_batched_tokens=max(512, n)),
                        n, real_steps, timed)
        fake_runs = [_measure(_fake_engine(n, tokenizer), n, args.fake_steps) for _ in range(args.fake_repeats)]
        fake = {key: statistics.median(run[key] for run in fake_runs) for key in fake_runs[0]}
        real_step = real["schedule_s"] + real["model_s"] + real["postprocess_s"]
        fake_bookkeeping = fake["schedule_s"] + fake["postprocess_s"]
        gpu_step = GPU_CLASS_STEP.base_s + GPU_CLASS_STEP.per_decode_token_s * n
        results[str(n)] = {
            "real": real,
            "real_overhead_fraction": (real["schedule_s"] + real["postprocess_s"]) / real_step,
            "fake": fake,
            "fake_bookkeeping_s": fake_bookkeeping,
            "fake_vs_real_model_fraction": fake_bookkeeping / (fake_bookkeeping + real["model_s"]),
            "gpu_class_step_s": gpu_step,
            "fake_vs_gpu_class_step_fraction": fake_bookkeeping / (fake_bookkeeping + gpu_step),
        }
    report = {
        "benchmark": "scheduler_overhead",
        "workload": {"prompt_len": PROMPT_LEN, "real_steps": real_steps, "fake_steps": args.fake_steps,
                     "fake_repeats": args.fake_repeats,
                     "phase": "steady decode, every sequence running"},
        "machine": common.finish_machine(machine),
        "seqs": results,
        "targets": {},
    }
    at = results.get(str(TARGET_SEQS))
    if at is not None:
        measured = at["real_overhead_fraction"]
        report["targets"][f"overhead at {TARGET_SEQS} seqs"] = {
            "target_at_most": TARGET_FRACTION, "measured": measured, "met": measured <= TARGET_FRACTION}
    print(_table(report))
    common.write_json(args.json, report)
    if args.plot:
        _plot(report, args.plot)
    return 0


def _fake_engine(n: int, tokenizer) -> LLMEngine:
    config = EngineConfig(model="fake", max_num_seqs=n, max_num_batched_tokens=max(512, n), max_model_len=2048,
                          num_kv_blocks=n * 24, num_cpu_blocks=0)
    config = config.resolve()
    return LLMEngine(config, FakeExecutor(config.num_kv_blocks), tokenizer)


def _measure(engine: LLMEngine, n: int, steps: int, timed: TimedModel | None = None) -> dict:
    """Fill the engine with n sequences, step until all are decoding, then time `steps` steps."""
    from iterserve.engine.sampling_params import SamplingParams

    prefill_steps = -(-n * PROMPT_LEN // engine.config.max_num_batched_tokens) + 1
    params = SamplingParams(temperature=0.0, max_tokens=2 * prefill_steps + steps + 4, ignore_eos=True)
    ids = [engine.add_request(None, params, [100 + (i * 7 + j) % 150 for j in range(PROMPT_LEN)])
           for i in range(n)]
    while engine.stats().num_waiting or any(
            seq.num_computed_tokens < seq.num_prompt_tokens for seq in engine.scheduler.running):
        engine.step()
    samples = {"schedule_s": [], "model_s": [], "postprocess_s": [], "forward_s": [], "logits_s": []}
    for _ in range(steps):
        forward, logits = (timed.forward_s, timed.logits_s) if timed is not None else (0.0, 0.0)
        engine.step()
        running = len(engine.scheduler.running)
        if running != n:
            raise RuntimeError(f"expected {n} running sequences, found {running}")
        timing = engine.last_timing
        samples["schedule_s"].append(timing.schedule_s)
        samples["model_s"].append(timing.model_s)
        samples["postprocess_s"].append(timing.postprocess_s)
        if timed is not None:
            samples["forward_s"].append(timed.forward_s - forward)
            samples["logits_s"].append(timed.logits_s - logits)
    # Medians: on a shared machine a step is now and then descheduled; that is not the engine's cost.
    result = {key: statistics.median(values) for key, values in samples.items() if values}
    result["mean_step_s"] = sum(map(sum, (samples[k] for k in ("schedule_s", "model_s", "postprocess_s")))) / steps
    if timed is not None:
        others = [m - f - g for m, f, g in zip(samples["model_s"], samples["forward_s"], samples["logits_s"],
                                               strict=True)]
        result["executor_other_s"] = statistics.median(others)
    for request_id in ids:
        engine.abort_request(request_id)
    engine.step()
    if engine.has_unfinished_requests():
        raise RuntimeError("requests left over after the abort")
    return result


def _table(report: dict) -> str:
    rows = []
    for n, r in report["seqs"].items():
        real = r["real"]
        rows.append([n, real["schedule_s"] * 1e3, real["postprocess_s"] * 1e3, real["model_s"] * 1e3,
                     real["executor_other_s"] * 1e3, r["real_overhead_fraction"] * 100,
                     r["fake_bookkeeping_s"] * 1e3, r["fake_vs_gpu_class_step_fraction"] * 100])
    table = common.format_table(
        ["seqs", "schedule ms", "postprocess ms", "model ms", "(of which prep+sample ms)", "overhead %",
         "fake: bookkeeping ms", "vs GPU-class step %"], rows)
    lines = [table]
    for label, t in report["targets"].items():
        lines.append(f"\ntarget {label}: <= {t['target_at_most']:.0%}, measured {t['measured']:.2%} "
                     f"({'met' if t['met'] else 'missed'})")
    return "\n".join(lines)


def _plot(report: dict, path: str) -> None:
    plt = common.pyplot()
    sizes = list(report["seqs"])
    rows = [report["seqs"][n] for n in sizes]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.4))
    parts = [("schedule", lambda r: r["real"]["schedule_s"]), ("postprocess", lambda r: r["real"]["postprocess_s"]),
             ("executor prep+sample", lambda r: r["real"]["executor_other_s"]),
             ("forward+logits", lambda r: r["real"]["forward_s"] + r["real"]["logits_s"])]
    bottom = [0.0] * len(sizes)
    for label, get in parts:
        values = [get(r) * 1e3 for r in rows]
        left.bar(sizes, values, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    left.set_xlabel("running sequences")
    left.set_ylabel("ms per decode step (real model, CPU)")
    left.legend(fontsize=7)
    right.plot(sizes, [r["real_overhead_fraction"] * 100 for r in rows], "o-", label="real model (CPU)")
    right.plot(sizes, [r["fake_vs_gpu_class_step_fraction"] * 100 for r in rows], "s--",
               label="bookkeeping vs GPU-class step")
    right.axhline(TARGET_FRACTION * 100, color="tab:red", linestyle=":", label="3% target")
    right.set_xlabel("running sequences")
    right.set_ylabel("schedule + postprocess, % of step")
    right.legend(fontsize=7)
    common.save_figure(fig, path)


if __name__ == "__main__":
    sys.exit(main())
