"""Online latency: `iterserve loadgen` (its Python API) against `iterserve serve`, Poisson arrivals
at several rates, continuous vs static batching: throughput, TTFT and ITL (p50/p95/p99) per rate,
i.e. the throughput/latency curve.

Each mode gets a fresh server (same model, dtype, threads, batch cap) on a loopback port; every
rate replays the same seeded requests (prompt tokens, Zipf output lengths, EOS ignored).

    python -m bench.engine.online_latency --json docs/perf/online_latency.json --plot docs/perf/online_latency.png
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench import common
from iterserve.engine.loadgen import LoadSpec, run_load

MODES = ("continuous", "static")


def configure(parser: argparse.ArgumentParser) -> None:
    common.add_common_args(parser)
    parser.add_argument("--rates", help="requests per second (default 0.25,0.5,1,2; quick: 1,4)")
    parser.add_argument("--requests", type=int, help="requests per rate (default 20; quick: 4)")
    parser.add_argument("--prompt-len", type=int, help="prompt tokens (default 64; quick: 16)")
    parser.add_argument("--max-tokens", type=int, help="Zipf output length cap (default 128; quick: 8)")
    parser.add_argument("--batch-cap", type=int, default=16, help="--max-num-seqs of both servers (default 16)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    configure(parser)
    args = parser.parse_args(argv)
    rates = [float(r) for r in (args.rates or ("1,4" if args.quick else "0.25,0.5,1,2")).split(",")]
    requests = args.requests or (4 if args.quick else 20)
    prompt_len = args.prompt_len or (16 if args.quick else 64)
    max_tokens = args.max_tokens or (8 if args.quick else 128)
    common.set_threads(args.threads)
    machine = common.machine(args.threads)

    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="iterserve-bench-") as tmp:
        for mode in MODES:
            with Server(["--scheduling", mode, "--max-num-seqs", str(args.batch_cap), "--device", "cpu",
                         "--dtype", "float32", "--attention-backend", "torch", "--max-model-len", "1024"],
                        Path(tmp) / f"{mode}.log") as server:
                asyncio.run(run_load(LoadSpec(url=server.url, requests=2, max_tokens=4, prompt_len=8)))
                results[mode] = {}
                for rate in rates:
                    print(f"{mode}: {rate:g} req/s ...", file=sys.stderr, flush=True)
                    spec = LoadSpec(url=server.url, rate=rate, requests=requests, output_dist="zipf",
                                    prompt_len=prompt_len, max_tokens=max_tokens, seed=args.seed)
                    report = asyncio.run(run_load(spec))
                    if report["failed"]:
                        raise SystemExit(f"{report['failed']} requests failed at {rate} req/s ({mode}): "
                                         f"{report['errors_by_status']}")
                    results[mode][f"{rate:g}"] = {key: report[key] for key in (
                        "completed", "duration_s", "request_throughput_per_s", "output_throughput_tokens_per_s",
                        "total_output_tokens", "ttft_s", "itl_s", "e2e_s")}
    report = {
        "benchmark": "online_latency",
        "workload": {"rates": rates, "requests_per_rate": requests, "prompt_len": prompt_len,
                     "output_dist": "zipf", "max_tokens": max_tokens, "batch_cap": args.batch_cap,
                     "ignore_eos": True},
        "machine": common.finish_machine(machine),
        "modes": results,
    }
    print(_table(report))
    common.write_json(args.json, report)
    if args.plot:
        _plot(report, args.plot)
    return 0


class Server:
    """`iterserve serve` on a free loopback port, stopped with SIGTERM (it drains, then exits)."""

    def __init__(self, args: list[str], log_path: Path, timeout: float = 300.0):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self.timeout = timeout
        script = Path(sys.executable).parent / "iterserve"
        command = [str(script)] if script.exists() else [sys.executable, "-m", "iterserve.cli"]
        self.command = [*command, "serve", "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning",
                        *args]

    def __enter__(self) -> Server:
        self._log = open(self.log_path, "wb")  # noqa: SIM115
        # Not from the repository root: its folder operator/ must not shadow the stdlib module.
        self.proc = subprocess.Popen(self.command, cwd=self.log_path.parent, env=dict(os.environ),
                                     stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"iterserve serve exited with {self.proc.returncode}: {self._tail()}")
            try:
                if httpx.get(f"{self.url}/ready", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.__exit__()
        raise SystemExit(f"iterserve serve not ready within {self.timeout:.0f} s: {self._tail()}")

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()

    def _tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-2000:]


def _table(report: dict) -> str:
    rows = []
    for mode, by_rate in report["modes"].items():
        for rate, r in by_rate.items():
            rows.append([mode, rate, r["request_throughput_per_s"], r["output_throughput_tokens_per_s"],
                         *(r["ttft_s"][p] * 1e3 for p in ("p50", "p95", "p99")),
                         *(r["itl_s"][p] * 1e3 if r["itl_s"][p] is not None else None for p in ("p50", "p95", "p99"))])
    return common.format_table(["mode", "rate req/s", "done req/s", "out tok/s", "TTFT p50 ms", "p95", "p99",
                                "ITL p50 ms", "p95", "p99"], rows)


def _plot(report: dict, path: str) -> None:
    plt = common.pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.4))
    for (mode, by_rate), color in zip(report["modes"].items(), ("tab:green", "tab:gray"), strict=False):
        rows = list(by_rate.values())
        throughput = [r["output_throughput_tokens_per_s"] for r in rows]
        left.plot(throughput, [r["ttft_s"]["p95"] for r in rows], "o-", color=color, label=f"{mode} TTFT p95")
        left.plot(throughput, [r["ttft_s"]["p50"] for r in rows], "o:", color=color, label=f"{mode} TTFT p50")
        right.plot([float(k) for k in by_rate], throughput, "o-", color=color, label=mode)
    left.set_xlabel("achieved output tokens / s")
    left.set_ylabel("TTFT (s)")
    left.set_yscale("log")
    left.legend(fontsize=7)
    right.set_xlabel("offered load (requests / s, Poisson)")
    right.set_ylabel("achieved output tokens / s")
    right.legend(fontsize=7)
    w = report["workload"]
    fig.suptitle(f"iterserve serve + loadgen: prompt {w['prompt_len']} tokens, Zipf outputs <= {w['max_tokens']}, "
                 f"batch cap {w['batch_cap']}", fontsize=9)
    common.save_figure(fig, path)


if __name__ == "__main__":
    sys.exit(main())
