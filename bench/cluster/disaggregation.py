"""Prefill/decode disaggregation: aggregated (2 replicas of role both behind `iterserve router`)
against disaggregated (1 prefill + 1 decode replica behind `iterserve router --prefill --decode`),
each engine pinned to one core (taskset, OMP_NUM_THREADS=1), the embedded SmolLM2-135M.

Workloads (the same seeded Poisson arrivals and prompt lengths for every arm; token ids of each
arm's own, so no engine finds a prompt in its prefix cache, which each arm records):
- mixed: long prompts (--long-tokens, default 2000) among short ones (--short-tokens, default
  128), --long-share of them long (default 0.25); every request generates --max-tokens (32);
- short: short prompts only. Disaggregated twice: with the default threshold (512: the short
  prompts never go remote, so the prefill replica idles) and with --pd-threshold-tokens 0 (every
  prompt goes remote: what the threshold saves).

Figures per arm: TTFT p50/p90 (all, long, short), ITL p90/p99, end-to-end p50, and for the
disaggregated arms the KV transfer cost (the decode engine's iterserve_kv_transfer_seconds and
_bytes per transferred prompt token), the share of requests sent remote and the router's remote
prefill seconds; for every arm its engines' busy share (CPU seconds of the engine process per
second of the arm) and the load average at its start and end. The arrival rate is set from a
calibration on one replica (--utilization, default 0.6, of two replicas' capacity, requests
alone; for each workload its own mix) unless --rate / --short-rate are given. With 2000-token prompts at
--long-share 0.25 the split is balanced: the prefill replica gets the long prefills, the decode
replica the short prefills and all decoding, each about as busy as one aggregated replica. The
router and the load generator are not pinned: they share the two cores with the engines, as the
rest of this machine's work does.

    python -m bench.cluster.disaggregation --json docs/perf/disaggregation.json --plot docs/perf/disaggregation.png
    # the committed run (~11 min on an idle 2-vCPU machine), reusing run 1's calibration:
    python -m bench.cluster.disaggregation --calibrated 15.33 2.98 --utilization 0.8 --short-rate 0.403 --json ... --plot ...
    python -m bench.cluster.disaggregation --quick
    python -m bench.cluster.disaggregation --fake-model --requests 8 --rate 2   # the plumbing only, in a minute
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench import common
from iterserve.devcluster.waiting import free_port, wait_for
from iterserve.engine import metrics as names
from iterserve.engine.loadgen import PROMPT_TOKEN_RANGE, percentiles

ITERSERVE = [str(Path(sys.executable).parent / "iterserve")]
MODEL = ["smollm2-135m"]  # the served model name, read from the engines' /v1/models
ENGINE_ARGS = ["--max-model-len", "4096", "--max-num-seqs", "8", "--log-level", "warning"]


@dataclass
class Result:
    prompt_tokens: int
    start: float = 0.0
    first: float | None = None
    end: float | None = None
    times: list[float] = field(default_factory=list)
    status: str = ""


class Procs:
    """The benchmark's child processes, all stopped at the end."""

    def __init__(self, logdir: Path):
        self.logdir, self.procs = logdir, []
        self.by_name: dict[str, subprocess.Popen] = {}
        self.engine_args: list[str] = []
        self.pin = shutil.which("taskset") is not None and (os.cpu_count() or 1) >= 2

    def start(self, name: str, command: list[str], core: int | None = None) -> subprocess.Popen:
        if core is not None and self.pin:
            command = ["taskset", "-c", str(core % (os.cpu_count() or 1)), *command]
        log = open(self.logdir / f"{name}.log", "wb")  # noqa: SIM115
        # Not from the repository root: its folder operator/ must not shadow the stdlib module.
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd="/",
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
        self.procs.append(proc)
        self.by_name[name] = proc
        return proc

    def cpu_seconds(self, name: str) -> float | None:
        """The process's user + system CPU time so far (taskset execs the engine: same pid)."""
        try:
            fields = Path(f"/proc/{self.by_name[name].pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, KeyError, IndexError):
            return None
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def engine(self, name: str, core: int, *extra: str) -> str:
        port = free_port()
        self.start(name, [*ITERSERVE, "serve", "--port", str(port), *ENGINE_ARGS, *self.engine_args, *extra], core)
        return f"http://127.0.0.1:{port}"

    def router(self, name: str, *args: str) -> str:
        port = free_port()
        self.start(name, [*ITERSERVE, "router", "--port", str(port), "--seed", "0", "--log-level", "warning", *args])
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: _ok(f"{url}/health"), 30, 0.1, what=f"router {name} up")
        return url

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def scrape(url: str) -> dict[str, float]:
    """Every sample as 'name{k=v,...}', and each name's sum over its series as 'name'."""
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        for s in family.samples:
            if s.labels:
                key = s.name + "{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())) + "}"
                samples[key] = samples.get(key, 0.0) + s.value
            if "le" not in s.labels:
                samples[s.name] = samples.get(s.name, 0.0) + s.value
    return samples


def workload(args, long_share: float, seed: int, arm: int, rate: float, stream: int,
             count: int) -> list[tuple[float, list[int]]]:
    """(arrival offset in seconds, prompt token ids) per request: the same arrivals and lengths for
    every arm of a workload, token ids of the arm's own stream (an engine that served an earlier
    arm or workload must not find the prompts in its prefix cache: each (stream, arm) pair draws
    from its own generator; pass a different stream per workload); no two prompts share a prefix."""
    rng, tokens = random.Random(seed), random.Random(f"{seed}/{stream}/{arm}")
    # Exactly round(long_share * count) long prompts, at seeded places (a coin per request drew 2
    # long prompts of 24 at share 0.25 with seed 0).
    long_at = set(rng.sample(range(count), round(long_share * count)))
    at, out = 0.0, []
    for i in range(count):
        n = args.long_tokens if i in long_at else args.short_tokens
        out.append((at, [tokens.randint(*PROMPT_TOKEN_RANGE) for _ in range(n)]))
        at += rng.expovariate(rate)
    return out


async def one(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int, result: Result) -> None:
    body = {"model": MODEL[0], "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    result.start = time.perf_counter()
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                result.status = str(response.status_code)
                await response.aread()
                return
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    if any(c.get("text") for c in json.loads(line[6:]).get("choices", [])):
                        now = time.perf_counter()
                        result.first = result.first or now
                        result.times.append(now)
                elif line == "data: [DONE]":
                    result.status = "ok"
    except httpx.HTTPError as error:
        result.status = type(error).__name__
    finally:
        result.end = time.perf_counter()


async def drive(url: str, requests: list[tuple[float, list[int]]], max_tokens: int) -> tuple[list[Result], float]:
    results = [Result(len(p)) for _, p in requests]
    async with httpx.AsyncClient(timeout=httpx.Timeout(900, connect=10)) as client:
        started = time.perf_counter()

        async def later(offset, prompt, result):
            await asyncio.sleep(max(0.0, started + offset - time.perf_counter()))
            await one(client, url, prompt, max_tokens, result)

        await asyncio.gather(*(later(o, p, r) for (o, p), r in zip(requests, results, strict=True)))
        return results, time.perf_counter() - started


def summarize(results: list[Result], elapsed: float, long_tokens: int) -> dict:
    done = [r for r in results if r.status == "ok" and r.first is not None]

    def ttft(rs):
        return stats([r.first - r.start for r in rs])

    itl = [b - a for r in done for a, b in itertools.pairwise(r.times)]
    return {
        "requests": len(results), "completed": len(done),
        "errors": sorted({r.status for r in results if r.status != "ok"}),
        "duration_s": elapsed,
        "ttft_s": ttft(done), "ttft_long_s": ttft([r for r in done if r.prompt_tokens >= long_tokens]),
        "ttft_short_s": ttft([r for r in done if r.prompt_tokens < long_tokens]),
        "itl_s": stats(itl), "e2e_s": stats([r.end - r.start for r in done]),
        "output_tokens_per_s": sum(len(r.times) for r in done) / elapsed if elapsed else 0.0,
    }


def stats(values: list[float]) -> dict:
    """loadgen's mean/p50/p95/p99/max plus p90, interpolated the same way."""
    out = percentiles(values)
    out["p90"] = None
    if values:
        ordered = sorted(values)
        pos = 0.9 * (len(ordered) - 1)
        low = int(pos)
        high = min(low + 1, len(ordered) - 1)
        out["p90"] = ordered[low] + (ordered[high] - ordered[low]) * (pos - low)
    return out


def transfer_cost(before: dict, after: dict, router_before: dict, router_after: dict) -> dict:
    delta = lambda d0, d1, k: d1.get(k, 0.0) - d0.get(k, 0.0)  # noqa: E731
    seconds = delta(before, after, names.KV_TRANSFER_SECONDS + "_sum")
    count = delta(before, after, names.KV_TRANSFER_SECONDS + "_count")
    nbytes = delta(before, after, names.KV_TRANSFER_BYTES + "_sum")
    tokens = delta(router_before, router_after, "tokens")
    remote = delta(router_before, router_after, f"{names.ROUTER_PD_DECISIONS_TOTAL}{{reason=remote}}")
    prefill_s = delta(router_before, router_after, names.ROUTER_PD_PREFILL_SECONDS + "_sum")
    return {
        "transfers": count, "remote_prefills": remote,
        "fallbacks": delta(router_before, router_after, names.ROUTER_PD_FALLBACKS_TOTAL),
        "transfer_failures": delta(before, after, names.KV_TRANSFER_FAILURES_TOTAL),
        "transfer_seconds_total": seconds, "transfer_bytes_total": nbytes, "transferred_tokens": tokens,
        "transfer_ms_per_token": 1000 * seconds / tokens if tokens else None,
        "transfer_bytes_per_token": nbytes / tokens if tokens else None,
        "mean_transfer_s": seconds / count if count else None,
        "mean_remote_prefill_s": prefill_s / remote if remote else None,
    }


def run_arm(name: str, url: str, requests, args, engines: dict[str, str], procs: Procs,
            decode: str | None, threshold: int) -> dict:
    """One arm: the requests through url; engines (name -> URL) are the ones behind it, whose CPU
    time (busy share of their core) and prefix cache hits are recorded; decode is the decode
    engine of a disaggregated arm (its KV transfer metrics give the transfer cost)."""
    load0 = list(os.getloadavg())
    cpu0 = {e: procs.cpu_seconds(e) for e in engines}
    engine0 = {e: scrape(u) for e, u in engines.items()}
    router0 = scrape(url)
    results, elapsed = asyncio.run(drive(url, requests, args.max_tokens))
    engine1 = {e: scrape(u) for e, u in engines.items()}
    router1 = scrape(url)
    cpu1 = {e: procs.cpu_seconds(e) for e in engines}
    summary = summarize(results, elapsed, args.long_tokens)
    summary["rate_per_s"] = len(requests) / requests[-1][0] if len(requests) > 1 and requests[-1][0] else None
    summary["prompt_tokens_total"] = sum(len(p) for _, p in requests)
    summary["long_requests"] = sum(len(p) >= args.long_tokens for _, p in requests)
    # The share of the arm's wall time each engine's process was on a CPU (its one core): how busy
    # the arm kept it (below 1 also when other processes took the core while it had work).
    summary["engine_cpu_busy"] = {e: (cpu1[e] - cpu0[e]) / elapsed if cpu0[e] is not None and cpu1[e] is not None
                                  else None for e in engines}
    # Prompt tokens the engines found in their prefix caches during the arm: 0 unless prompts repeat
    # (they do not: each arm has its own), else the KV bytes per token below would be understated.
    hits = names.PREFIX_CACHE_HITS_TOTAL
    summary["prefix_cache_hits"] = {e: engine1[e].get(hits, 0.0) - engine0[e].get(hits, 0.0) for e in engines}
    if decode:
        key = f"{names.ROUTER_PD_DECISIONS_TOTAL}{{reason=remote}}"
        remote = router1.get(key, 0.0) - router0.get(key, 0.0)
        # Tokens whose KV moved: the prompts the router sent remote, the longest ones above the
        # threshold (the router sends every prompt over it unless the prefill queue is full; in the
        # mixed workload those all have the long length, in short-forced every prompt is remote).
        moved = sorted((len(p) for _, p in requests if len(p) > threshold), reverse=True)[:int(remote)]
        summary["transfer"] = transfer_cost(engine0[decode], engine1[decode], {**router0, "tokens": 0.0},
                                            {**router1, "tokens": float(sum(moved))})
        summary["transfer"]["remote_share"] = remote / len(requests)
        summary["pd_decisions"] = {
            k.split("reason=")[1].rstrip("}"): router1[k] - router0.get(k, 0.0)
            for k in router1 if k.startswith(names.ROUTER_PD_DECISIONS_TOTAL + "{")}
    summary["load_average_at_start"] = load0
    summary["load_average"] = list(os.getloadavg())
    print(f"  {name}: {_line(summary)}", flush=True)
    return summary


def _line(s: dict) -> str:
    f = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    line = (f"{s['completed']}/{s['requests']} ok, TTFT p50 {f(s['ttft_s']['p50'])} s p90 {f(s['ttft_s']['p90'])} s, "
            f"ITL p90 {f(s['itl_s']['p90'])} s p99 {f(s['itl_s']['p99'])} s")
    if "transfer" in s:
        t = s["transfer"]
        per_token = t["transfer_bytes_per_token"]
        line += (f"; remote {t['remote_prefills']:.0f}, transfer {f(t['transfer_ms_per_token'])} ms/token, "
                 f"{'-' if per_token is None else f'{per_token:.0f}'} B/token")
    busy = ", ".join(f"{e} {b:.0%}" for e, b in s["engine_cpu_busy"].items() if b is not None)
    return f"{line}; {s['duration_s']:.0f} s, engines busy {busy}, load {s['load_average'][0]:.1f}"


def calibrate(url: str, args) -> dict:
    """Seconds for one long and one short request alone on one replica (after a warm-up)."""
    rng = random.Random(args.seed + 99)

    def alone(n: int) -> float:
        results, elapsed = asyncio.run(drive(url, [(0.0, [rng.randint(*PROMPT_TOKEN_RANGE) for _ in range(n)])],
                                             args.max_tokens))
        assert results[0].status == "ok", results[0].status
        return elapsed

    alone(args.short_tokens)  # warm-up
    return {"long_s": alone(args.long_tokens), "short_s": alone(args.short_tokens)}


def plot(report: dict, path: str) -> None:
    plt = common.pyplot()
    workloads = report["workloads"]
    fig, axes = plt.subplots(1, len(workloads), figsize=(6.5 * len(workloads), 5.5), squeeze=False)
    figures = [("TTFT p50", "ttft_s", "p50"), ("TTFT p90", "ttft_s", "p90"), ("short-prompt\nTTFT p90", "ttft_short_s", "p90"),
               ("ITL p90", "itl_s", "p90"), ("ITL p99", "itl_s", "p99")]
    for ax, (workload_name, arms) in zip(axes[0], workloads.items(), strict=True):
        width = 0.8 / len(arms)
        for i, (arm, r) in enumerate(arms.items()):
            values = [r[k][q] or 0 for _, k, q in figures]
            t = r.get("transfer")
            label = arm if not t else (f"{arm} ({t['remote_prefills']:.0f}/{r['requests']} remote"
                                       + (f", KV {t['transfer_ms_per_token']:.2f} ms/token)"
                                          if t["transfer_ms_per_token"] is not None else ")"))
            ax.bar([x + i * width for x in range(len(figures))], values, width, label=label)
        ax.set_xticks([x + width * (len(arms) - 1) / 2 for x in range(len(figures))], [f[0] for f in figures])
        ax.set_yscale("log")
        ax.set_ylabel("seconds (log)")
        ax.set_title(f"{workload_name} prompts")
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=1)
    m = report["machine"]
    model = "the FAKE model (plumbing check)" if report["args"].get("fake_model") else "SmolLM2-135M"
    fig.suptitle(f"P/D disaggregation, {model}, one core per engine; {m['cpu_model']}, load "
                 f"{m['load_average_at_start'][0]:.1f} -> {m['load_average_at_end'][0]:.1f}", fontsize=9)
    common.save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_common_args(parser)
    parser.add_argument("--long-tokens", type=int, help="long prompts' length (default 2000; quick: 700)")
    parser.add_argument("--short-tokens", type=int, help="short prompts' length (default 128; quick: 48)")
    parser.add_argument("--long-share", type=float, default=0.25,
                        help="share of long prompts in the mixed workload (exactly, rounded; default 0.25)")
    parser.add_argument("--requests", type=int, help="requests per arm (default 24; quick: 8)")
    parser.add_argument("--max-tokens", type=int, help="output tokens per request (default 32; quick: 16)")
    parser.add_argument("--rate", type=float, help="arrivals per second (default: --utilization of the calibrated "
                                                   "capacity of two replicas)")
    parser.add_argument("--utilization", type=float, default=0.6,
                        help="without --rate: the arrival rate as this share of two replicas' capacity, from the "
                             "calibration of one long and one short request alone (default 0.6)")
    parser.add_argument("--calibrated", type=float, nargs=2, metavar=("LONG_S", "SHORT_S"),
                        help="skip the calibration: seconds of one long and one short request alone on one replica, "
                             "as an earlier run printed (its 'calibration:' line)")
    parser.add_argument("--short-rate", type=float,
                        help="the short workload's arrivals per second (default: --utilization of two replicas' capacity for "
                             "short requests; with --rate and no calibration, that rate)")
    parser.add_argument("--short-requests", type=int, help="the short workload's requests per arm (default --requests)")
    parser.add_argument("--threshold", type=int, default=512, help="the router's --pd-threshold-tokens (default 512)")
    parser.add_argument("--workloads", default="mixed,short", help="comma-separated, of mixed and short (default both)")
    parser.add_argument("--fake-model", action="store_true",
                        help="engines serve the fake model: checks this script's plumbing in seconds, measures nothing")
    args = parser.parse_args(argv)
    args.long_tokens = args.long_tokens or (700 if args.quick else 2000)
    args.short_tokens = args.short_tokens or (48 if args.quick else 128)
    args.requests = args.requests or (8 if args.quick else 24)
    args.max_tokens = args.max_tokens or (16 if args.quick else 32)
    wanted = {w.strip() for w in args.workloads.split(",") if w.strip()}
    if not wanted or wanted - {"mixed", "short"}:
        parser.error("--workloads: a comma-separated list of mixed and short")
    if args.threshold >= args.long_tokens or args.short_tokens > args.threshold:
        parser.error("the threshold must lie between the short and the long prompts' lengths")
    common.set_threads(args.threads)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the engines and routers (finally) on SIGTERM
    info = common.machine(args.threads)
    info["pinned_one_core_per_engine"] = shutil.which("taskset") is not None and (os.cpu_count() or 1) >= 2
    report: dict = {"machine": info, "args": {k: v for k, v in vars(args).items() if k not in ("json", "plot")},
                    "workloads": {}}
    with tempfile.TemporaryDirectory(prefix="disagg-bench-") as tmp:
        procs = Procs(Path(tmp))
        # The fake model turns prefix caching off by default; on, as with the real model, the
        # plumbing check sees the prefix cache hits a shared prompt would cause.
        procs.engine_args = ["--fake-model", "--enable-prefix-caching"] if args.fake_model else []
        key = Path(tmp) / "kv-auth.key"  # the KV key the P/D engines and routers share, as in a cluster
        key.write_text(secrets.token_urlsafe(32))
        kv_auth = ["--kv-auth-key-file", str(key)]
        try:
            engines = {"both0": procs.engine("both0", 0), "both1": procs.engine("both1", 1),
                       "prefill": procs.engine("prefill", 0, "--role", "prefill", *kv_auth),
                       "decode": procs.engine("decode", 1, "--role", "decode", *kv_auth)}
            for name, url in engines.items():
                wait_for(lambda url=url: _ok(f"{url}/ready"), 900, 0.5, what=f"engine {name} ready")
            MODEL[0] = httpx.get(f"{engines['both0']}/v1/models", timeout=30).json()["data"][0]["id"]
            if args.calibrated:
                calibration = {"long_s": args.calibrated[0], "short_s": args.calibrated[1], "from": "--calibrated"}
            elif args.rate is None:
                calibration = calibrate(engines["both0"], args)
            else:
                calibration = {"long_s": None, "short_s": None}
            if args.rate is None:
                # Each request alone on one replica takes long_s or short_s: two replicas at
                # --utilization of that capacity (batching serves a little more, so the engines run
                # somewhat below it; each arm records its engines' measured busy share).
                mean_s = args.long_share * calibration["long_s"] + (1 - args.long_share) * calibration["short_s"]
                args.rate = args.utilization * 2 / mean_s
            if args.short_rate is None:  # the same --utilization of the pair, on short requests
                args.short_rate = (args.utilization * 2 / calibration["short_s"] if calibration["short_s"]
                                   else args.rate)
            args.short_requests = args.short_requests or args.requests
            report["calibration"] = {**calibration, "rate_per_s": args.rate, "short_rate_per_s": args.short_rate}
            report["args"].update(rate=args.rate, short_rate=args.short_rate, short_requests=args.short_requests)
            minutes = (2 * args.requests / args.rate * ("mixed" in wanted)
                       + 3 * args.short_requests / args.short_rate * ("short" in wanted)) / 60
            print(f"calibration: {calibration}; rate {args.rate:.3f}/s (short workload {args.short_rate:.3f}/s): about "
                  f"{minutes:.0f} min of arrivals", flush=True)
            aggregated = procs.router("router-agg", "--endpoints", f"{engines['both0']},{engines['both1']}")
            # A prefill slower than the router's default timeout (30 s) would fall back to local prefill;
            # here every remote prefill is waited for, so the arm measures disaggregation itself.
            pd = ["--prefill", engines["prefill"], "--decode", engines["decode"], "--pd-prefill-timeout", "900",
                  *kv_auth]
            disaggregated = procs.router("router-pd", *pd, "--pd-threshold-tokens", str(args.threshold))
            forced = procs.router("router-pd0", *pd, "--pd-threshold-tokens", "0")
            agg_engines = {e: engines[e] for e in ("both0", "both1")}
            pd_engines = {e: engines[e] for e in ("prefill", "decode")}
            plan = [("mixed", args.long_share, args.rate, args.requests, [("aggregated", aggregated, agg_engines, None, args.threshold),
                                                ("disaggregated", disaggregated, pd_engines, "decode", args.threshold)]),
                    ("short", 0.0, args.short_rate, args.short_requests, [("aggregated", aggregated, agg_engines, None, args.threshold),
                                    ("disaggregated", disaggregated, pd_engines, "decode", args.threshold),
                                    ("disaggregated_threshold_0", forced, pd_engines, "decode", 0)])]
            for stream, (workload_name, share, rate, count, arms) in enumerate(plan):
                if workload_name not in wanted:
                    continue
                print(f"{workload_name} workload:", flush=True)
                report["workloads"][workload_name] = {
                    name: run_arm(name, url, workload(args, share, args.seed, i, rate, stream, count), args, arm_engines,
                                  procs, decode, threshold)
                    for i, (name, url, arm_engines, decode, threshold) in enumerate(arms)}
        finally:
            procs.close()
    common.finish_machine(info)
    rows = []
    for workload_name, arms in report["workloads"].items():
        for arm, r in arms.items():
            t = r.get("transfer") or {}
            rows.append([f"{workload_name}/{arm}", r["ttft_s"]["p50"], r["ttft_s"]["p90"], r["itl_s"]["p90"],
                         r["itl_s"]["p99"], r["ttft_long_s"]["p50"], r["ttft_short_s"]["p50"], t.get("remote_share"),
                         t.get("transfer_ms_per_token"), t.get("transfer_bytes_per_token"),
                         f"{r['completed']}/{r['requests']}"])
    print()
    print(common.format_table(["arm", "TTFT p50 s", "TTFT p90 s", "ITL p90 s", "ITL p99 s", "long TTFT p50 s",
                               "short TTFT p50 s", "remote share", "KV ms/token", "KV B/token", "ok"], rows))
    print(f"cpu {info['cpu_model']}, {info['cpus']} cpus, load average {info['load_average_at_start']} -> "
          f"{info['load_average_at_end']}")
    common.write_json(args.json, report)
    if args.plot:
        plot(report, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
