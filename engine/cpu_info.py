"""What the engine knows of the CPU it runs on: its model name and its flags (/proc/cpuinfo).

The engine reads the flags to decide `--dtype auto` (engine/model/cpu_dtype.py); benchmarks record
the model name beside their figures (iterserve/machine.py re-exports both for them).
"""

from __future__ import annotations

import platform
from pathlib import Path


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, else what the platform module knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The CPU's flags from /proc/cpuinfo (or the given text of it); empty where it cannot be read."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()
