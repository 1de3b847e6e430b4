"""The load users measure servers with: vLLM's own client, `vllm bench serve`, against each server
at its defaults, one after the other in one run. Not run in CI.

    random dataset, 256 tokens in, 128 out (EOS ignored), 64 prompts, 2 requests/s Poisson, seed 7

The client is the `vllm` command of the venv `python -m bench.peers.compare --install-vllm` builds;
it sends /v1/completions to each server in turn and saves its own result JSON, which this script
collects (output tokens/s, TTFT and TPOT percentiles) with the machine and the load average.

Servers, each with its defaults but for the port:
  iterserve   `iterserve serve` (the embedded SmolLM2 GGUF; `--quantization auto`, KV sized from memory)
  vllm        `vllm serve` of the same weights dequantized to fp32 (vLLM's CPU backend has no GGUF
              kernels), both cores, VLLM_CPU_KVCACHE_SPACE=2 (GiB)

    python -m bench.peers.vllm_bench_serve --json docs/perf/vllm_bench_serve.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import common
from bench.peers.compare import (
    VLLM_VENV,
    Server,
    free_port,
    gguf_path,
    machine_info,
    vllm_model_dir,
)

SERVED_NAME = "smollm2-135m"
LOAD = {"dataset": "random", "input_len": 256, "output_len": 128, "num_prompts": 64, "request_rate": 2.0,
        "arrivals": "poisson", "seed": 7, "ignore_eos": True}
# What the table and the JSON keep of the client's result file.
KEPT = ("completed", "failed", "duration", "output_throughput", "request_throughput", "total_output_tokens",
        "mean_ttft_ms", "median_ttft_ms", "p95_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms",
        "p99_tpot_ms", "median_itl_ms", "p99_itl_ms", "median_e2el_ms", "p99_e2el_ms")


def server(system: str, tmp: Path, threads: int, extra: list[str]) -> tuple[Server, dict]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    log = tmp / f"{system}.log"
    if system.split("@")[0] == "iterserve":
        command = [str(Path(sys.executable).parent / "iterserve"), "serve", "--host", "127.0.0.1",
                   "--port", str(port), "--served-model-name", SERVED_NAME, *extra]
        return Server(system, command, port, log, env, ready_path="/ready"), {"command": command[1:]}
    if system == "vllm":
        env.update({"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
                    "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "VLLM_TARGET_DEVICE": "cpu"})
        command = [str(VLLM_VENV / "bin" / "vllm"), "serve", str(vllm_model_dir(gguf_path())),
                   "--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(port),
                   "--dtype", "float32"]
        return Server(system, command, port, log, env), {
            "command": command[1:], "env": {k: env[k] for k in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND")}}
    raise SystemExit(f"unknown system {system!r}: iterserve or vllm")


def client_command(url: str, result_dir: Path, name: str) -> list[str]:
    return [str(VLLM_VENV / "bin" / "vllm"), "bench", "serve", "--backend", "vllm", "--base-url", url,
            "--endpoint", "/v1/completions", "--model", SERVED_NAME, "--tokenizer", str(vllm_model_dir(gguf_path())),
            "--dataset-name", "random", "--random-input-len", str(LOAD["input_len"]),
            "--random-output-len", str(LOAD["output_len"]), "--num-prompts", str(LOAD["num_prompts"]),
            "--request-rate", str(LOAD["request_rate"]), "--seed", str(LOAD["seed"]), "--ignore-eos",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,95,99",
            "--save-result", "--result-dir", str(result_dir), "--result-filename", f"{name}.json"]


def run_client(url: str, tmp: Path, name: str) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_TARGET_DEVICE": "cpu", "VLLM_NO_USAGE_STATS": "1"}
    done = subprocess.run(client_command(url, tmp, name), env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"vllm bench serve exited {done.returncode}: {(done.stdout + done.stderr)[-1500:]}")
    result = json.loads((tmp / f"{name}.json").read_text())
    return {k: result.get(k) for k in KEPT}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--systems", default="iterserve,vllm", help="run order (default %(default)s)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="vLLM's bound cores")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=ARGS",
                        help="an iterserve variant for --systems: iterserve@NAME runs `iterserve serve ARGS` "
                             "(e.g. --variant 'b2k=--max-num-batched-tokens 2048'); repeatable")
    parser.add_argument("--num-prompts", type=int, default=LOAD["num_prompts"],
                        help="default %(default)s; fewer only for a smoke run")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON to PATH")
    args = parser.parse_args(argv)
    LOAD["num_prompts"] = args.num_prompts
    args.variant = {f"iterserve@{name}": value.split() for name, _, value in (v.partition("=") for v in args.variant)}
    if not (VLLM_VENV / "bin" / "vllm").exists():
        raise SystemExit(f"{VLLM_VENV / 'bin' / 'vllm'} not found: run `python -m bench.peers.compare --install-vllm`")
    info, results = machine_info(), {}
    with tempfile.TemporaryDirectory(prefix="iterserve-vllm-bench-") as tmp_name:
        tmp = Path(tmp_name)
        for system in args.systems.split(","):
            print(f"{system} ...", file=sys.stderr, flush=True)
            srv, entry = server(system, tmp, args.threads, args.variant.get(system, []))
            try:
                with srv:
                    entry["startup_s"] = srv.startup_s
                    entry["load_average_1m"] = [os.getloadavg()[0]]
                    entry["result"] = run_client(srv.url, tmp, system)
                    entry["load_average_1m"].append(os.getloadavg()[0])
            except (RuntimeError, OSError, subprocess.SubprocessError) as error:
                entry["error"] = str(error)[-1500:]
            results[system] = entry
            print(f"  {system}: {json.dumps(entry.get('result') or entry.get('error'))[:400]}", file=sys.stderr,
                  flush=True)
    info["load_average_at_end"] = list(os.getloadavg())
    info["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    report = {"benchmark": "vllm_bench_serve", "load": LOAD, "machine": info, "systems": results}
    common.write_json(args.json, report)
    rows = [[s, *((e.get("result") or {}).get(k) for k in ("output_throughput", "median_ttft_ms", "p99_ttft_ms",
                                                           "median_tpot_ms", "failed"))]
            for s, e in results.items()]
    print(common.format_table(["server", "output tok/s", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms", "failed"],
                              rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
