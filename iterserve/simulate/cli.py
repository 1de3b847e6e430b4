"""`iterserve simulate`: replay a trace against an InferenceService on a simulated clock.

    iterserve simulate --trace T --spec infsvc.yaml [--profile P] --json OUT [--plot OUT.png]
    iterserve simulate fit --step-log FILE [--out PROFILE.json]   # fit a step-time profile
    iterserve simulate gen --kind poisson --rate 2 --duration 600 --out trace.csv
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from iterserve.replica_model import profile as profiles
from iterserve.simulate import traces

SMOLLM2_KV_BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 4  # 30 layers x K,V x 3 KV heads x 64 dims x fp32
SMOLLM2_CONTEXT = 8192


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", nargs="?", default="run", choices=["run", "fit", "gen"],
                        help="run (default): simulate; fit: a profile from step logs; gen: write a trace")
    run = parser.add_argument_group("run")
    run.add_argument("--trace", help="trace file (Azure CSV, BurstGPT CSV, Mooncake JSONL, or "
                                     "timestamp_s,prompt_tokens,output_tokens CSV)")
    run.add_argument("--trace-format", default="auto", choices=traces.FORMATS)
    run.add_argument("--limit", type=int, help="only the first N requests of the trace")
    run.add_argument("--time-scale", type=float, default=1.0,
                     help="multiply arrival times (0.5: the same trace at twice the rate)")
    run.add_argument("--spec", help="InferenceService YAML (a manifest or just its spec; default: one "
                                    "replica of the embedded model, no autoscaling)")
    run.add_argument("--profile", help=f"step-time profile JSON, or one of {', '.join(profiles.PROFILES)} "
                                       f"(default {profiles.DEFAULT_PROFILE}; fake-model for --fake-model specs)")
    run.add_argument("--json", metavar="OUT", help="write the result here")
    run.add_argument("--plot", metavar="OUT.png", help="write the timeline plot here (needs matplotlib)")
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--startup-delay", default="30",
                     help="pod start-up delay: 30, uniform:20:40, normal:60:10, lognormal:60:20 (seconds)")
    run.add_argument("--scrape-interval", type=float, help="seconds between metric samples (default: the "
                                                           "autoscaler's intervalSeconds)")
    run.add_argument("--metrics-lag", type=float, default=0.0, help="age of the newest sample the "
                                                                    "autoscaler may see (default 0: direct scrape)")
    run.add_argument("--router", choices=["round-robin", "least-load"],
                     help="round-robin (a Service), or least-load: the iterserve router's pick(); default: "
                          "what the spec's routing.mode deploys (Router: least-load)")
    run.add_argument("--tail", type=float, default=0.0, help="keep simulating this long after the last request")
    run.add_argument("--cold-start", action="store_true", help="the spec's first replicas start at t=0 "
                                                               "instead of being ready")
    run.add_argument("--slo-ttft", type=float, default=2.0, help="TTFT SLO in seconds (default 2)")
    run.add_argument("--slo-itl", type=float, default=0.2, help="mean inter-token latency SLO (default 0.2 s)")
    run.add_argument("--no-progress", action="store_true")

    fit = parser.add_argument_group("fit")
    fit.add_argument("--step-log", action="append", default=[], help="engine --step-log file (repeatable)")
    fit.add_argument("--test-step-log", action="append", default=[],
                     help="held-out step log to report errors on (default: every 4th step of --step-log)")
    fit.add_argument("--timing", default="step", choices=list(profiles.TIMINGS),
                     help="step: each step's own wall duration; cpu: each step's engine-thread CPU time "
                          "(its own compute: what the step takes on a dedicated core, so fit a busy "
                          "node's log this way); interval: end-to-end between back-to-back steps (adds "
                          "the server loop's per-step cost)")
    fit.add_argument("--out", help="fit: the profile JSON to write; gen: the trace CSV to write")
    fit.add_argument("--name", default="fitted")
    fit.add_argument("--kv-bytes-per-token", type=int, default=SMOLLM2_KV_BYTES_PER_TOKEN,
                     help="the model's KV bytes per token (default: SmolLM2-135M in float32)")
    fit.add_argument("--model-context-len", type=int, default=SMOLLM2_CONTEXT)
    fit.add_argument("--block-size", type=int, default=16, help="the engine's block size (old step logs)")

    gen = parser.add_argument_group("gen")
    gen.add_argument("--kind", default="poisson", choices=["poisson", "gamma", "diurnal"])
    gen.add_argument("--rate", type=float, default=1.0, help="requests per second (diurnal: the mean)")
    gen.add_argument("--duration", type=float, default=600.0)
    gen.add_argument("--cv", type=float, default=3.0, help="gamma: coefficient of variation of the gaps")
    gen.add_argument("--peak-to-trough", type=float, default=4.0, help="diurnal: highest/lowest rate")
    gen.add_argument("--period", type=float, default=86400.0, help="diurnal: seconds per cycle")
    gen.add_argument("--prompt", default="64", help="prompt tokens: 64, uniform:16:128, zipf:512")
    gen.add_argument("--output", default="zipf:256", help="output tokens: 64, uniform:16:128, zipf:256")


def load_spec(path: str | None):
    import yaml

    from iterserve.operator.models import InferenceServiceSpec

    if path is None:
        return InferenceServiceSpec.model_validate({"model": {"uri": "smollm2-135m"}})
    document = yaml.safe_load(Path(path).read_text())
    raw = document.get("spec", document) if isinstance(document, dict) else None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected an InferenceService manifest or its spec")
    return InferenceServiceSpec.model_validate(raw)


def simulate(trace, spec, profile, options, slo, inputs: dict, progress: bool = False) -> tuple[dict, float]:
    """Runs one simulation; returns the JSON document and the wall seconds it took."""
    from iterserve.simulate.cluster import ClusterSim
    from iterserve.simulate.report import to_json

    bar = None
    if progress:
        from tqdm import tqdm

        horizon = trace[-1].arrival_s if trace else 0.0
        bar = tqdm(total=round(horizon), unit="sim s", file=sys.stderr, leave=False, mininterval=1.0,
                   disable=None)  # None: shown on a terminal, silent in logs
        shown = [0]

        def tick(t: float) -> None:
            whole = min(int(t), bar.total)
            if whole > shown[0]:
                bar.update(whole - shown[0])
                shown[0] = whole
    started = time.perf_counter()
    result = ClusterSim(spec, profile, trace, options, progress=tick if bar else None).run()
    wall = time.perf_counter() - started
    if bar is not None:
        bar.close()
    return to_json(result, slo, inputs), wall


def run(args: argparse.Namespace) -> int:
    try:
        if args.action == "fit":
            return _fit(args)
        if args.action == "gen":
            return _gen(args)
        return _run(args)
    except (ValueError, OSError) as error:
        print(f"iterserve simulate: {error}", file=sys.stderr)
        return 2


def _run(args) -> int:
    from iterserve.operator.engine_config import profile_for
    from iterserve.simulate.cluster import Delay, SimOptions, router_for
    from iterserve.simulate.report import Slo, dumps, plot

    if not args.trace:
        raise ValueError("give --trace (iterserve simulate gen writes one)")
    trace = traces.load_trace(args.trace, args.trace_format, args.limit)
    if args.time_scale != 1.0:
        trace = [traces.TraceRequest(r.arrival_s * args.time_scale, r.prompt_tokens, r.output_tokens) for r in trace]
    spec = load_spec(args.spec)
    profile = profile_for(spec, args.profile)
    options = SimOptions(seed=args.seed, startup=Delay.parse(args.startup_delay),
                         scrape_interval_s=args.scrape_interval, metrics_lag_s=args.metrics_lag,
                         router=args.router, tail_s=args.tail, initial_pods_ready=not args.cold_start)
    slo = Slo(args.slo_ttft, args.slo_itl)
    inputs = {"trace": Path(args.trace).name, "requests": len(trace), "profile": profile.name,
              "profile_modelled": profile.modelled, "seed": args.seed, "startup_delay": args.startup_delay,
              "router": args.router or router_for(spec), "metrics_lag_s": args.metrics_lag, "spec": spec.to_wire()}
    document, wall = simulate(trace, spec, profile, options, slo, inputs, progress=not args.no_progress)
    summary = document["summary"]
    if args.json:
        Path(args.json).write_text(dumps(document))
    if args.plot:
        plot(document, args.plot, f"{Path(args.trace).name}, profile {profile.name}")
    simulated = summary["simulated_seconds"]
    print(f"{summary['requests']} requests {summary['statuses']}; throughput "
          f"{summary['throughput']['requests_per_s']} req/s, {summary['throughput']['output_tokens_per_s']} tok/s; "
          f"TTFT p50/p95 {summary['ttft_s']['p50']}/{summary['ttft_s']['p95']} s; ITL p95 {summary['itl_s']['p95']} s; "
          f"SLO attainment {summary['slo']['attainment']}; replica-seconds {summary['replica_seconds']}; "
          f"{len(summary['scale_events'])} scale events, {len(summary['retunes'])} retunes, "
          f"{summary['preemptions']} preemptions")
    print(f"simulated {simulated:.0f} s in {wall:.2f} s wall ({simulated / max(wall, 1e-9):.0f}x real time)",
          file=sys.stderr)
    return 0


def _fit(args) -> int:
    if not args.step_log:
        raise ValueError("give --step-log FILE (an engine started with --step-log wrote it)")
    records = profiles.step_log_records(args.step_log, args.timing)
    if args.test_step_log:
        train, test = records, profiles.step_log_records(args.test_step_log, args.timing)
    else:
        train, test = profiles.split(records)
    profile = profiles.fit_profile(train, test, args.name, args.kv_bytes_per_token, args.model_context_len,
                                   args.block_size, source=", ".join(Path(p).name for p in args.step_log))
    terms = ", ".join(f"{t}={c:.4g}" for t, c in profile.coefficients.items())
    print(f"fitted on {len(train)} steps: t = {terms} (seconds)")
    for r in profile.fit["selection"][1:]:
        print(f"extra terms considered (4-fold cross-validated mean error with each): {r['considered']}")
    print(f"relative error on {len(test)} held-out steps:")
    print(profiles.format_errors(profiles.evaluate(profile, test, args.block_size)))
    if args.out:
        Path(args.out).write_text(profile.to_json())
        print(f"wrote {args.out}")
    return 0


def _gen(args) -> int:
    prompt, output = traces.Lengths.parse(args.prompt), traces.Lengths.parse(args.output)
    if args.kind == "poisson":
        trace = traces.poisson(args.rate, args.duration, prompt, output, args.seed)
    elif args.kind == "gamma":
        trace = traces.gamma(args.rate, args.cv, args.duration, prompt, output, args.seed)
    else:
        trace = traces.diurnal(args.rate, args.peak_to_trough, args.period, args.duration, prompt, output, args.seed)
    if not args.out:
        raise ValueError("give --out trace.csv")
    traces.write_csv(trace, args.out)
    print(f"wrote {len(trace)} requests over {args.duration:g} s to {args.out}")
    return 0
