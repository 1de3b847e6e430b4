"""Routing: the load-aware router (`iterserve router`) against round robin, on one machine, with
fake-model engines (`iterserve serve --fake-model`: the real scheduler, modelled step time).

Scenarios (each on fresh engine processes):
- skewed: two replicas, one twice as slow (--fake-step-time-scale), Poisson load at 60% of their
  measured joint capacity: p95 TTFT with round robin / with the router (target >= 3);
- identical: two identical replicas at 80%: the same ratio (target >= 1.2);
- metrics_500: one replica's /metrics answers 500 (bench/routing/fault_proxy.py in front of it): client
  5xx (target 0), the router keeps routing to it on local counts;
- saturated: offered load 3x capacity: the statuses clients get (target: only 200 and 429);
- kill: three replicas at 60%, one SIGKILLed a third of the way in: failed requests (target <= 1%)
  and the time from the kill to the router's ejection (target <= 1 s);
- overhead: one replica at 200 req/s, short streamed requests (4 tokens), alternately direct and
  through the router: added p50 end-to-end latency (target < 2 ms). The load comes from `hey`
  (a Go HTTP load generator: `GOBIN=~/.cache/iterserve-peers/bin go install
  github.com/rakyll/hey@v0.1.4`, or on PATH, or $ITERSERVE_HEY), which holds 200 req/s on 2 vCPUs;
  without it (or with --python-loadgen) iterserve's Python loadgen, which reaches ~60 req/s on a
  busy 2-vCPU machine. The JSON's `loadgen` says which one ran.

With --old-router COMMIT, that commit's router (a git worktree of it) runs beside this one in
every scenario, its figures under `old_router` in each: in skewed, identical and overhead as one
more arm of the same alternating rounds; in metrics_500 and saturated on the same engines right
after this router's run; in kill on fresh engines of its own (the first run's victim is dead).

Round robin is the loadgen spreading requests over the engine URLs itself, as a Kubernetes
Service would; the router runs as its own process. Round robin and the router take turns in
alternating rounds with the same arrivals, percentiles pooled, so both see the same background
load of a shared machine. Capacity is measured, not assumed: a closed
loop of max_num_seqs requests per replica for a few seconds.

    python -m bench.routing.router --json docs/perf/routing.json --plot docs/perf/routing.png
    python -m bench.routing.router --quick
    python -m bench.routing.router --old-router COMMIT --json docs/perf/routing.json --plot docs/perf/routing.png
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench import common
from iterserve.devcluster.waiting import free_port, wait_for
from iterserve.engine import metrics as names
from iterserve.engine.loadgen import LoadSpec, percentiles, run_load
from iterserve.machine import cpu_model

FAULT_PROXY = Path(__file__).resolve().with_name("fault_proxy.py")  # standalone: runs by its path
SCENARIOS = ("skewed", "identical", "metrics_500", "saturated", "kill", "overhead")
ITERSERVE = [str(Path(sys.executable).parent / "iterserve")]


class Procs:
    """Child processes of one scenario, all killed at the end."""

    def __init__(self, logdir: Path):
        self.logdir = logdir
        self.procs: list[subprocess.Popen] = []
        self.router_logs: dict[str, Path] = {}  # router URL -> its log

    def start(self, name: str, command: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        log = open(self.logdir / f"{name}.log", "wb")  # noqa: SIM115
        # Not from the repository root: its folder operator/ must not shadow the stdlib module.
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd="/",
                                env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
        self.procs.append(proc)
        return proc

    def engine(self, name: str, scale: float, max_num_seqs: int) -> str:
        port = free_port()
        self.start(name, [*ITERSERVE, "serve", "--fake-model", "--port", str(port), "--max-num-seqs",
                          str(max_num_seqs), "--fake-step-time-scale", str(scale), "--log-level", "warning"])
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: _ok(f"{url}/ready"), 60, 0.1, what=f"engine {name} ready")
        return url

    def router(self, urls: list[str], *extra: str, command: list[str] | None = None,
               env: dict[str, str] | None = None) -> str:
        """A router process (command: another build's `iterserve`, with env)."""
        port = free_port()
        name = "router" if not extra and command is None else f"router-{port}"
        self.start(name, [*(command or ITERSERVE), "router", "--port", str(port), "--endpoints", ",".join(urls),
                          "--seed", "0", "--log-level", "warning", *extra], env)
        url = f"http://127.0.0.1:{port}"
        self.router_logs[url] = self.logdir / f"{name}.log"
        wait_for(lambda: _ok(f"{url}/ready"), 30, 0.1, what="router ready")
        return url

    def fault_proxy(self, upstream: str) -> str:
        port = free_port()
        self.start("fault_proxy", [sys.executable, str(FAULT_PROXY), str(port),
                                   upstream.rsplit(":", 1)[1]])
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: _ok(f"{url}/v1/models"), 30, 0.1, what="fault proxy up")
        return url

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs:
            proc.wait()


def _ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False


def router_metrics(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    samples = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=5).text):
        for s in family.samples:
            key = s.name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())) + "}" if s.labels else "")
            samples[key] = s.value
    return samples


def spec(args, url: str = "", endpoints=None, **overrides) -> LoadSpec:
    values = dict(url=url or "http://127.0.0.1:1", rate=1.0, requests=None, duration=args.duration,
                  prompt_len=args.prompt_len, max_tokens=args.max_tokens, seed=args.seed, timeout=120.0,
                  endpoints=endpoints, output_dist=args.output_dist)
    values.update(overrides)
    return LoadSpec(**values)


def round_robin(urls: list[str]):
    return lambda: urls


def load(report: dict) -> dict:
    """The figures a scenario keeps from a loadgen report."""
    return {"requests": report["requests"], "completed": report["completed"],
            "errors_by_status": report["errors_by_status"], "rate_per_s": report["config"]["rate"],
            "throughput_per_s": report["request_throughput_per_s"],
            "ttft_s": report["ttft_s"], "e2e_s": report["e2e_s"]}


def capacity(args, urls: list[str]) -> float:
    """Requests per second the replicas complete with every batch slot busy (closed loop)."""
    n = args.max_num_seqs * len(urls)
    report = asyncio.run(run_load(spec(args, endpoints=round_robin(urls), rate=float("inf"),
                                       duration=None, requests=n * (3 if args.quick else 6), concurrency=n)))
    return report["request_throughput_per_s"]


def pooled(results: list) -> dict:
    """A loadgen-like summary of RequestResults pooled over rounds."""
    done = [r for r in results if r.ok]
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[str(r.status)] = errors.get(str(r.status), 0) + 1
    return {"requests": len(results), "completed": len(done), "errors_by_status": errors,
            "ttft_s": percentiles([r.first_token - r.start for r in done if r.first_token is not None]),
            "e2e_s": percentiles([r.end - r.start for r in done])}


def compare(args, procs: Procs, scales: list[float], utilization: float) -> dict:
    """Round robin and the router on the same replicas, in alternating rounds (RR first, then
    router first, ...) with the same arrivals per round, percentiles pooled over the rounds: both
    see the same background load of the machine."""
    urls = [procs.engine(f"engine{i}", s, args.max_num_seqs) for i, s in enumerate(scales)]
    # Capacity of each replica alone, summed: round robin cannot use the slow one's share fully.
    caps = [capacity(args, [u]) for u in urls]
    router = procs.router(urls)
    # The same router process picking round robin: the same proxy hop, only the policy differs.
    targets = {"round_robin": dict(endpoints=round_robin(urls)), "router": dict(url=router),
               "round_robin_via_router": dict(url=procs.router(urls, "--policy", "round-robin"))}
    if args.old_router:  # one more arm of the same rounds
        command, env = old_router_command(args.old_router)
        targets["old_router"] = dict(url=procs.router(urls, command=command, env=env))
    rate = utilization * sum(caps)
    rounds = 2 if args.quick else args.rounds
    arms = tuple(targets)
    kept: dict[str, list] = {arm: [] for arm in arms}
    for i in range(rounds):
        order = arms if i % 2 == 0 else arms[::-1]
        for arm in order:
            asyncio.run(run_load(spec(args, rate=rate, duration=args.duration / rounds, seed=args.seed + i,
                                      on_result=kept[arm].append, **targets[arm])))
    rr, routed, rr_proxied = (pooled(kept[arm]) for arm in arms[:3])
    ratio = _p95_ratio(rr, routed)
    m = router_metrics(router)
    out = {"step_time_scales": scales, "capacity_per_replica_per_s": caps, "utilization": utilization,
           "rate_per_s": rate, "rounds": rounds, "round_robin": rr, "router": routed,
           "round_robin_via_router": rr_proxied, "p95_ttft_ratio": ratio,
           "p95_ttft_ratio_same_hop": _p95_ratio(rr_proxied, routed),
           "router_picks": {k.split('"')[0].split("=")[-1].rstrip("}"): v for k, v in m.items()
                            if k.startswith(names.ROUTER_PICKS_TOTAL)}}
    if args.old_router:
        old = pooled(kept["old_router"])
        out["old_router"] = {**old, "p95_ttft_ratio": _p95_ratio(rr, old),
                             "p95_ttft_ratio_same_hop": _p95_ratio(rr_proxied, old)}
        out["old_router_commit"] = _full_commit(args.old_router)
    return out


def _p95_ratio(baseline: dict, routed: dict) -> float | None:
    return baseline["ttft_s"]["p95"] / routed["ttft_s"]["p95"] if routed["ttft_s"]["p95"] else None


def with_old_router(args, run_arm) -> dict:
    """run_arm(command, env) -> one router's figures (command None: this checkout's router). With
    --old-router, the same figures of that commit's router under `old_router`, run after this one."""
    out = run_arm(None, None)
    if args.old_router:
        command, env = old_router_command(args.old_router)
        out["old_router"] = run_arm(command, env)
        out["old_router_commit"] = _full_commit(args.old_router)
    return out


def _full_commit(commit: str) -> str:
    return subprocess.run(["git", "rev-parse", commit], cwd=common.REPO, capture_output=True, text=True).stdout.strip()


def scenario_skewed(args, procs: Procs) -> dict:
    out = compare(args, procs, [args.scale, 2 * args.scale], 0.6)
    out["target"] = ">= 3"
    out["pass"] = out["p95_ttft_ratio"] is not None and out["p95_ttft_ratio"] >= 3
    if "old_router" in out:
        ratio = out["old_router"]["p95_ttft_ratio"]
        out["old_router"]["pass"] = ratio is not None and ratio >= 3
    return out


def scenario_identical(args, procs: Procs) -> dict:
    out = compare(args, procs, [args.scale, args.scale], 0.8)
    out["target"] = ">= 1.2"
    out["pass"] = judge("identical", out)
    if "old_router" in out:
        out["old_router"]["pass"] = judge("identical", out["old_router"])
    return out


def judge(name: str, r: dict) -> bool:
    """identical: the ratio must hold against round robin both direct and through the same router
    process (when the two disagree, the machine's noise decided, not the picking); overhead: only a
    run that offered (near) the asked rate measures it."""
    if name == "identical":
        ratios = [r.get("p95_ttft_ratio"), r.get("p95_ttft_ratio_same_hop", r.get("p95_ttft_ratio"))]
        return all(x is not None and x >= 1.2 for x in ratios)
    if name == "overhead":
        achieved = r.get("achieved_rate_per_s") or {}
        return (min(achieved.get("direct", 0), achieved.get("router", 0)) >= 0.9 * r["rate_per_s"]
                and r["added_p50_ms"] < 2.0)
    return r["pass"]


def _five_xx(report: dict) -> int:
    return sum(n for status, n in report["errors_by_status"].items() if status.isdigit() and int(status) >= 500)


def scenario_metrics_500(args, procs: Procs) -> dict:
    urls = [procs.engine(f"engine{i}", args.scale, args.max_num_seqs) for i in range(2)]
    faulty = procs.fault_proxy(urls[1])
    caps = capacity(args, urls)

    def run_arm(command, env) -> dict:
        router = procs.router([urls[0], faulty], command=command, env=env)
        served_before = _engine_requests(urls[1])
        report = asyncio.run(run_load(spec(args, router, rate=0.6 * caps)))
        m = router_metrics(router)
        return {"rate_per_s": 0.6 * caps, "load": load(report), "client_5xx": _five_xx(report),
                "stale_endpoints_at_end": m.get(names.ROUTER_STALE_ENDPOINTS),
                "requests_served_by_the_replica_with_failing_metrics": _engine_requests(urls[1]) - served_before,
                "target": "0 client 5xx", "pass": _five_xx(report) == 0 and report["failed"] == 0}

    return with_old_router(args, run_arm)


def _engine_requests(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(names.REQUESTS_TOTAL + "{"))


def scenario_saturated(args, procs: Procs) -> dict:
    urls = [procs.engine(f"engine{i}", args.scale, args.max_num_seqs) for i in range(2)]
    caps = capacity(args, urls)

    def run_arm(command, env) -> dict:
        router = procs.router(urls, "--queue-timeout", "1", "--max-queue", str(args.max_num_seqs),
                              command=command, env=env)
        report = asyncio.run(run_load(spec(args, router, rate=3 * caps, duration=args.duration / 2)))
        statuses = dict(report["errors_by_status"])
        statuses["200"] = report["completed"]
        return {"rate_per_s": 3 * caps, "statuses": statuses, "load": load(report),
                "target": "only 200 and 429", "pass": set(statuses) <= {"200", "429"}}

    return with_old_router(args, run_arm)


def scenario_kill(args, procs: Procs) -> dict:
    return with_old_router(args, lambda command, env: _kill_run(args, procs, command, env))


def _kill_run(args, procs: Procs, command: list[str] | None, env: dict[str, str] | None) -> dict:
    """Fresh engines each run: the victim of a run stays dead."""
    first = len(procs.procs)
    urls = [procs.engine(f"engine{first + i}", args.scale, args.max_num_seqs) for i in range(3)]
    victim = procs.procs[first]
    caps = capacity(args, urls)
    router = procs.router(urls, command=command, env=env)
    killed: dict = {}

    async def killer():
        await asyncio.sleep(args.duration / 3)
        victim.send_signal(signal.SIGKILL)
        killed["at"] = time.time()

    async def both():
        task = asyncio.create_task(killer())
        report = await run_load(spec(args, router, rate=0.6 * caps))
        await task
        return report

    report = asyncio.run(both())
    failed_fraction = report["failed"] / report["requests"]
    ejected = _ejected_at(procs.router_logs[router], urls[0])
    ejected = None if ejected is None else ejected - killed["at"]
    m = router_metrics(router)
    return {"rate_per_s": 0.6 * caps, "load": load(report), "failed_fraction": failed_fraction,
            "ejected_after_s": ejected, "retries": m.get(names.ROUTER_RETRIES_TOTAL),
            "target": "<= 1% failed, ejection <= 1 s",
            "pass": failed_fraction <= 0.01 and ejected is not None and ejected <= 1.0}


def _ejected_at(log: Path, url: str) -> float | None:
    """The wall-clock time of the router's first 'ejected URL' log line."""
    for line in log.read_text(errors="replace").splitlines():
        if f"ejected {url}:" in line:
            stamp, millis = line[:23].split(",")
            return time.mktime(time.strptime(stamp, "%Y-%m-%d %H:%M:%S")) + int(millis) / 1000
    return None


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


HEY_VERSION = "v0.1.4"  # GOBIN=~/.cache/iterserve-peers/bin go install github.com/rakyll/hey@v0.1.4


def find_hey() -> str | None:
    """The `hey` load generator: $ITERSERVE_HEY, on PATH, or where the peers' tools are installed."""
    for candidate in (os.environ.get("ITERSERVE_HEY"), shutil.which("hey"),
                      str(Path.home() / ".cache/iterserve-peers/bin/hey")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


def _quantiles(values: list[float]) -> dict:
    out = percentiles(values)
    if values:
        ordered = sorted(values)
        position = 0.9 * (len(ordered) - 1)
        low = int(position)
        high = min(low + 1, len(ordered) - 1)
        out["p90"] = ordered[low] + (ordered[high] - ordered[low]) * (position - low)
    else:
        out["p90"] = None
    return out


def _hey_body(prompt_len: int, max_tokens: int) -> str:
    return json.dumps({"model": "fake", "prompt": list(range(100, 100 + prompt_len)), "max_tokens": max_tokens,
                       "temperature": 0.0, "stream": True, "ignore_eos": True})


def hey_run(hey: str, url: str, body: str, *, rate: float | None, seconds: float | None = None,
            requests: int | None = None, streams: int = 1) -> list[tuple[float, int, float]]:
    """(seconds, status, start offset in its process's run) per request. With a rate: `streams` hey
    processes of one worker each at rate/streams req/s, started 1/rate s apart, so the arrivals are
    evenly spaced at `rate` (one hey process with -c N -q r sends its N workers' requests in bursts
    of N: their tickers tick in phase). Without: one process, one worker, `requests` back to back.
    hey's CSV has 0.1 ms resolution."""
    common_args = ["-m", "POST", "-T", "application/json", "-d", body, "-o", "csv", "-t", "30", "-cpus", "1",
                   f"{url}/v1/completions"]
    with tempfile.TemporaryDirectory(prefix="hey-") as tmp:
        procs, outs = [], []
        for i in range(streams if rate else 1):
            out = open(Path(tmp) / f"{i}.csv", "wb")  # noqa: SIM115
            outs.append(out)
            load_args = (["-z", f"{seconds}s", "-c", "1", "-q", f"{rate / streams:.6f}"] if rate
                         else ["-n", str(requests), "-c", "1"])
            procs.append(subprocess.Popen([hey, *load_args, *common_args], stdout=out, stderr=subprocess.DEVNULL,
                                          env={**os.environ, "OMP_NUM_THREADS": "1"}))
            if rate:
                time.sleep(1 / rate)
        try:
            for proc in procs:
                proc.wait(timeout=(seconds or 0) + 120)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            for out in outs:
                out.close()
        rows = []
        for i in range(len(procs)):
            for line in (Path(tmp) / f"{i}.csv").read_text().splitlines()[1:]:
                fields = line.split(",")
                if len(fields) == 8:
                    rows.append((float(fields[0]), int(fields[6]), float(fields[7])))
    return rows


def paired_added_ms(per_round: list[dict], arm: str = "router") -> list[float]:
    by_round: dict[int, dict] = {}
    for r in per_round:
        by_round.setdefault(r["round"], {})[r["path"]] = r["p50_ms"]
    return [round(r[arm] - r["direct"], 3) for _, r in sorted(by_round.items())
            if r.get(arm) is not None and r.get("direct") is not None]


def old_router_command(commit: str) -> tuple[list[str], dict[str, str]]:
    """The router of an earlier commit, for a side-by-side run: a git worktree of that commit
    (made once, outside the repository) whose iterserve/ shadows this one's on PYTHONPATH; the
    engine modules it imports (metrics names, prefix hashes) stay this checkout's."""
    repo = common.REPO
    sha = subprocess.run(["git", "rev-parse", "--short=12", commit], cwd=repo, capture_output=True, text=True,
                         check=True).stdout.strip()
    tree = Path(tempfile.gettempdir()) / f"iterserve-router-{sha}"
    if not (tree / "iterserve" / "router").is_dir():
        subprocess.run(["git", "worktree", "add", "--detach", str(tree), sha], cwd=repo, check=True,
                       capture_output=True)
    return [sys.executable, "-m", "iterserve.cli"], {"PYTHONPATH": str(tree)}


def _overhead_round(args, hey, target: str, rate: float, seconds: float, seed: int) -> tuple[list, dict, int, list]:
    """One round at the offered rate: (e2e seconds of the good requests, statuses of the others,
    requests started in time, TTFTs (Python loadgen only))."""
    statuses: dict[str, int] = {}
    if hey:
        rows = hey_run(hey, target, _hey_body(16, 4), rate=rate, seconds=seconds, streams=args.hey_streams)
        for _, status, _ in rows:
            if status != 200:
                statuses[str(status)] = statuses.get(str(status), 0) + 1
        # hey -z sends one more request after its timer fires: the rate counts those started in time.
        return [t for t, status, _ in rows if status == 200], statuses, sum(1 for *_, o in rows if o < seconds), []
    kept: list = []
    report = asyncio.run(run_load(spec(args, target, rate=rate, duration=seconds, prompt_len=16, max_tokens=4,
                                       output_dist="fixed", seed=seed, on_result=kept.append)))
    return ([r.end - r.start for r in kept if r.ok], dict(report["errors_by_status"]), len(kept),
            [r.first_token - r.start for r in kept if r.ok and r.first_token])


def _one_at_a_time(args, hey, target: str, n: int, seed: int) -> list[float]:
    if hey:
        return [t for t, status, _ in hey_run(hey, target, _hey_body(16, 4), rate=None, requests=n) if status == 200]
    kept: list = []
    asyncio.run(run_load(spec(args, target, rate=float("inf"), duration=None, requests=n, concurrency=1,
                              prompt_len=16, max_tokens=4, output_dist="fixed", seed=seed, on_result=kept.append)))
    return [r.end - r.start for r in kept if r.ok]


def scenario_overhead(args, procs: Procs) -> dict:
    """Direct, through this router and (with --old-router COMMIT) through that commit's router, in
    rounds that rotate which goes first, so every arm sees the same drift of the machine's load."""
    url = procs.engine("engine0", 0.25, 64)
    targets = {"direct": url, "router": procs.router([url])}
    pids = {"router": procs.procs[-1].pid}
    if args.old_router:
        command, env = old_router_command(args.old_router)
        targets["old_router"] = procs.router([url], command=command, env=env)
        pids["old_router"] = procs.procs[-1].pid
    arms = list(targets)
    rate = 50.0 if args.quick else 200.0
    rounds = 2 if args.quick else args.overhead_rounds
    seconds = 3.0 if args.quick else 10.0
    hey = None if args.python_loadgen else find_hey()
    e2e, ttft = {a: [] for a in arms}, {a: [] for a in arms}
    statuses, started, cpu = {a: {} for a in arms}, dict.fromkeys(arms, 0), dict.fromkeys(arms, 0.0)
    per_round = []
    for i in range(rounds):
        for arm in arms[i % len(arms):] + arms[:i % len(arms)]:
            before = _cpu_seconds(pids[arm]) if arm in pids else 0.0
            ok, errors, sent, first = _overhead_round(args, hey, targets[arm], rate, seconds, args.seed + i)
            if arm in pids:
                cpu[arm] += _cpu_seconds(pids[arm]) - before
            for status, n in errors.items():
                statuses[arm][status] = statuses[arm].get(status, 0) + n
            e2e[arm] += ok
            ttft[arm] += first
            started[arm] += sent
            per_round.append({"round": i, "path": arm, "requests": sent, "achieved_rate_per_s": sent / seconds,
                              "p50_ms": 1000 * percentiles(ok)["p50"] if ok else None,
                              "load_average_1m": os.getloadavg()[0]})
    # One request at a time: the hop itself, without the machine's queueing at the offered rate.
    one = {a: [] for a in arms}
    for i in range(rounds):
        for arm in arms[i % len(arms):] + arms[:i % len(arms)]:
            one[arm] += _one_at_a_time(args, hey, targets[arm], 50 if args.quick else 100, args.seed + i)
    out = _overhead_figures(args, hey, rate, rounds, seconds, e2e, ttft, statuses, started, cpu, per_round, one)
    if args.old_router:
        out["old_router_commit"] = _full_commit(args.old_router)
        out["old_router"]["pass"] = judge("overhead", {**out, **out["old_router"],
                                                       "achieved_rate_per_s": {
                                                           "direct": out["achieved_rate_per_s"]["direct"],
                                                           "router": out["achieved_rate_per_s"]["old_router"]}})
    out["pass"] = judge("overhead", out)
    return out


def _overhead_figures(args, hey, rate, rounds, seconds, e2e, ttft, statuses, started, cpu, per_round, one) -> dict:
    p = {k: _quantiles(v) for k, v in e2e.items()}
    sequential = {k: _quantiles(v) for k, v in one.items()}
    out = {"loadgen": ({"tool": "hey", "version": HEY_VERSION, "path": "hey", "processes": args.hey_streams,
                        "arrivals": f"evenly spaced: {args.hey_streams} one-worker hey processes at "
                                    f"{rate / args.hey_streams:g} req/s each, started {1000 / rate:g} ms apart"}
                       if hey else {"tool": "iterserve loadgen (Python, asyncio)", "arrivals": "Poisson",
                                    "why": "--python-loadgen" if args.python_loadgen else "hey not found"}),
           "request": "POST /v1/completions, stream, 16 prompt tokens, max_tokens 4 (ignore_eos)",
           "rate_per_s": rate, "rounds": rounds, "seconds_per_round": seconds,
           "requests": {k: len(v) for k, v in e2e.items()}, "errors": statuses, "e2e_s": p,
           "achieved_rate_per_s": {k: n / (rounds * seconds) for k, n in started.items()},
           "per_round": per_round, "sequential_e2e_s": sequential,
           "target": "< 2 ms added p50 (at >= 90% of the offered rate achieved)", "pass": False}
    for arm in [a for a in e2e if a != "direct"]:
        # "router" keeps the top-level keys; another arm (old_router) gets the same figures under its name.
        paired = paired_added_ms(per_round, arm)
        routed = len(e2e[arm]) + sum(statuses[arm].values())
        figures = {"added_p50_ms": (p[arm]["p50"] - p["direct"]["p50"]) * 1000,
                   "added_p90_ms": (p[arm]["p90"] - p["direct"]["p90"]) * 1000,
                   # Arm p50 - direct p50 of the back-to-back runs of each round: the round-to-round
                   # drift of the shared machine's load cancels; their spread is the noise of the figure.
                   "added_p50_ms_per_round": paired,
                   "added_p50_ms_per_round_median": statistics.median(paired) if paired else None,
                   "router_cpu_ms_per_request": 1000 * cpu[arm] / max(1, routed),
                   # What one core could relay if the router's CPU were the only limit (it is one process).
                   "router_max_rate_per_core_est": routed / cpu[arm] if cpu[arm] else None,
                   "sequential_added_p50_ms": (sequential[arm]["p50"] - sequential["direct"]["p50"]) * 1000}
        if ttft[arm]:
            figures["added_p50_ttft_ms"] = (percentiles(ttft[arm])["p50"] - percentiles(ttft["direct"])["p50"]) * 1000
        if arm == "router":
            out.update(figures)
        else:
            out[arm] = figures
    return out


def plot(results: dict, path: str) -> None:
    plt = common.pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    labels, rr, rr_hop, routed, old_routed = [], [], [], [], []
    runs = []
    for name in ("skewed", "identical"):
        if name in results:
            r = results[name]
            runs.append((f"{name}\n({r['utilization']:.0%} load)", r))
            # Extra runs of the same scenario with other output-length distributions (kept in the JSON).
            runs += [(f"{name}, {dist}\noutputs ({v['utilization']:.0%} load)", v)
                     for dist, v in (r.get("other_output_dists") or {}).items()]
    for label, r in runs:
        labels.append(label)
        rr.append(r["round_robin"]["ttft_s"]["p95"])
        rr_hop.append((r.get("round_robin_via_router") or {}).get("ttft_s", {}).get("p95") or 0)
        routed.append(r["router"]["ttft_s"]["p95"])
        old_routed.append((r.get("old_router") or {}).get("ttft_s", {}).get("p95") or 0)
    x = range(len(labels))
    bars = [(rr, "round robin (client)", "#999999"), (rr_hop, "round robin (router process)", "#cccccc"),
            (routed, "router (least load)", "#1f77b4")]
    if any(old_routed):
        bars.append((old_routed, "former router, same rounds", "#ff7f0e"))
    width = 0.8 / len(bars)
    for k, (values, label, color) in enumerate(bars):
        axes[0].bar([i + (k - (len(bars) - 1) / 2) * width for i in x], values, width, label=label, color=color)
    axes[0].set_xticks(list(x), labels)
    axes[0].set_ylabel("p95 TTFT (s)")
    axes[0].set_title("p95 time to first token")
    axes[0].set_ylim(0, 1.4 * max([*rr, *rr_hop, *routed, *old_routed, 0.001]))  # room for the legend
    axes[0].legend(fontsize=8, loc="upper left")
    lines = []
    for name in ("metrics_500", "saturated", "kill", "overhead"):
        r = results.get(name)
        if r is None:
            continue
        figure = {"metrics_500": lambda r: f"client 5xx: {r['client_5xx']}",
                  "saturated": lambda r: f"statuses: {r['statuses']}",
                  "kill": lambda r: f"failed {r['failed_fraction']:.2%}, ejected after "
                                    f"{r['ejected_after_s'] if r['ejected_after_s'] is None else round(r['ejected_after_s'], 2)} s",
                  "overhead": lambda r: f"added p50 {r['added_p50_ms']:.2f} ms at {r['rate_per_s']:.0f} req/s "
                                        f"({r['achieved_rate_per_s']['router']:.0f} achieved, "
                                        f"{(r.get('loadgen') or {}).get('tool', 'loadgen').split(' ')[0]})"}
        old = r.get("old_router")
        lines.append(f"{name}: {figure[name](r)} [{'pass' if r['pass'] else 'FAIL'}]" + (
            "" if old is None else
            f"\n  former router: {(figure[name] if name != 'overhead' else _old_overhead)(old)} "
            f"[{'pass' if old['pass'] else 'FAIL'}]"))
    axes[1].axis("off")
    axes[1].text(0, 0.9, "\n\n".join(lines), va="top", fontsize=9, family="monospace", wrap=True)
    common.save_figure(fig, path)


def _old_overhead(old: dict) -> str:
    return f"added p50 {old['added_p50_ms']:.2f} ms"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common.add_common_args(parser)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"comma-separated, of {', '.join(SCENARIOS)}")
    parser.add_argument("--duration", type=float,
                        help="seconds of load per run (default 90; quick: 20); skewed and identical: per policy, "
                             "split into alternating rounds")
    parser.add_argument("--scale", type=float, default=8.0,
                        help="--fake-step-time-scale of the fast replicas (default 8: ~26 ms steps at 4 sequences)")
    parser.add_argument("--max-num-seqs", type=int, default=4, help="each replica's batch cap (default 4)")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32, help="output tokens per request (default 32)")
    parser.add_argument("--output-dist", default="fixed", choices=("fixed", "zipf", "exponential"),
                        help="output lengths as `iterserve loadgen` draws them (default fixed: --max-tokens each; "
                             "the overhead scenario always uses 4)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="skewed, identical: alternating rounds per policy, --duration split over them "
                             "(default 3; quick: 2)")
    parser.add_argument("--overhead-rounds", type=int, default=6,
                        help="overhead: alternating direct/router rounds of 10 s each (default 6; quick: 2)")
    parser.add_argument("--hey-streams", type=int, default=20,
                        help="overhead: one-worker hey processes sharing the rate, evenly staggered (default 20)")
    parser.add_argument("--old-router", metavar="COMMIT",
                        help="also run the router of this commit (from a git worktree) beside this one in every "
                             "scenario; its figures under old_router")
    parser.add_argument("--python-loadgen", action="store_true",
                        help="overhead: use iterserve's Python loadgen even when hey is installed")
    args = parser.parse_args(argv)
    args.duration = args.duration or (20.0 if args.quick else 90.0)
    wanted = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = set(wanted) - set(SCENARIOS)
    if unknown:
        parser.error(f"unknown scenario(s) {', '.join(sorted(unknown))}")
    info = {"started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "load_average_at_start": list(os.getloadavg()),
            "cpus": os.cpu_count(), "cpu_model": cpu_model()}
    results: dict = {}
    with tempfile.TemporaryDirectory(prefix="routing-bench-") as tmp:
        for name in wanted:
            logdir = Path(tmp) / name
            logdir.mkdir()
            procs = Procs(logdir)
            started = time.monotonic()
            try:
                results[name] = globals()[f"scenario_{name}"](args, procs)
            finally:
                procs.close()
            results[name]["wall_s"] = time.monotonic() - started
            print(f"{name}: {_summary(name, results[name])}", flush=True)
    info["load_average_at_end"] = list(os.getloadavg())
    run = common.run_record()
    for r in results.values():
        # Each scenario keeps the commit, CPU and command it was measured with: a partial run
        # rewrites the top-level record but keeps the other scenarios' figures.
        r["measured"] = {"started": info["started"], "load_average": [info["load_average_at_start"],
                                                                      info["load_average_at_end"]], "run": run}
    if args.json and Path(args.json).exists() and set(wanted) != set(SCENARIOS):
        # A run of some scenarios keeps the others' last figures (each says when it was measured).
        earlier = json.loads(Path(args.json).read_text())
        for name, r in (earlier.get("results") or {}).items():
            if name not in results:
                r.setdefault("measured", {"started": earlier.get("machine", {}).get("started"),
                                          "load_average": [earlier.get("machine", {}).get("load_average_at_start"),
                                                           earlier.get("machine", {}).get("load_average_at_end")]})
                results[name] = r
        results = {name: results[name] for name in SCENARIOS if name in results}
    rows = [[name, r["target"], _summary(name, r), "pass" if r["pass"] else "FAIL"] for name, r in results.items()]
    print()
    print(common.format_table(["scenario", "target", "measured", "result"], rows))
    common.write_json(args.json, {"machine": info, "args": {k: v for k, v in vars(args).items() if k not in ("json", "plot")},
                                  "results": results})
    if args.plot:
        plot(results, args.plot)
    return 0


def _summary(name: str, r: dict) -> str:
    text = _summary_one(name, r)
    old = r.get("old_router")
    if old is None or name == "overhead":  # the overhead's line names the old router itself
        return text
    if name in ("skewed", "identical"):
        figure = (f"p95 TTFT {old['ttft_s']['p95']:.3f} s = {old['p95_ttft_ratio']:.2f}x "
                  f"({old['p95_ttft_ratio_same_hop']:.2f}x against the same-hop round robin)")
    else:
        figure = _summary_one(name, old)
    return f"{text}; old router ({r.get('old_router_commit', '?')[:10]}): {figure} [{'pass' if old['pass'] else 'FAIL'}]"


def _summary_one(name: str, r: dict) -> str:
    if name in ("skewed", "identical"):
        same_hop = ("" if "round_robin_via_router" not in r else  # older runs had no third arm
                    f" (round robin through the same router process: "
                    f"{r['round_robin_via_router']['ttft_s']['p95']:.3f} s, {r['p95_ttft_ratio_same_hop']:.2f}x)")
        return (f"p95 TTFT round robin {r['round_robin']['ttft_s']['p95']:.3f} s / router "
                f"{r['router']['ttft_s']['p95']:.3f} s = {r['p95_ttft_ratio']:.2f}x at {r['rate_per_s']:.1f} req/s"
                + same_hop)
    if name == "metrics_500":
        return f"client 5xx {r['client_5xx']} of {r['load']['requests']}, failed {r['load']['requests'] - r['load']['completed']}"
    if name == "saturated":
        return f"statuses {r['statuses']} at {r['rate_per_s']:.1f} req/s offered"
    if name == "kill":
        ej = r["ejected_after_s"]
        return (f"failed {r['failed_fraction']:.2%} of {r['load']['requests']}, ejected after "
                f"{'never' if ej is None else f'{ej:.2f} s'}, retries {r['retries']}")
    achieved = r["achieved_rate_per_s"]
    tool = (r.get("loadgen") or {}).get("tool", "iterserve loadgen").split(" ")[0]
    extra = f", TTFT {r['added_p50_ttft_ms']:.2f} ms" if "added_p50_ttft_ms" in r else ""
    p90 = f", p90 {r['added_p90_ms']:.2f} ms" if "added_p90_ms" in r else ""
    per_round = r.get("added_p50_ms_per_round_median")
    per_round = "" if per_round is None else f" (median of per-round pairs {per_round:.2f} ms)"
    old = r.get("old_router")
    old = "" if old is None else (
        f"; old router ({r.get('old_router_commit', '?')[:10]}, same rounds): added p50 {old['added_p50_ms']:.2f} ms, "
        f"one at a time {old['sequential_added_p50_ms']:.2f} ms, CPU {old['router_cpu_ms_per_request']:.2f} ms/request")
    return (f"added e2e p50 {r['added_p50_ms']:.2f} ms{per_round}{p90}{extra} at "
            f"{r['rate_per_s']:.0f} req/s offered by {tool} ({achieved['direct']:.0f} direct / {achieved['router']:.0f} "
            f"routed achieved); one at a time {r.get('sequential_added_p50_ms', float('nan')):.2f} ms; router CPU "
            f"{r['router_cpu_ms_per_request']:.2f} ms/request (~{r.get('router_max_rate_per_core_est') or 0:.0f} "
            f"req/s per core){old}")


if __name__ == "__main__":
    sys.exit(main())
