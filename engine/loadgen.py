"""`iterserve loadgen`: drive an OpenAI-compatible server with Poisson arrivals of streaming
completion requests, and report throughput, TTFT, ITL and end-to-end latency (p50/p95/p99) and
errors by status, as a table and as JSON.

Python API (used by the benchmarks and the autoscaling tests):

    report = await run_load(LoadSpec(url="http://127.0.0.1:8000", rate=20, requests=200))

With `endpoints` (a function returning base URLs, asked before each request) requests are spread
round robin over whatever it returns at that moment, e.g. the ready pods of a Service read from
the Kubernetes API where there is no kube-proxy; `on_result` sees each request as it ends.

Prompts are token-id lists, so their length is exact whatever the tokenizer; `ignore_eos` makes
each request generate exactly the output length drawn from --output-dist.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import random
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields

import httpx

OUTPUT_DISTS = ("fixed", "zipf", "exponential")
# Token ids that are ordinary text in every vocabulary iterserve serves (clear of special tokens).
PROMPT_TOKEN_RANGE = (100, 250)
ZIPF_EXPONENT = 1.1


@dataclass
class LoadSpec:
    url: str = "http://127.0.0.1:8000"
    rate: float = math.inf  # requests per second (Poisson); inf sends all at once
    requests: int | None = 100  # None: until duration runs out
    concurrency: int | None = None  # cap on requests in flight; None: unbounded
    output_dist: str = "fixed"
    prompt_len: int = 32  # tokens
    max_tokens: int = 64  # fixed: every request; zipf and exponential: the cap (exponential mean: 1/4 of it)
    model: str | None = None  # None: the first model GET /v1/models lists
    duration: float | None = None  # seconds to keep sending; None: until `requests` were sent
    seed: int = 0
    ignore_eos: bool = True
    timeout: float = 600.0
    api_key: str | None = None
    endpoints: Callable[[], Sequence[str]] | None = None  # base URLs to spread over; None: url
    on_result: Callable[[RequestResult], None] | None = None  # called as each request ends
    extra_body: dict | None = None  # more request fields, for servers that need them (bench/peers/compare.py: vLLM)

    def validate(self) -> None:
        if self.requests is None and self.duration is None:
            raise ValueError("give --requests or --duration (or both)")
        if self.requests is not None and self.requests < 1:
            raise ValueError("--requests must be at least 1")
        if not self.rate > 0:
            raise ValueError("--rate must be > 0 requests per second (inf: all at once)")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError("--concurrency must be at least 1")
        if self.output_dist not in OUTPUT_DISTS:
            raise ValueError(f"--output-dist must be one of {', '.join(OUTPUT_DISTS)}")
        if self.prompt_len < 1 or self.max_tokens < 1:
            raise ValueError("--prompt-len and --max-tokens must be at least 1")


@dataclass
class RequestResult:
    status: int | str | None = None  # HTTP status, or an error kind when there was no response
    ok: bool = False
    start: float = 0.0
    first_token: float | None = None
    end: float | None = None
    token_times: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    endpoint: str = ""  # the base URL it went to, when LoadSpec.endpoints chose it


def output_lengths(spec: LoadSpec, rng: random.Random):
    """An endless sequence of output lengths drawn from spec.output_dist, within [1, max_tokens]."""
    cap = spec.max_tokens
    if spec.output_dist == "fixed":
        return itertools.repeat(cap)
    if spec.output_dist == "exponential":
        mean = max(1.0, cap / 4)
        return (min(cap, max(1, round(rng.expovariate(1 / mean)))) for _ in itertools.count())
    # Zipf over 1..cap: many short answers and a long tail, as chat traffic has.
    lengths = range(1, cap + 1)
    cumulative = list(itertools.accumulate(1 / n**ZIPF_EXPONENT for n in lengths))
    return (rng.choices(lengths, cum_weights=cumulative)[0] for _ in itertools.count())


async def run_load(spec: LoadSpec) -> dict:
    """Run the load described by spec; returns the report (see `summarize`)."""
    spec.validate()
    rng = random.Random(spec.seed)
    lengths = output_lengths(spec, rng)
    headers = {"Authorization": f"Bearer {spec.api_key}"} if spec.api_key else {}
    limits = httpx.Limits(max_connections=spec.concurrency, max_keepalive_connections=spec.concurrency)
    async with httpx.AsyncClient(base_url=spec.url.rstrip("/"), headers=headers, limits=limits,
                                 timeout=httpx.Timeout(spec.timeout, connect=10.0)) as client:
        model = spec.model or await _first_model(client, await _next_endpoint(spec, 0) if spec.endpoints else "")
        gate = asyncio.Semaphore(spec.concurrency) if spec.concurrency else None
        results: list[RequestResult] = []
        tasks = []
        started = time.perf_counter()
        for i in itertools.count():
            if spec.requests is not None and i >= spec.requests:
                break
            if spec.duration is not None and time.perf_counter() - started >= spec.duration:
                break
            if gate is not None:
                await gate.acquire()
            prompt = [rng.randint(*PROMPT_TOKEN_RANGE) for _ in range(spec.prompt_len)]
            result = RequestResult()
            results.append(result)
            base = await _next_endpoint(spec, i) if spec.endpoints else ""
            tasks.append(asyncio.create_task(
                _one_request(client, model, prompt, next(lengths), spec, result, gate, base)))
            if spec.rate != math.inf:
                await asyncio.sleep(rng.expovariate(spec.rate))
        await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - started
    return summarize(results, elapsed, spec, model)


async def _next_endpoint(spec: LoadSpec, index: int) -> str:
    """The base URL for request `index`: round robin over the endpoints there are now (waits
    while there are none)."""
    deadline = time.perf_counter() + spec.timeout
    while not (urls := list(spec.endpoints())):
        if time.perf_counter() > deadline:
            raise httpx.ConnectError(f"no endpoint to send to for {spec.timeout:.0f} s")
        await asyncio.sleep(0.05)
    return urls[index % len(urls)].rstrip("/")


async def _first_model(client: httpx.AsyncClient, base: str = "") -> str:
    response = await client.get(f"{base}/v1/models")
    response.raise_for_status()
    return response.json()["data"][0]["id"]


async def _one_request(client, model, prompt, max_tokens, spec, result: RequestResult, gate, base: str = "") -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    if spec.ignore_eos:
        body["ignore_eos"] = True
    body.update(spec.extra_body or {})
    result.start = time.perf_counter()
    result.prompt_tokens = len(prompt)
    result.endpoint = base
    try:
        async with client.stream("POST", f"{base}/v1/completions", json=body) as response:
            result.status = response.status_code
            if response.status_code != 200:
                await response.aread()
                return
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    result.ok = True
                    break
                event = json.loads(data)
                if "error" in event:
                    result.status = "stream_error"
                    break
                now = time.perf_counter()
                if any(choice.get("text") for choice in event.get("choices", [])):
                    if result.first_token is None:
                        result.first_token = now
                    result.token_times.append(now)
                usage = event.get("usage")
                if usage:
                    result.output_tokens = usage["completion_tokens"]
                    result.prompt_tokens = usage["prompt_tokens"]
    except httpx.HTTPError as error:
        result.status = type(error).__name__
    finally:
        result.end = time.perf_counter()
        if result.ok and not result.output_tokens:
            result.output_tokens = len(result.token_times)
        if gate is not None:
            gate.release()
        if spec.on_result is not None:
            spec.on_result(result)


def percentiles(values: list[float]) -> dict:
    if not values:
        return {"mean": None, "p50": None, "p95": None, "p99": None, "max": None}
    ordered = sorted(values)

    def at(q: float) -> float:
        position = q * (len(ordered) - 1)
        low = math.floor(position)
        high = min(low + 1, len(ordered) - 1)
        return ordered[low] + (ordered[high] - ordered[low]) * (position - low)

    return {"mean": sum(ordered) / len(ordered), "p50": at(0.50), "p95": at(0.95), "p99": at(0.99),
            "max": ordered[-1]}


def summarize(results: list[RequestResult], elapsed: float, spec: LoadSpec, model: str) -> dict:
    done = [r for r in results if r.ok]
    errors = Counter(str(r.status) for r in results if not r.ok)
    output_tokens = sum(r.output_tokens for r in done)
    itl = [b - a for r in done for a, b in itertools.pairwise(r.token_times)]
    # Not asdict(): it would deep-copy the callables' objects.
    config = {f.name: getattr(spec, f.name) for f in fields(spec)
              if f.name not in ("api_key", "endpoints", "on_result")}
    config["rate"] = None if spec.rate == math.inf else spec.rate
    return {
        "model": model,
        "config": config,
        "requests": len(results),
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors_by_status": dict(sorted(errors.items())),
        "duration_s": elapsed,
        "request_throughput_per_s": len(done) / elapsed if elapsed else 0.0,
        "output_throughput_tokens_per_s": output_tokens / elapsed if elapsed else 0.0,
        "total_prompt_tokens": sum(r.prompt_tokens for r in done),
        "total_output_tokens": output_tokens,
        "ttft_s": percentiles([r.first_token - r.start for r in done if r.first_token is not None]),
        "itl_s": percentiles(itl),
        "e2e_s": percentiles([r.end - r.start for r in done]),
    }


def format_table(report: dict) -> str:
    lines = [
        f"model {report['model']}: {report['completed']}/{report['requests']} requests completed "
        f"in {report['duration_s']:.2f} s",
        f"throughput: {report['request_throughput_per_s']:.2f} req/s, "
        f"{report['output_throughput_tokens_per_s']:.1f} output tokens/s "
        f"({report['total_output_tokens']} tokens)",
        "",
        f"{'latency (ms)':<14}{'mean':>10}{'p50':>10}{'p95':>10}{'p99':>10}{'max':>10}",
    ]
    for label, key in (("TTFT", "ttft_s"), ("ITL", "itl_s"), ("end-to-end", "e2e_s")):
        row = report[key]
        cells = "".join(f"{'-' if row[k] is None else f'{row[k] * 1000:.1f}':>10}"
                        for k in ("mean", "p50", "p95", "p99", "max"))
        lines.append(f"{label:<14}{cells}")
    if report["errors_by_status"]:
        lines += ["", "errors: " + ", ".join(f"{status}: {n}" for status, n in report["errors_by_status"].items())]
    return "\n".join(lines)


def configure(parser: argparse.ArgumentParser) -> None:
    defaults = LoadSpec()
    parser.add_argument("--url", default=defaults.url, help="server base URL (default %(default)s)")
    parser.add_argument("--rate", type=float, default=math.inf,
                        help="mean requests per second, Poisson arrivals (default: all at once)")
    parser.add_argument("--requests", type=int, help="number of requests (default 100 unless --duration)")
    parser.add_argument("--duration", type=float, help="keep sending for this many seconds")
    parser.add_argument("--concurrency", type=int, help="cap on requests in flight")
    parser.add_argument("--output-dist", choices=OUTPUT_DISTS, default=defaults.output_dist,
                        help="output lengths: fixed = --max-tokens; zipf and exponential: capped at --max-tokens")
    parser.add_argument("--prompt-len", type=int, default=defaults.prompt_len, help="prompt tokens per request")
    parser.add_argument("--max-tokens", type=int, default=defaults.max_tokens)
    parser.add_argument("--model", help="model id (default: the first one GET /v1/models lists)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                        help="let the model stop at end-of-sequence (then output lengths vary)")
    parser.add_argument("--json", metavar="PATH", help="also write the report as JSON to PATH")


def run(args: argparse.Namespace) -> int:
    requests = args.requests if args.requests is not None else (None if args.duration else 100)
    spec = LoadSpec(url=args.url, rate=args.rate, requests=requests, concurrency=args.concurrency,
                    output_dist=args.output_dist, prompt_len=args.prompt_len, max_tokens=args.max_tokens,
                    model=args.model, duration=args.duration, seed=args.seed, ignore_eos=args.ignore_eos)
    try:
        report = asyncio.run(run_load(spec))
    except ValueError as error:
        print(f"iterserve loadgen: {error}", file=sys.stderr)
        return 2
    except httpx.HTTPError as error:
        print(f"iterserve loadgen: cannot reach {spec.url}: {error}", file=sys.stderr)
        return 1
    print(format_table(report))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump(report, out, indent=2)
    return 0 if report["completed"] else 1
