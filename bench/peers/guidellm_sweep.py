"""guidellm (the benchmarking client vLLM's project publishes, installed from PyPI into its own
environment by tests/client_venv.py) sweeps `iterserve serve`, and `iterserve loadgen` replays the
same load, so the two clients' figures sit side by side.

guidellm's sweep runs a synchronous pass (one request at a time), a throughput pass (all at once)
and constant rates spread between the two; each pass sends 64-token synthetic prompts for exactly
32 output tokens (ignore_eos), streamed. Then `iterserve loadgen` sends the same prompt and output
lengths one at a time, all at once, and at each constant rate guidellm chose (Poisson arrivals).
Reported per pass: requests/s, output tokens/s, TTFT p50/p95 and ITL p50 from each client.

    python -m bench.peers.guidellm_sweep --json docs/perf/guidellm_sweep.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx

from bench import common
from iterserve.engine.loadgen import LoadSpec, run_load
from tests.client_venv import client_python, save_hf_tokenizer
from tests.server_fixture import running_server

PROMPT_TOKENS, OUTPUT_TOKENS = 64, 32


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    common.add_common_args(parser)
    parser.add_argument("--fake-model", action="store_true", help="serve the weightless fake model")
    parser.add_argument("--requests", type=int, help="requests per pass (default 40; quick: 12)")
    parser.add_argument("--seconds", type=float, help="cap per pass in seconds (default 60; quick: 20)")
    parser.add_argument("--sweep-size", type=int, help="guidellm passes (default 5; quick: 3)")
    args = parser.parse_args(argv)
    requests = args.requests or (12 if args.quick else 40)
    seconds = args.seconds or (20 if args.quick else 60)
    sweep_size = args.sweep_size or (3 if args.quick else 5)
    common.set_threads(args.threads)
    info = common.machine(args.threads)
    python = client_python()
    work = Path(tempfile.mkdtemp(prefix="guidellm-"))
    tokenizer = save_hf_tokenizer(python, work / "tokenizer")
    serve = ["--fake-model"] if args.fake_model else ["--device", "cpu"]
    serve += ["--max-model-len", "512", "--max-num-seqs", "16"]
    with running_server(serve, log_path=work / "server.log", env={"OMP_NUM_THREADS": str(args.threads)},
                        ready_timeout=600) as server:
        model = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
        command = [str(python.parent / "guidellm"), "run",
                   "--backend", f"kind=openai_http,target={server.url},model={model}",
                   "--profile", f"kind=sweep,sweep_size={sweep_size}",
                   "--constraint", f"kind=max_duration,seconds={seconds:g}",
                   "--constraint", f"kind=max_requests,count={requests}",
                   "--data", f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},output_tokens={OUTPUT_TOKENS}",
                   "--tokenizer", f"kind=huggingface_auto,model={tokenizer}",
                   "--output", f"kind=json,path={work / 'guidellm.json'}",
                   "--disable-console-interactive"]
        print("running:", " ".join(command), flush=True)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        run = subprocess.run(command, env=env, capture_output=True, text=True)
        if run.returncode != 0:
            sys.stderr.write(run.stdout[-3000:] + run.stderr[-3000:])
            raise SystemExit(f"guidellm failed (exit {run.returncode}); work folder {work}")
        passes = [_guidellm_pass(b) for b in json.loads((work / "guidellm.json").read_text())["benchmarks"]]
        for item in passes:
            constant = item["strategy"] not in ("synchronous", "throughput")
            spec = LoadSpec(url=server.url, requests=requests, duration=seconds, prompt_len=PROMPT_TOKENS,
                            max_tokens=OUTPUT_TOKENS, seed=args.seed,
                            concurrency=1 if item["strategy"] == "synchronous" else None,
                            rate=item["rate"] if constant else float("inf"))
            item["loadgen"] = _loadgen_pass(asyncio.run(run_load(spec)))
            print(f"{item['label']}: guidellm {item['guidellm']}, loadgen {item['loadgen']}", flush=True)
    rows = []
    for item in passes:
        g, lg = item["guidellm"], item["loadgen"]
        rows.append([item["label"], g["requests_per_s"], lg["requests_per_s"], g["output_tokens_per_s"],
                     lg["output_tokens_per_s"], g["ttft_p50_ms"], lg["ttft_p50_ms"], g["ttft_p95_ms"],
                     lg["ttft_p95_ms"], g["itl_p50_ms"], lg["itl_p50_ms"]])
    print(common.format_table(["pass", "req/s guidellm", "loadgen", "out tok/s guidellm", "loadgen",
                               "TTFT p50 ms guidellm", "loadgen", "TTFT p95 ms guidellm", "loadgen",
                               "ITL p50 ms guidellm", "loadgen"], rows))
    if args.json:
        payload = {"model": model, "prompt_tokens": PROMPT_TOKENS, "output_tokens": OUTPUT_TOKENS,
                   "requests_per_pass": requests, "seconds_per_pass": seconds, "passes": passes,
                   "machine": common.finish_machine(info)}
        Path(args.json).write_text(json.dumps(payload, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


def _guidellm_pass(benchmark: dict) -> dict:
    strategy = benchmark["config"]["strategy"]
    kind, rate = strategy.get("type_"), strategy.get("rate")
    metrics = benchmark["metrics"]

    def stat(name: str, key: str) -> float | None:
        value = metrics[name]["successful"]
        return value["percentiles"].get(key) if key.startswith("p") else value.get(key)

    return {"strategy": kind, "rate": rate, "label": kind if rate is None else f"{kind}@{rate:.2f}",
            "guidellm": {"completed": metrics["request_totals"]["successful"],
                         "errored": metrics["request_totals"]["errored"],
                         "requests_per_s": stat("requests_per_second", "mean"),
                         "output_tokens_per_s": stat("output_tokens_per_second", "mean"),
                         "ttft_p50_ms": stat("time_to_first_token_ms", "p50"),
                         "ttft_p95_ms": stat("time_to_first_token_ms", "p95"),
                         "itl_p50_ms": stat("inter_token_latency_ms", "p50")}}


def _loadgen_pass(report: dict) -> dict:
    return {"completed": report["completed"], "errored": report["failed"],
            "requests_per_s": report["request_throughput_per_s"],
            "output_tokens_per_s": report["output_throughput_tokens_per_s"],
            "ttft_p50_ms": 1000 * report["ttft_s"]["p50"], "ttft_p95_ms": 1000 * report["ttft_s"]["p95"],
            "itl_p50_ms": 1000 * report["itl_s"]["p50"]}


if __name__ == "__main__":
    sys.exit(main())
