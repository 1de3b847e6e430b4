"""What moving a prompt's KV between engines costs here, per token, against computing it.

The real code paths, without HTTP: a prefill-side KVConnector leases blocks of a SmolLM2-135M-shaped
KV pool (30 layers, 3 KV heads x 64, 16-token blocks; fp32 and bf16), the TCP transport pulls them
over loopback (handshake, framed and CRC-checked layers, release), and the model runner's load
copies them into a second pool. Printed and written: seconds and bytes per pull, microseconds and
bytes per token, MB/s; with --prefill, the embedded model's prefill time per token for the same
prompt lengths (one torch thread), which is what a pull replaces on the decode engine.

    python -m bench.cluster.kv_transfer --json docs/perf/kv_transfer.json            # full
    python -m bench.cluster.kv_transfer --quick                                      # CI smoke (seconds)
"""

from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace

import torch

from bench.common import (
    add_common_args,
    finish_machine,
    format_table,
    machine,
    pyplot,
    save_figure,
    set_threads,
    write_json,
)
from iterserve.engine.block_manager import BlockManager
from iterserve.engine.config import EngineConfig
from iterserve.engine.kv_transfer.connector import KVConnector
from iterserve.engine.kv_transfer.layout import KVLayout
from iterserve.engine.kv_transfer.transport import PullRequest, TcpTransport
from iterserve.engine.model_runner import ModelRunner
from iterserve.engine.sampling_params import SamplingParams
from iterserve.engine.scheduler import KVLoad
from iterserve.engine.sequence import Sequence

LAYERS, KV_HEADS, HEAD_SIZE, BLOCK = 30, 3, 64, 16
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def pool(num_blocks: int, dtype: torch.dtype, fill: bool) -> SimpleNamespace:
    shape = (num_blocks, BLOCK, KV_HEADS, HEAD_SIZE)
    make = (lambda: torch.randn(shape).to(dtype)) if fill else (lambda: torch.zeros(shape, dtype=dtype))
    return SimpleNamespace(kv_caches=[(make(), make()) for _ in range(LAYERS)], device=torch.device("cpu"),
                           dtype=dtype)


def measure(num_tokens: int, dtype_name: str, repeats: int) -> dict:
    dtype = DTYPES[dtype_name]
    num_blocks = -(-num_tokens // BLOCK)
    layout = KVLayout(model="smollm2-135m/none", dtype=dtype_name, num_layers=LAYERS, num_kv_heads=KV_HEADS,
                      head_size=HEAD_SIZE, block_size=BLOCK, itemsize=dtype.itemsize)
    source, target = pool(num_blocks, dtype, True), pool(num_blocks, dtype, False)
    manager = BlockManager(num_blocks, BLOCK)
    config = EngineConfig(model="fake", kv_max_leased_fraction=1.0)  # each lease holds the whole pool
    connector = KVConnector(config, manager, layout, lambda ids: ModelRunner.read_kv(source, ids))
    port = connector.listen("127.0.0.1", 0)
    client = TcpTransport()
    pulls, loads, sizes = [], [], []
    try:
        for _ in range(repeats):
            seq = Sequence("r", list(range(num_tokens)), SamplingParams(), 0.0)
            manager.allocate(seq, num_tokens)
            params = connector.pin(seq)
            manager.free(seq)
            request = PullRequest("127.0.0.1", port, params["transfer_id"], params["lease_secret"], 0, num_blocks,
                                  time.monotonic() + 60)
            pulled = client.pull(request, layout, "bench")
            started = time.perf_counter()
            ModelRunner._load_kv(target, [KVLoad(seq, list(range(num_blocks)), pulled.layers)])
            loads.append(time.perf_counter() - started)
            pulls.append(pulled.seconds)
            sizes.append(pulled.num_bytes)
            while connector.num_leases:
                connector.collect()
                time.sleep(0.001)
        for (sk, sv), (tk, tv) in zip(source.kv_caches, target.kv_caches, strict=True):
            assert torch.equal(sk, tk) and torch.equal(sv, tv), "the pulled KV differs from the source"
    finally:
        connector.close()
    seconds = statistics.median(p + load for p, load in zip(pulls, loads, strict=True))
    return {"tokens": num_tokens, "dtype": dtype_name, "repeats": repeats, "bytes": sizes[0],
            "bytes_per_token": sizes[0] / num_tokens, "pull_s_p50": statistics.median(pulls),
            "load_s_p50": statistics.median(loads), "total_s_p50": seconds,
            "us_per_token": seconds / num_tokens * 1e6, "mb_per_s": sizes[0] / seconds / 1e6}


def prefill_cost(lengths: list[int]) -> dict[int, float]:
    """Seconds per prompt token the embedded model takes to prefill (the faster of 2, after a warm-up)."""
    from iterserve.engine.llm import LLM

    llm = LLM(max_model_len=max(lengths) + 16, enable_prefix_caching=False, device="cpu")
    once = SamplingParams(temperature=0, max_tokens=1)
    llm.generate([{"prompt_token_ids": list(range(100, 164))}], once, use_tqdm=False)
    out = {}
    for n in lengths:
        ids = [(i * 37) % 20000 + 100 for i in range(n)]
        times = []
        for _ in range(2):
            started = time.perf_counter()
            llm.generate([{"prompt_token_ids": ids}], once, use_tqdm=False)
            times.append(time.perf_counter() - started)
        out[n] = min(times) / n
        print(f"prefill {n} tokens: {out[n] * 1e6:.0f} us/token", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    parser.add_argument("--lengths", default=None, help="prompt lengths in tokens (default 128,512,2048; quick: 128,512)")
    parser.add_argument("--repeats", type=int, default=None, help="pulls per case (default 7; quick: 3)")
    parser.add_argument("--prefill", action=argparse.BooleanOptionalAction, default=None,
                        help="also time the embedded model's prefill per token (default: on, off with --quick)")
    args = parser.parse_args()
    set_threads(args.threads)
    lengths = [int(x) for x in (args.lengths or ("128,512" if args.quick else "128,512,2048")).split(",")]
    repeats = args.repeats or (3 if args.quick else 7)
    info = machine(args.threads)
    rows = []
    for dtype in DTYPES:
        for n in lengths:
            rows.append(measure(n, dtype, repeats))
            print(f"{dtype} {n} tokens: {rows[-1]['us_per_token']:.0f} us/token", flush=True)
    with_prefill = args.prefill if args.prefill is not None else not args.quick
    compute = prefill_cost(lengths) if with_prefill else {}
    for row in rows:
        per_token = compute.get(row["tokens"])
        row["prefill_us_per_token"] = per_token * 1e6 if per_token else None
        row["transfer_over_prefill"] = row["us_per_token"] / (per_token * 1e6) if per_token else None
    print(format_table(["dtype", "tokens", "bytes/token", "pull p50 s", "load p50 s", "us/token", "MB/s",
                        "prefill us/token", "transfer/prefill"],
                       [[r["dtype"], r["tokens"], r["bytes_per_token"], r["pull_s_p50"], r["load_s_p50"],
                         r["us_per_token"], r["mb_per_s"], r["prefill_us_per_token"], r["transfer_over_prefill"]]
                        for r in rows]))
    print(f"load average {info['load_average_at_start']} on {info['cpus']} CPUs ({info['cpu_model']})")
    write_json(args.json, {"machine": finish_machine(info), "quick": args.quick, "results": rows})
    if args.plot:
        plot(rows, args.plot, info)


def plot(rows: list[dict], path: str, info: dict) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for dtype in DTYPES:
        mine = [r for r in rows if r["dtype"] == dtype]
        ax.plot([r["tokens"] for r in mine], [r["us_per_token"] for r in mine], marker="o",
                label=f"KV pull + load, {dtype}")
    computed = [r for r in rows if r["dtype"] == "float32" and r["prefill_us_per_token"]]
    if computed:
        ax.plot([r["tokens"] for r in computed], [r["prefill_us_per_token"] for r in computed], marker="s",
                label="prefill compute (fp32 model)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("microseconds per prompt token")
    ax.set_title(f"SmolLM2-135M KV over loopback TCP (load {info['load_average_at_start'][0]:.0f} on "
                 f"{info['cpus']} CPUs)")
    ax.legend()
    save_figure(fig, path)


if __name__ == "__main__":
    main()
