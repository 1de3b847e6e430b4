"""The simulator's checks against real runs recorded by bench/simulator/record.py (the embedded model on
CPU, one replica): the step-time fit's error on the steps of a held-out trace, scheduler parity
(the same batch composition given the same arrivals), and end-to-end throughput and p95 TTFT next
to the real runs' own run-to-run spread. Prints the figures and writes them as JSON.

Robust to a shared machine: each step is timed by its engine-thread CPU time (its own compute:
what it takes on a core of its own), measured once per replay of the same arrivals (sim_record
--replays: the same batch at every step) and taken as the median; the real runs it compares the
simulator with ran on the same CPU clock (sim_record --clock cpu). The wall-clock figures are
printed beside them for what this machine's users see.

    .venv/bin/python -m bench.simulator.validate --train-runs train_runs.json \\
        --heldout-runs heldout_runs.json --trace heldout.csv --json out.json [--profile-out P.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

import numpy as np

from iterserve.engine.config import EngineConfig
from iterserve.engine.sampling_params import SamplingParams
from iterserve.replica_model import profile as profiles
from iterserve.replica_model.replica import Replica, prompt_tokens
from iterserve.simulate.cli import SMOLLM2_CONTEXT, SMOLLM2_KV_BYTES_PER_TOKEN, simulate
from iterserve.simulate.cluster import SimOptions
from iterserve.simulate.report import Slo, percentile
from iterserve.simulate.traces import load_trace


def step_record(step: dict, prompt_len: dict[str, int], seconds: float) -> dict:
    """A step-log-shaped record of one recorded step (features from its chunks)."""
    prefill = decode = context = longest = pairs = 0
    for request_id, start, tokens in step["chunks"]:
        end = start + tokens
        context += end
        longest = max(longest, end)
        if tokens == 1 and start >= prompt_len[request_id]:
            decode += 1
        else:
            prefill += tokens
            pairs += tokens * end
    return {"prefill_tokens": prefill, "decode_tokens": decode, "num_seqs": len(step["chunks"]),
            "context_tokens": context, "max_context_tokens": longest, "prefill_attention_pairs": pairs,
            "duration_s": seconds}


def measured_steps(document: dict, clock: str) -> tuple[list[dict], list[dict], dict]:
    """The first run's steps with each step's time (clock "cpu" or "wall") as the median over the
    first run and its replays (steps whose batch differed in a replay use the runs that agree),
    the same steps timed by the first run alone, and the measurement's own spread."""
    key = "cpu_s" if clock == "cpu" else "wall_s"
    first = document["runs"][0]
    prompt_len = {r["id"]: r["prompt_tokens"] for r in first["requests"]}
    repeats = [first, *document.get("replays", [])]
    medians, singles, deviations, differing = [], [], [], 0
    for index, step in enumerate(first["steps"]):
        if not step["chunks"]:
            continue
        times = [run["steps"][index][key] for run in repeats
                 if index < len(run["steps"]) and run["steps"][index]["chunks"] == step["chunks"]]
        differing += len(repeats) - len(times)
        median = statistics.median(times)
        medians.append(step_record(step, prompt_len, median))
        singles.append(step_record(step, prompt_len, step[key]))
        deviations += [abs(t - median) / median for t in times] if len(times) > 2 else []
    noise = {"measurements_per_step": len(repeats), "steps": len(medians),
             "differing_batches": differing,
             "mean_deviation_from_step_median": float(np.mean(deviations)) if deviations else None,
             "median_deviation_from_step_median": float(np.median(deviations)) if deviations else None}
    return medians, singles, noise


def level_matched(profile: profiles.StepProfile, document: dict, clock: str) -> tuple[dict, list[float]]:
    """Errors after scaling each measurement series (the first run, each replay) by one factor, so
    its total matches the prediction's: how wrong the model's shape is, apart from the level the
    machine's contention set for that run (one number per run, not per step)."""
    key = "cpu_s" if clock == "cpu" else "wall_s"
    first = document["runs"][0]
    prompt_len = {r["id"]: r["prompt_tokens"] for r in first["requests"]}
    steps = [(i, s) for i, s in enumerate(first["steps"]) if s["chunks"]]
    repeats = [first, *document.get("replays", [])]
    predicted = np.array([profile.step_seconds(profiles.StepFeatures.from_record(step_record(s, prompt_len, 1.0)))
                          for _, s in steps])
    series, factors = [], []
    for run in repeats:
        times = np.array([run["steps"][i][key] for i, _ in steps])
        factors.append(float(predicted.sum() / times.sum()))
        series.append(times * factors[-1])
    medians = np.median(np.array(series), axis=0)
    records = [step_record(s, prompt_len, float(t)) for (_, s), t in zip(steps, medians, strict=True)]
    return profiles.evaluate(profile, records), factors, np.array(series), records


def measurement_floor(series: np.ndarray, records: list[dict]) -> dict:
    """How well one level-matched real measurement of each step agrees with the median of the
    others: the error a perfect model would show against a single run, on this machine."""
    decode = np.array([r["prefill_tokens"] == 0 for r in records])
    out = {}
    for kind, mask in (("decode_only", decode), ("mixed", ~decode)):
        errors = []
        for i in range(len(series)):
            others = np.median(np.delete(series, i, axis=0), axis=0)
            errors.append(np.abs(series[i][mask] - others[mask]) / others[mask])
        out[kind] = float(np.mean(errors)) if errors and mask.any() else None
    return out


def residuals(profile: profiles.StepProfile, records: list[dict], series: list[list[dict]]) -> dict:
    """Where the profile errs on the decode-only held-out steps (signed: + over-predicts): by
    batch size, by context (terciles), by position in the run (quarters), and against each
    measurement series alone (the first run, each replay)."""
    features = [profiles.StepFeatures.from_record(r) for r in records]
    measured = np.array([r["duration_s"] for r in records])
    predicted = np.array([profile.step_seconds(f) for f in features])
    signed = (predicted - measured) / measured
    decode = np.array([f.prefill_tokens == 0 for f in features])
    seqs = np.array([f.num_seqs for f in features])
    context = np.array([f.context_tokens for f in features])
    position = np.arange(len(records)) * 4 // max(1, len(records))

    def group(mask: np.ndarray) -> dict:
        return {"steps": int(mask.sum()), "signed": float(signed[mask].mean()), "abs": float(np.abs(signed[mask]).mean())}

    out: dict = {"by_num_seqs": {int(k): group(decode & (seqs == k)) for k in sorted(set(seqs[decode]))}}
    edges = np.quantile(context[decode], [0, 1 / 3, 2 / 3, 1]) if decode.any() else []
    out["by_context"] = {f"{lo:.0f}-{hi:.0f}": group(decode & (context >= lo) & (context <= hi))
                         for lo, hi in zip(edges[:-1], edges[1:], strict=True)}
    out["by_position_quarter"] = {str(q): group(decode & (position == q)) for q in range(4) if (decode & (position == q)).any()}
    out["by_series_abs"] = [float(np.abs((predicted[decode] - t[decode]) / t[decode]).mean())
                            for t in (np.array([r["duration_s"] for r in run]) for run in series)]
    return out


def error_by_measurements(profile: profiles.StepProfile, document: dict, clock: str) -> list[dict]:
    """The decode-only and mixed errors against medians over the first k measurements of each
    step, k = 1 .. runs + replays: how much of the error is the measurement's own noise."""
    out = []
    for k in range(len(document.get("replays", [])) + 1):
        medians = measured_steps(dict(document, replays=document.get("replays", [])[:k]), clock)[0]
        errors = profiles.evaluate(profile, medians)
        out.append({"measurements": k + 1, "decode_only": errors["decode_only"].mean, "mixed": errors["mixed"].mean})
    return out


CANDIDATE_SHAPES = {  # tried by CV beside the profile's terms; not offered to fit_profile (see docs/simulator.md)
    "min(tokens,2)": lambda f: min(f.prefill_tokens + f.decode_seqs, 2),
    "min(tokens,3)": lambda f: min(f.prefill_tokens + f.decode_seqs, 3),
    "min(tokens,4)": lambda f: min(f.prefill_tokens + f.decode_seqs, 4),
    "min(tokens,8)": lambda f: min(f.prefill_tokens + f.decode_seqs, 8),
    "log(tokens)": lambda f: float(np.log(f.prefill_tokens + f.decode_seqs)),
    "sqrt(tokens)": lambda f: float(np.sqrt(f.prefill_tokens + f.decode_seqs)),
    "2+ sequences": lambda f: float(f.num_seqs >= 2),
}


def candidate_shapes(profile: profiles.StepProfile, train: list[dict]) -> dict:
    """4-fold CV error on the training steps of the profile's terms plus each candidate shape."""
    features = [profiles.StepFeatures.from_record(r) for r in train]
    times = np.array([r["duration_s"] for r in train])
    base = profiles._matrix(features, list(profile.coefficients))
    out = {"profile's terms": profiles._cv_error(base, times)}
    for name, shape in CANDIDATE_SHAPES.items():
        column = np.array([[shape(f)] for f in features], dtype=float)
        out[name] = profiles._cv_error(np.hstack([base, column]), times)
    return out


def real_figures(run: dict) -> dict:
    done = [r for r in run["requests"] if "finished_s" in r]
    span = max(r["finished_s"] for r in done) - min(r["arrival_s"] for r in run["requests"])
    ttfts = [r["first_token_s"] - r["arrival_s"] for r in done]
    return {"requests_per_s": len(done) / span, "output_tokens_per_s": sum(r["tokens"] for r in done) / span,
            "ttft_p50_s": percentile(ttfts, 50), "ttft_p95_s": percentile(ttfts, 95), "steps": len(run["steps"]),
            "clock": run.get("clock", "wall"), "wall_s": run["wall_s"],
            "load_average": [run.get("load_average_before", [None])[0], run.get("load_average_after", [None])[0]]}


def parity(run: dict, max_num_seqs: int, profile: profiles.StepProfile) -> dict:
    """Replays the run's arrivals at the same steps through the real scheduler (simulated time)."""
    replica = Replica("parity", EngineConfig(max_num_seqs=max_num_seqs), profile)
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


NOISE_MARGIN = 1.2  # a check passes when the model's error is at most this times the machine's own


def noise_checks(matched: dict, floor: dict, sim_error: dict, spread: dict | None) -> dict:
    """The checks, each against the noise this machine showed in the same recording: the step
    model's error on the held-out steps (each run's level matched, against the step medians) next
    to one level-matched real run against the median of the others, on decode-only and mixed
    steps; the simulator's end-to-end p95 TTFT and throughput against the real runs' mean, next
    to the real runs' spread ((max - min) / mean). Each passes when error <= NOISE_MARGIN x noise."""
    out = {}
    for kind in ("decode_only", "mixed"):
        out[f"step_model_{kind}"] = (matched[kind].mean, floor[kind])
    for key, name in (("ttft_p95_s", "end_to_end_ttft_p95"), ("requests_per_s", "end_to_end_throughput")):
        out[name] = (abs(sim_error[key]), spread[key] if spread else None)
    return {name: {"error": error, "noise": noise, "ratio": error / noise if noise else None,
                   "passed": noise is not None and error <= NOISE_MARGIN * noise}
            for name, (error, noise) in out.items()}


def rel(a: float, b: float) -> float:
    return abs(a - b) / b


def fit_and_test(name: str, train: list[dict], test: list[dict], source: str) -> tuple[profiles.StepProfile, dict]:
    profile = profiles.fit_profile(train, test, name, SMOLLM2_KV_BYTES_PER_TOKEN, SMOLLM2_CONTEXT, source=source)
    return profile, profiles.evaluate(profile, test)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--train-runs", action="append", required=True,
                        help="sim_record JSON of the training trace (its first run and replays)")
    parser.add_argument("--heldout-runs", required=True,
                        help="sim_record JSON of the held-out trace: independent runs (end to end) and "
                             "replays of the first (step times)")
    parser.add_argument("--trace", required=True, help="the held-out trace")
    parser.add_argument("--profile-out", help="write the CPU-time profile here")
    parser.add_argument("--json")
    args = parser.parse_args()

    trains = [json.loads(Path(p).read_text()) for p in args.train_runs]
    heldout = json.loads(Path(args.heldout_runs).read_text())
    if heldout.get("clock") != "cpu":
        print(f"note: {args.heldout_runs} ran on the {heldout.get('clock', 'wall')} clock")
    source = ("bench/simulator/record.py runs of the embedded model on a shared 2-core CPU machine (1 torch thread): "
              + ", ".join(Path(p).name for p in args.train_runs))
    result: dict = {"machine": heldout.get("machine"), "load_average_now": os.getloadavg()}
    profile_by_clock = {}
    for clock in ("cpu", "wall"):
        key = "cpu_s" if clock == "cpu" else "wall_s"
        train, train_noise = [], []
        for document in trains:
            medians, _, noise = measured_steps(document, clock)
            train += medians
            train_noise.append(noise)
        test, test_single, test_noise = measured_steps(heldout, clock)
        what = "each step's engine-thread CPU time" if clock == "cpu" else "each step's wall time"
        profile, errors = fit_and_test("smollm2-135m-cpu" if clock == "cpu" else "smollm2-135m-cpu-wall", train, test,
                                       f"{source}; {what}, median over {train_noise[0]['measurements_per_step']} "
                                       "measurements of the same batches (a run and its replays)")
        single_errors = profiles.evaluate(profile, test_single)
        # The same terms without the median: a fit on the first run's single measurements.
        singles_train = [r for document in trains for r in measured_steps(document, clock)[1]]
        _, errors_no_median = fit_and_test("single", singles_train, test_single, source)
        profile_by_clock[clock] = profile
        print(f"\n== {clock} time: fitted on {len(train)} steps, tested on {len(test)} held-out steps ==")
        print("profile:", {k: f"{v:.4g}" for k, v in profile.coefficients.items()})
        print("term selection (4-fold CV on the training steps):", profile.fit["selection"][1:])
        print(f"base terms only: held-out error {profile.fit['base_terms_test_error']:.1%}")
        print(f"measurement noise: each step measured {test_noise['measurements_per_step']}x, mean deviation from "
              f"its median {test_noise['mean_deviation_from_step_median']:.1%} (held-out), "
              f"{train_noise[0]['mean_deviation_from_step_median']:.1%} (train); "
              f"batches differing in a replay: {test_noise['differing_batches']}")
        print("held-out error vs the step medians:")
        print(profiles.format_errors(errors))
        print("same profile vs the first run's single measurements:")
        print(profiles.format_errors(single_errors))
        print("fitted and tested on single measurements (no medians):")
        print(profiles.format_errors(errors_no_median))
        matched, factors, series, matched_records = level_matched(profile, heldout, clock)
        print("held-out error with each run's level matched (one factor per run: "
              + ", ".join(f"{f:.3f}" for f in factors) + "), then the step medians:")
        print(profiles.format_errors(matched))
        floor = measurement_floor(series, matched_records)
        print("measurement floor: one level-matched real run vs the median of the others: "
              f"decode-only {floor['decode_only']:.1%}, mixed {floor['mixed']:.1%}")
        first = heldout["runs"][0]
        prompt_len = {r["id"]: r["prompt_tokens"] for r in first["requests"]}
        series = [[step_record(s, prompt_len, run["steps"][i][key]) for i, s in enumerate(first["steps"]) if s["chunks"]]
                  for run in [first, *heldout.get("replays", [])]]
        resid = residuals(profile, test, series)
        print("decode-only residuals vs the medians (mean signed / mean abs; + over-predicts):")
        for what, groups in (("sequences", resid["by_num_seqs"]), ("context tokens", resid["by_context"]),
                             ("run quarter", resid["by_position_quarter"])):
            print(f"  by {what}: " + ", ".join(f"{k}: {g['signed']:+.1%} / {g['abs']:.1%} ({g['steps']})"
                                              for k, g in groups.items()))
        print("  against each measurement series alone: " + ", ".join(f"{e:.1%}" for e in resid["by_series_abs"]))
        trend = error_by_measurements(profile, heldout, clock)
        print("error vs medians of the first k measurements per step: " + ", ".join(
            f"k={t['measurements']}: {t['decode_only']:.1%} / {t['mixed']:.1%}" for t in trend) + " (decode-only / mixed)")
        shapes = candidate_shapes(profile, train)
        print("4-fold CV error on the training steps, the profile's terms + one candidate shape: " + ", ".join(
            f"{k} {v:.2%}" for k, v in shapes.items()))
        if clock == "cpu":
            matched_cpu, floor_cpu = matched, floor
        result[clock] = {"profile": json.loads(profile.to_json()),
                         "step_errors_vs_medians": {k: vars(v) for k, v in errors.items()},
                         "step_errors_vs_single": {k: vars(v) for k, v in single_errors.items()},
                         "step_errors_no_medians": {k: vars(v) for k, v in errors_no_median.items()},
                         "step_errors_level_matched": {k: vars(v) for k, v in matched.items()},
                         "level_factors": factors, "measurement_floor": floor,
                         "decode_only_residuals": resid, "error_by_measurements": trend,
                         "candidate_shapes_cv_error": shapes,
                         "run_step_seconds_total": [sum(s[key] for s in run["steps"])
                                                    for run in [heldout["runs"][0], *heldout.get("replays", [])]],
                         "noise_train": train_noise, "noise_heldout": test_noise}
    if args.profile_out:
        Path(args.profile_out).write_text(profile_by_clock["cpu"].to_json())
        print(f"wrote {args.profile_out}")

    first = heldout["runs"][0]
    par = parity(first, heldout["max_num_seqs"], profile_by_clock["cpu"])
    print(f"\nparity: {par['same_composition']}/{par['steps']} steps identical ({par['fraction']:.2%})")
    result["parity"] = par

    runs = [real_figures(run) for run in heldout["runs"]]
    sim = simulated_figures(args.trace, profile_by_clock[heldout.get("clock", "wall")], heldout["max_num_seqs"])
    keys = ("requests_per_s", "output_tokens_per_s", "ttft_p50_s", "ttft_p95_s")
    mean_real = {k: statistics.mean(r[k] for r in runs) for k in keys}
    spread = {k: (max(r[k] for r in runs) - min(r[k] for r in runs)) / mean_real[k] for k in keys} \
        if len(runs) > 1 else None
    sim_error = {k: (sim[k] - mean_real[k]) / mean_real[k] for k in keys}
    print(f"end to end, {len(runs)} real runs on the {heldout.get('clock', 'wall')} clock vs the simulator:")
    for k in keys:
        print(f"{k:<20} real {' / '.join(f'{r[k]:.4g}' for r in runs):<26} sim {sim[k]:.4g}  "
              f"error vs real mean {sim_error[k]:+.1%}"
              + (f"  real spread (max-min)/mean {spread[k]:.1%}" if spread else ""))
    print(f"simulated {sim['simulated_s']:.0f} s in {sim['wall_s']:.2f} s wall "
          f"({sim['simulated_s'] / sim['wall_s']:.0f}x real time)")
    result.update({"real_runs": runs, "simulated": sim, "sim_error_vs_real_mean": sim_error,
                   "real_spread_max_minus_min_over_mean": spread})
    checks = noise_checks(matched_cpu, floor_cpu, sim_error, spread)
    print(f"\nchecks (CPU time; pass: error <= {NOISE_MARGIN:g}x the noise measured in the same recording):")
    for name, check in checks.items():
        noise = "none (one real run)" if check["noise"] is None else f"{check['noise']:.1%}"
        print(f"  {name:<26} error {check['error']:.1%}  noise {noise}  "
              f"{'passed' if check['passed'] else 'FAILED'}")
    result["checks"] = {"noise_margin": NOISE_MARGIN, **checks}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
