"""Request traces: loaders for the public LLM trace formats and generators for synthetic load.

A trace is a list of `TraceRequest` (arrival second from the trace's start, prompt and output
token counts), sorted by arrival. Formats (`load_trace` tells them apart by header or suffix):
- Azure LLM inference trace (2023/2024): CSV `TIMESTAMP,ContextTokens,GeneratedTokens`, with
  wall-clock timestamps such as `2023-11-16 18:15:46.6805900`.
- BurstGPT: CSV `Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type`, seconds
  from the trace start; rows with 0 response tokens (failed requests) are skipped.
- Mooncake: JSON lines `{"timestamp": ms, "input_length": n, "output_length": n, "hash_ids": [...]}`.
- Plain CSV: `timestamp_s,prompt_tokens,output_tokens` with that header line.
"""

from __future__ import annotations

import csv
import itertools
import json
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

FORMATS = ("auto", "azure", "burstgpt", "mooncake", "csv")
ZIPF_EXPONENT = 1.1  # as loadgen's zipf outputs


@dataclass(frozen=True, slots=True)
class TraceRequest:
    arrival_s: float
    prompt_tokens: int
    output_tokens: int


class TraceError(ValueError):
    pass


def _sorted(requests: list[TraceRequest]) -> list[TraceRequest]:
    if not requests:
        raise TraceError("the trace has no requests")
    requests.sort(key=lambda r: r.arrival_s)
    start = requests[0].arrival_s
    return [TraceRequest(round(r.arrival_s - start, 6), r.prompt_tokens, r.output_tokens) for r in requests]


def _azure_time(stamp: str) -> float:
    stamp = stamp.strip()
    if "." in stamp:  # the trace writes 7 fractional digits; datetime reads at most 6
        head, frac = stamp.split(".", 1)
        stamp = f"{head}.{frac[:6]}"
    return datetime.fromisoformat(stamp).timestamp()


def detect_format(path: Path) -> str:
    with open(path, encoding="utf-8") as handle:
        first = handle.readline().strip()
    if first.startswith("{"):
        return "mooncake"
    header = [h.strip() for h in first.split(",")]
    if header[:3] == ["TIMESTAMP", "ContextTokens", "GeneratedTokens"]:
        return "azure"
    if "Request tokens" in header and "Response tokens" in header:
        return "burstgpt"
    if header[:3] == ["timestamp_s", "prompt_tokens", "output_tokens"]:
        return "csv"
    raise TraceError(f"{path}: cannot tell the trace format from its first line {first[:80]!r}; "
                     f"pass --trace-format ({', '.join(FORMATS[1:])})")


def load_trace(path: str | Path, fmt: str = "auto", limit: int | None = None) -> list[TraceRequest]:
    path = Path(path)
    fmt = detect_format(path) if fmt == "auto" else fmt
    rows: Iterator[TraceRequest]
    if fmt == "mooncake":
        rows = _mooncake(path)
    elif fmt in ("azure", "burstgpt", "csv"):
        rows = {"azure": _azure, "burstgpt": _burstgpt, "csv": _plain}[fmt](path)
    else:
        raise TraceError(f"unknown trace format {fmt!r}; one of {', '.join(FORMATS)}")
    return _sorted(list(itertools.islice(rows, limit)))


def _csv_rows(path: Path) -> Iterator[dict]:
    with open(path, encoding="utf-8", newline="") as handle:
        reader = csv.DictReader(handle, skipinitialspace=True)
        for line, row in enumerate(reader, start=2):
            row["_line"] = line
            yield row


def _int(row: dict, key: str, path: Path) -> int:
    try:
        return int(float(row[key]))
    except (KeyError, TypeError, ValueError):
        raise TraceError(f"{path}:{row['_line']}: bad {key} {row.get(key)!r}") from None


def _azure(path: Path) -> Iterator[TraceRequest]:
    for row in _csv_rows(path):
        yield TraceRequest(_azure_time(row["TIMESTAMP"]), max(1, _int(row, "ContextTokens", path)),
                           max(1, _int(row, "GeneratedTokens", path)))


def _burstgpt(path: Path) -> Iterator[TraceRequest]:
    for row in _csv_rows(path):
        output = _int(row, "Response tokens", path)
        if output <= 0:
            continue
        yield TraceRequest(float(row["Timestamp"]), max(1, _int(row, "Request tokens", path)), output)


def _plain(path: Path) -> Iterator[TraceRequest]:
    for row in _csv_rows(path):
        yield TraceRequest(float(row["timestamp_s"]), max(1, _int(row, "prompt_tokens", path)),
                           max(1, _int(row, "output_tokens", path)))


def _mooncake(path: Path) -> Iterator[TraceRequest]:
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                yield TraceRequest(row["timestamp"] / 1000.0, max(1, int(row["input_length"])),
                                   max(1, int(row["output_length"])))
            except (ValueError, KeyError, TypeError) as error:
                raise TraceError(f"{path}:{number}: {error}") from None


def write_csv(requests: list[TraceRequest], path: str | Path) -> None:
    with open(path, "w", encoding="utf-8", newline="") as handle:
        handle.write("timestamp_s,prompt_tokens,output_tokens\n")
        for r in requests:
            handle.write(f"{r.arrival_s:.6f},{r.prompt_tokens},{r.output_tokens}\n")


# ----------------------------------------------------------------------------------- generators


@dataclass(frozen=True)
class Lengths:
    """Token counts: fixed (`value`), uniform in [low, value], or Zipf over 1..value."""

    kind: str = "fixed"
    value: int = 64
    low: int = 1

    @classmethod
    def parse(cls, text: str) -> Lengths:
        """'64', 'fixed:64', 'uniform:16:128', 'zipf:256'."""
        parts = str(text).split(":")
        if len(parts) == 1:
            return cls("fixed", int(parts[0]))
        if parts[0] == "uniform" and len(parts) == 3:
            return cls("uniform", int(parts[2]), int(parts[1]))
        if parts[0] in ("fixed", "zipf") and len(parts) == 2:
            return cls(parts[0], int(parts[1]))
        raise TraceError(f"cannot read lengths {text!r}: write 64, fixed:64, uniform:16:128 or zipf:256")

    def sampler(self, rng: random.Random) -> Iterator[int]:
        if self.kind == "fixed":
            return itertools.repeat(self.value)
        if self.kind == "uniform":
            return (rng.randint(self.low, self.value) for _ in itertools.count())
        lengths = range(1, self.value + 1)
        cumulative = list(itertools.accumulate(1 / n**ZIPF_EXPONENT for n in lengths))
        return (rng.choices(lengths, cum_weights=cumulative)[0] for _ in itertools.count())


def _requests(times: list[float], prompt: Lengths, output: Lengths, rng: random.Random) -> list[TraceRequest]:
    prompts, outputs = prompt.sampler(rng), output.sampler(rng)
    return [TraceRequest(round(t, 6), next(prompts), next(outputs)) for t in times]


def poisson(rate: float, duration: float, prompt: Lengths, output: Lengths, seed: int = 0) -> list[TraceRequest]:
    """Exponential gaps at `rate` requests per second for `duration` seconds."""
    return gamma(rate, 1.0, duration, prompt, output, seed)


def gamma(rate: float, cv: float, duration: float, prompt: Lengths, output: Lengths,
          seed: int = 0) -> list[TraceRequest]:
    """Gamma-distributed gaps of mean 1/rate and coefficient of variation `cv` (1: Poisson;
    above 1: bursty, requests bunch up with long quiet gaps between bunches)."""
    rng = random.Random(seed)
    shape = 1.0 / (cv * cv)
    scale = 1.0 / (rate * shape)
    times, t = [], rng.gammavariate(shape, scale)
    while t < duration:
        times.append(t)
        t += rng.gammavariate(shape, scale)
    return _requests(times, prompt, output, rng)


def diurnal(mean_rate: float, peak_to_trough: float, period: float, duration: float, prompt: Lengths,
            output: Lengths, seed: int = 0, phase: float = 0.0) -> list[TraceRequest]:
    """Poisson arrivals whose rate follows a sinusoid around `mean_rate`, highest/lowest =
    `peak_to_trough`, one cycle per `period` seconds (thinning of a homogeneous process)."""
    rng = random.Random(seed)
    amplitude = (peak_to_trough - 1) / (peak_to_trough + 1)
    peak = mean_rate * (1 + amplitude)
    times, t = [], 0.0
    while True:
        t += rng.expovariate(peak)
        if t >= duration:
            break
        rate = mean_rate * (1 + amplitude * math.sin(2 * math.pi * (t / period) + phase - math.pi / 2))
        if rng.random() * peak <= rate:
            times.append(t)
    return _requests(times, prompt, output, rng)
