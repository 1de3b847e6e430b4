"""Records a step log from a real `iterserve serve --fake-model` server under HTTP load (the whole
loop's engine, the whole loop's requests), for `iterserve simulate fit --timing interval`: the
fake model's modelled step plus what the server really spends per step around it.

    .venv/bin/python -m bench.simulator.fake_server --step-log fake_steps.jsonl [--rate 8 --seconds 20]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time

import httpx

from iterserve.devcluster.waiting import free_port, wait_for
from iterserve.engine.loadgen import LoadSpec, run_load


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--step-log", required=True)
    parser.add_argument("--rate", type=float, default=8.0)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--kv-cache-memory", default="29MiB")
    args = parser.parse_args()
    if os.path.exists(args.step_log):
        os.remove(args.step_log)
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "iterserve.cli", "serve", "--fake-model", "--port", str(port),
                               "--max-num-seqs", str(args.max_num_seqs), "--kv-cache-memory", args.kv_cache_memory,
                               "--max-model-len", "512", "--max-waiting-requests", "1000", "--step-log", args.step_log,
                               "--log-level", "warning"])
    try:
        url = f"http://127.0.0.1:{port}"
        def ready() -> bool:
            try:
                return httpx.get(f"{url}/ready").status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(ready, timeout=60, what="the fake server")
        started = time.perf_counter()
        report = asyncio.run(run_load(LoadSpec(url=url, rate=args.rate, requests=None, duration=args.seconds,
                                               prompt_len=32, max_tokens=128, seed=0)))
        print({k: report[k] for k in ("completed", "failed") if k in report},
              f"{time.perf_counter() - started:.1f} s, load average {os.getloadavg()}")
    finally:
        server.terminate()
        server.wait(timeout=30)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
