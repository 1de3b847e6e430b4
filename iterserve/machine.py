"""What machine a figure was measured on: every benchmark records it beside its numbers.

The CPU facts belong to the engine (engine/cpu_info.py, which `--dtype auto` reads); this module
re-exports them for the benchmarks and the end-to-end scripts.
"""

from __future__ import annotations

from iterserve.engine.cpu_info import cpu_flags, cpu_model

__all__ = ["cpu_flags", "cpu_model"]
