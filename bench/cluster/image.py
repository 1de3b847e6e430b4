"""The image: its size and digest, and how long a container takes from start to /ready.

Starts the image (default: the tag `make image` builds) the way a pod runs it (read-only root,
uid 10001, no capabilities, tmpfs /tmp; iterserve/devcluster/podman.py) with `iterserve serve`
and the embedded model, and times `podman run` to the first 200 from /ready, several times;
the first run also pays for reading the image's files into the page cache. Figures, not
assertions: the JSON goes to docs/perf/image.json and docs/image.md quotes it.

    python -m bench.cluster.image --json docs/perf/image.json [--tag localhost/iterserve:dev] [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import sys
import time
from pathlib import Path

import httpx

from bench.common import write_json
from iterserve.devcluster import podman
from iterserve.machine import cpu_model

READY_TIMEOUT_S = 300.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_ready(url: str, deadline: float) -> None:
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"{url} not ready within {READY_TIMEOUT_S:.0f} s")


def start_to_ready(tag: str) -> float:
    """Seconds from `podman run` to /ready answering 200 (the container is removed after)."""
    port = free_port()
    name = f"iterserve-bench-{os.getpid()}-{port}"
    started = time.monotonic()
    try:
        podman.run_detached(tag, name, ["iterserve", "serve", "--host", "127.0.0.1",
                                        "--port", str(port)])
        try:
            wait_ready(f"http://127.0.0.1:{port}/ready", started + READY_TIMEOUT_S)
        except TimeoutError:
            print(podman.logs(name), file=sys.stderr)
            raise
        return time.monotonic() - started
    finally:
        podman.remove(name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tag", default="localhost/iterserve:dev")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()
    reason = podman.unavailable_reason()
    if reason:
        sys.exit(f"error: cannot run containers here: {reason}")
    facts = podman.image_facts(args.tag)
    runs = [round(start_to_ready(args.tag), 2) for _ in range(args.runs)]
    result = {
        "image": facts,
        "size_gb": round(facts["size_bytes"] / 1e9, 2),
        "start_to_ready_s": runs,
        "start_to_ready_median_s": statistics.median(runs),
        "machine": {"cpus": os.cpu_count(), "cpu_model": cpu_model(), "platform": platform.platform(),
                    "load_average_at_end": list(os.getloadavg())},
    }
    print(json.dumps(result, indent=2))
    write_json(str(args.json) if args.json else None, result)  # with the run record (commit, CPU, command)


if __name__ == "__main__":
    main()
