"""Optional per-step JSON-lines log: what each engine step did and where its time went."""

from __future__ import annotations

import json
from typing import IO


class StepLog:
    def __init__(self, path: str):
        self._file: IO[str] = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115

    def write(self, record: dict) -> None:
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")

    def close(self) -> None:
        self._file.close()
