"""The simulator's checks against real runs recorded by bench/sim_record.py (the embedded model on
CPU, one replica): the step-time fit's error on held-out steps, scheduler parity (same batch
composition given the same arrivals), and end-to-end throughput and p95 TTFT next to the real
runs' own run-to-run spread. Prints the figures and writes them as JSON.

    .venv/bin/python bench/sim_validate.py --train-log train_steps.jsonl \
        --heldout-run heldout_run.json --heldout-log heldout_steps.jsonl \
        --repeat-run heldout2_run.json --trace heldout.csv --json out.json [--profile-out P.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from iterserve.engine.config import EngineConfig
from iterserve.engine.sampling_params import SamplingParams
from iterserve.simulate import profile as profiles
from iterserve.simulate.cli import SMOLLM2_CONTEXT, SMOLLM2_KV_BYTES_PER_TOKEN, simulate
from iterserve.simulate.cluster import SimOptions
from iterserve.simulate.replica import Replica, prompt_tokens
from iterserve.simulate.report import Slo, percentile
from iterserve.simulate.traces import load_trace


def cpu_records(step_log: str, run_path: str) -> list[dict]:
    """The step log's lines with each step's own thread CPU time (from the run JSON) as its
    duration: what the step costs on a core of its own, whatever else the machine runs."""
    run = json.loads(Path(run_path).read_text())
    cpu = [s["cpu_s"] for s in run["steps"] if s["chunks"]]
    lines = profiles.read_step_log(step_log)
    if len(lines) != len(cpu):
        raise ValueError(f"{step_log}: {len(lines)} steps logged, {len(cpu)} in {run_path}")
    return [dict(r, duration_s=c) for r, c in zip(lines, cpu, strict=True) if r["num_seqs"] > 0]


def real_figures(run: dict) -> dict:
    done = [r for r in run["requests"] if "finished_s" in r]
    span = max(r["finished_s"] for r in done) - min(r["arrival_s"] for r in run["requests"])
    ttfts = [r["first_token_s"] - r["arrival_s"] for r in done]
    return {"requests_per_s": len(done) / span, "output_tokens_per_s": sum(r["tokens"] for r in done) / span,
            "ttft_p50_s": percentile(ttfts, 50), "ttft_p95_s": percentile(ttfts, 95), "steps": len(run["steps"])}


def parity(run: dict, profile: profiles.StepProfile) -> dict:
    """Replays the run's arrivals at the same steps through the real scheduler (simulated time)."""
    replica = Replica("parity", EngineConfig(max_num_seqs=run["max_num_seqs"]), profile)
    by_id = {r["id"]: r for r in run["requests"]}
    captured: list[list] = []
    real_execute = replica.engine.executor.execute

    def capture(out):
        captured[-1] = [[c.seq.request_id, c.start, c.num_tokens] for c in out.chunks]
        return real_execute(out)

    # The recorder's warm-up request went first (its KV blocks stay in the prefix cache).
    replica.engine.add_request(prompt_token_ids=[100] * 32, params=SamplingParams(max_tokens=4, ignore_eos=True),
                               request_id="warmup")
    while replica.engine.has_unfinished_requests():
        replica.engine.step()
    replica.engine.executor.execute = capture
    same = 0
    first_diff = None
    for index, step in enumerate(run["steps"]):
        for request_id in step["added"]:
            r = by_id[request_id]
            replica.engine.add_request(prompt_token_ids=prompt_tokens(int(request_id), r["prompt_tokens"]),
                                       params=SamplingParams(max_tokens=r["output_tokens"], ignore_eos=True),
                                       request_id=request_id, arrival_time=r["arrival_s"])
        captured.append([])
        replica.engine.step()
        if captured[-1] == step["chunks"]:
            same += 1
        elif first_diff is None:
            first_diff = {"step": index, "real": step["chunks"][:6], "simulated": captured[-1][:6]}
    return {"steps": len(run["steps"]), "same_composition": same, "fraction": same / len(run["steps"]),
            "first_difference": first_diff}


def simulated_figures(trace_path: str, profile: profiles.StepProfile, max_num_seqs: int) -> dict:
    from iterserve.operator.models import InferenceServiceSpec

    spec = InferenceServiceSpec.model_validate({"model": {"uri": "smollm2-135m"},
                                                "engine": {"maxNumSeqs": max_num_seqs}})
    trace = load_trace(trace_path)
    # The recorded runs drove the engine directly: no router in front.
    document, wall = simulate(trace, spec, profile, SimOptions(router="round-robin"), Slo(), {})
    s = document["summary"]
    return {"requests_per_s": s["throughput"]["requests_per_s"],
            "output_tokens_per_s": s["throughput"]["output_tokens_per_s"],
            "ttft_p50_s": s["ttft_s"]["p50"], "ttft_p95_s": s["ttft_s"]["p95"], "steps": s["engine_steps"],
            "simulated_s": s["simulated_seconds"], "wall_s": wall}


def rel(a: float, b: float) -> float:
    return abs(a - b) / b


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--train-log", action="append", required=True)
    parser.add_argument("--train-run", action="append", required=True, help="the run JSON of each --train-log")
    parser.add_argument("--heldout-log", action="append", required=True)
    parser.add_argument("--heldout-run", required=True)
    parser.add_argument("--repeat-run", help="a second real run of the held-out trace (run-to-run spread)")
    parser.add_argument("--trace", required=True, help="the held-out trace")
    parser.add_argument("--profile-out")
    parser.add_argument("--json")
    args = parser.parse_args()

    train = profiles.step_log_records(args.train_log)
    test = profiles.step_log_records(args.heldout_log)
    source = ("bench/sim_record.py runs of the embedded model on the shared 2-core CPU machine (1 torch "
              "thread): " + ", ".join(Path(p).name for p in args.train_log))
    # Wall-clock fit: the same conditions as the real runs it is compared with below.
    profile = profiles.fit_profile(train, test, "smollm2-135m-cpu-wall", SMOLLM2_KV_BYTES_PER_TOKEN,
                                   SMOLLM2_CONTEXT, source=source + "; wall-clock step durations")
    errors = profiles.evaluate(profile, test)
    print("wall-clock profile:", {k: f"{v:.4g}" for k, v in profile.coefficients.items()})
    print("terms considered:", profile.fit["terms_considered"], "base-only error:", profile.fit["base_terms_test_error"])
    print(profiles.format_errors(errors))
    # CPU-time fit: each step's own thread CPU time, free of the other processes' share of the
    # cores (the profile that ships: it describes the engine on a core of its own).
    cpu_train = [r for log, run in zip(args.train_log, args.train_run, strict=True) for r in cpu_records(log, run)]
    cpu_test = cpu_records(args.heldout_log[0], args.heldout_run)
    cpu_profile = profiles.fit_profile(cpu_train, cpu_test, "smollm2-135m-cpu", SMOLLM2_KV_BYTES_PER_TOKEN,
                                       SMOLLM2_CONTEXT, source=source + "; each step's thread CPU time")
    cpu_errors = profiles.evaluate(cpu_profile, cpu_test)
    print("CPU-time profile:", {k: f"{v:.4g}" for k, v in cpu_profile.coefficients.items()})
    print("terms considered:", cpu_profile.fit["terms_considered"])
    print(profiles.format_errors(cpu_errors))
    if args.profile_out:
        Path(args.profile_out).write_text(cpu_profile.to_json())

    heldout = json.loads(Path(args.heldout_run).read_text())
    par = parity(heldout, profile)
    print(f"parity: {par['same_composition']}/{par['steps']} steps identical ({par['fraction']:.2%})")

    real = real_figures(heldout)
    runs = [real]
    if args.repeat_run:
        runs.append(real_figures(json.loads(Path(args.repeat_run).read_text())))
    sim = simulated_figures(args.trace, profile, heldout["max_num_seqs"])
    spread = {k: rel(runs[1][k], runs[0][k]) for k in ("requests_per_s", "output_tokens_per_s", "ttft_p95_s")} \
        if len(runs) > 1 else None
    mean_real = {k: sum(r[k] for r in runs) / len(runs) for k in ("requests_per_s", "output_tokens_per_s",
                                                                    "ttft_p50_s", "ttft_p95_s")}
    sim_error = {k: rel(sim[k], mean_real[k]) for k in mean_real}
    for k in mean_real:
        print(f"{k:<22} real {' / '.join(f'{r[k]:.4g}' for r in runs):<22} sim {sim[k]:.4g}  "
              f"error vs real mean {sim_error[k]:.1%}" + (f"  run-to-run {spread[k]:.1%}" if spread and k in spread else ""))
    print(f"simulated {sim['simulated_s']:.0f} s in {sim['wall_s']:.2f} s wall "
          f"({sim['simulated_s'] / sim['wall_s']:.0f}x real time)")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "profile": json.loads(profile.to_json()),
            "step_errors": {k: vars(v) for k, v in errors.items()},
            "cpu_profile": json.loads(cpu_profile.to_json()),
            "cpu_step_errors": {k: vars(v) for k, v in cpu_errors.items()}, "parity": par, "real_runs": runs,
            "simulated": sim, "sim_error_vs_real_mean": sim_error, "real_run_to_run": spread}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
