"""What the benchmark scripts share: the workloads, the machine description, threads, tables,
JSON and plots.

bench/ is a package grouped by what is measured (engine, kernels, peers, routing, cluster,
simulator); each script imports `from bench import common` and runs from the repository root as a
module: `python -m bench.engine.throughput --quick`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from iterserve.engine.loadgen import PROMPT_TOKEN_RANGE, LoadSpec, output_lengths
from iterserve.machine import cpu_model

PROMPT_LEN_RANGE = (20, 120)
MAX_OUTPUT_TOKENS = 256


@dataclass(frozen=True)
class Request:
    prompt_token_ids: list[int]
    output_len: int  # exact: every system generates this many tokens (EOS is ignored)


def zipf_workload(num_requests: int, seed: int = 0, prompt_len: tuple[int, int] = PROMPT_LEN_RANGE,
                  max_output: int = MAX_OUTPUT_TOKENS) -> list[Request]:
    """Prompts of uniformly drawn length, output lengths Zipf-distributed over 1..max_output
    (the distribution `iterserve loadgen --output-dist zipf` draws from)."""
    rng = random.Random(seed)
    lengths = output_lengths(LoadSpec(output_dist="zipf", max_tokens=max_output), rng)
    return [
        Request([rng.randint(*PROMPT_TOKEN_RANGE) for _ in range(rng.randint(*prompt_len))], next(lengths))
        for _ in range(num_requests)
    ]


def add_common_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true",
                        help="a small workload that finishes in under 2 minutes (CI smoke run)")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON to PATH")
    parser.add_argument("--plot", metavar="PNG", help="draw the results into this PNG (matplotlib)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads for every system (default 1: on a small shared machine more "
                             "threads spin against other work)")
    parser.add_argument("--seed", type=int, default=0, help="workload seed")


def set_threads(threads: int) -> None:
    import torch

    if threads < 1:
        raise SystemExit(f"--threads must be at least 1, got {threads}")
    torch.set_num_threads(threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)  # for child processes (the server)


def machine(threads: int) -> dict:
    import torch

    return {
        "cpus": os.cpu_count(),
        "cpu_model": cpu_model(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": threads,
        "device": "cpu",
        "load_average_at_start": list(os.getloadavg()),
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def finish_machine(info: dict) -> dict:
    info["load_average_at_end"] = list(os.getloadavg())
    return info


def format_table(headers: list[str], rows: list[list]) -> str:
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    lines = ["  ".join(h.rjust(w) if i else h.ljust(w) for i, (h, w) in enumerate(zip(headers, widths, strict=True)))]
    lines.append("  ".join("-" * w for w in widths))
    for row in cells:
        lines.append("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))))
    return "\n".join(lines)


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)


REPO = Path(__file__).resolve().parent.parent


def run_record() -> dict:
    """What makes a result reproducible: the commit it ran (and whether the tree differed from it),
    the CPU, and the command as run from the repository root (no machine paths)."""
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10,
                                  check=True).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    return {"commit": git("rev-parse", "HEAD") or None,
            "tree_modified": bool(git("status", "--porcelain", "--untracked-files=no")),
            "cpu_model": cpu_model(), "command": ["python", *invocation(sys.argv[0]), *sys.argv[1:]]}


def invocation(argv0: str) -> list[str]:
    """How to run the script again from the repository root: `-m bench.<group>.<name>` for a
    benchmark module (what `python -m` leaves in sys.argv[0] is its file's path), else its path."""
    script = Path(argv0).resolve()
    if not script.is_relative_to(REPO):
        return [script.name]
    shown = script.relative_to(REPO)
    if shown.parts[0] == "bench" and shown.suffix == ".py" and len(shown.parts) > 2:
        return ["-m", ".".join(shown.with_suffix("").parts)]
    return [str(shown)]


def write_json(path: str | None, data: dict) -> None:
    if not path:
        return
    data = {**data, "run": data.get("run") or run_record()}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as out:
        json.dump(data, out, indent=2)
        out.write("\n")


def pyplot():
    """matplotlib's pyplot on the file-only backend, or a clear error if the dev extra is missing."""
    try:
        import matplotlib
    except ModuleNotFoundError:
        raise SystemExit("--plot needs matplotlib: pip install -e '.[dev]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
