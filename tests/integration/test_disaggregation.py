"""Prefill/decode disaggregation end to end, on the embedded SmolLM2-135M: `iterserve router
--prefill P --decode D` in front of `iterserve serve --role prefill` and `--role decode`, against
one `--role both` engine as the reference.

- Greedy outputs are identical token for token (20 prompts, lengths of exactly k*block_size and
  k*block_size+1 among them; a threshold of 8 tokens sends them all to the prefill replica), and
  every one really moved KV (the decode engine's transfer histogram counts them, no failures).
- After every test both sides are back at their baseline: no KV block held, none pinned.
- Faults: a client that goes away mid-transfer (nothing leaks, and eight fresh prompts are
  equal again afterwards); the decode engine killed while its pull is in flight (the prefill engine
  frees the lease when it expires); the prefill engine killed after answering (the decode engine's
  pull fails and it recomputes the prompt within its timeout, the answer unchanged) and dead
  before (the router falls back to local prefill).

Every engine and the router hold the same KV key (--kv-auth-key-file): the router signs its
prefill calls and the prefill engine its lease answers, as in a cluster.

Three engines load the model once for the module (minutes on a loaded machine), so the tests run
in file order and the last two each kill one: the decode engine, then the prefill engine (the last
test starts a decode engine of its own: role both takes no kv_transfer_params). Any subset still
runs in that order.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from iterserve.devcluster.waiting import free_port, wait_for
from iterserve.engine import metrics as names
from tests.kv_auth_helpers import key_file, remote_decode
from tests.server_fixture import ServerProcess, iterserve_command

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]  # a loaded machine takes minutes to load three models
# One client (a new one per call costs an SSL context each); idle connections are dropped before
# uvicorn's 5 s keep-alive closes them, so a reused one is never already closed.
HTTP = httpx.Client(timeout=120, limits=httpx.Limits(keepalive_expiry=1.0))

BLOCK = 16
LEASE_S = 4  # the prefill engines' --kv-lease-seconds: short, so the expiry test is quick
# float32: the tokens are compared with a local prefill's, which bf16 (what --dtype auto picks on a
# CPU with native bf16) rounds differently from a one-token step over pulled KV.
ENGINE = ["--max-model-len", "2048", "--max-num-seqs", "4", "--kv-lease-seconds", str(LEASE_S),
          "--kv-transfer-timeout", "5", "--dtype", "float32"]
KEY = ["--kv-auth-key-file", key_file()]
ENV = {"OMP_NUM_THREADS": "1"}
README = Path(__file__).resolve().parents[2] / "README.md"
# Lengths: exactly k*block_size and k*block_size+1 for k = 1..6, one under a block, and others.
LENGTHS = [16, 17, 32, 33, 48, 49, 64, 65, 80, 81, 96, 97, 15, 9, 23, 111, 128, 129, 160, 161]
FRESH_AFTER_ABORT = [0, 1, 16, 17, 12, 13, 18, 19]  # lengths 16, 17, 128, 129, 15, 9, 160, 161


@contextmanager
def router(tmp_path: Path, prefill: list[str], decode: list[str], *extra: str):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / f"router-{port}.log"
    command = [*iterserve_command(), "router", "--port", str(port), "--prefill", ",".join(prefill),
               "--decode", ",".join(decode), "--pd-threshold-tokens", "8", "--scrape-interval", "0.05",
               # a loaded machine's 1500-token prefill may take over the default 30 s: no fallback here
               "--pd-prefill-timeout", "600", *KEY, *extra]
    with open(log, "wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, cwd="/")
        try:
            wait_for(lambda: proc.poll() is not None or _status(f"{url}/health") == 200, 30, 0.1, what="router up")
            assert proc.poll() is None, log.read_text()
            yield url
        finally:
            proc.terminate()
            proc.wait(10)


def _status(url: str) -> int | None:
    try:
        return HTTP.get(url, timeout=2).status_code
    except httpx.HTTPError:
        return None


def metric(url: str, name: str, **labels) -> float:
    total = 0.0
    for family in text_string_to_metric_families(HTTP.get(f"{url}/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def assert_baseline(*urls: str, timeout: float = LEASE_S + 120) -> None:
    """No KV block held by a sequence and none pinned under a lease, on every engine (waits: an
    aborted request leaves at the end of its engine's step, and a loaded machine's step is slow)."""
    for url in urls:
        wait_for(lambda url=url: metric(url, names.KV_CACHE_USAGE) == 0 and metric(url, names.KV_PINNED_BLOCKS) == 0
                 and metric(url, names.RUNNING_SEQS) == 0, timeout, 0.1,
                 what=lambda url=url: f"{url}: KV blocks back to baseline (usage "
                 f"{metric(url, names.KV_CACHE_USAGE)}, pinned {metric(url, names.KV_PINNED_BLOCKS)}, "
                 f"running {metric(url, names.RUNNING_SEQS)})")


@contextmanager
def servers(*specs: tuple[list[str], Path]):
    """Engines started together (each loads the model meanwhile), stopped together."""
    started = [ServerProcess(args, ENV, log) for args, log in specs]
    try:
        for server in started:
            server.wait_ready(1200)  # minutes on a loaded machine
        yield started
    finally:
        for server in started:
            server.stop()


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    logs = tmp_path_factory.mktemp("disagg")
    with servers((ENGINE, logs / "both.log"), ([*ENGINE, "--role", "prefill", *KEY], logs / "prefill.log"),
                 ([*ENGINE, "--role", "decode", *KEY], logs / "decode.log")) as (both, prefill, decode):
        yield both, prefill, decode, logs


@pytest.fixture(scope="module")
def tokens(engines):
    """The README's and docs' text as the model's token ids: prompts of real text, cut at exact lengths."""
    both = engines[0]
    ids = HTTP.post(f"{both.url}/tokenize", json={"prompt": "".join(p.read_text() for p in [README, *sorted(README.parent.glob("docs/*.md"))])[:24000]}, timeout=120).json()["tokens"]
    assert len(ids) > 4000
    return ids


def make_prompts(tokens: list[int], region: int) -> list[list[int]]:
    """The 20 prompts, each from its own offset in a region of the text (no two share a first
    block, so none is served from the decode engine's prefix cache instead of a transfer)."""
    return [tokens[region + 7 * i + 1:region + 7 * i + 1 + n] for i, n in enumerate(LENGTHS)]


def long_prompt(tokens: list[int], k: int, n: int = 1500) -> list[int]:
    """A long prompt (its transfer takes a while) of its own, from the text after the short ones."""
    return tokens[1000 + 97 * k:1000 + 97 * k + n]


def generate(url: str, prompt: list[int], stream: bool = False, max_tokens: int = 8,
             **extra) -> tuple[str, list[str] | None]:
    body = {"model": "smollm2-135m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}
    if not stream:
        answer = HTTP.post(f"{url}/v1/completions", json={**body, "logprobs": 0}, timeout=120)
        assert answer.status_code == 200, answer.text
        choice = answer.json()["choices"][0]
        return choice["text"], choice["logprobs"]["tokens"]
    text = []
    with HTTP.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=120) as answer:
        assert answer.status_code == 200
        for line in answer.iter_lines():
            if line.startswith("data: {"):
                text += [c["text"] for c in json.loads(line[6:])["choices"]]
    return "".join(text), None


def check_equal_outputs(both, prefill, decode, prompts, url) -> None:
    transfers = metric(decode.url, names.KV_TRANSFER_SECONDS + "_count")
    remote = metric(url, names.ROUTER_PD_DECISIONS_TOTAL, reason="remote")
    # The references (role-both engine) run meanwhile, one after the other: each engine still
    # serves one request at a time (two batched on one engine may round fp32 differently).
    with ThreadPoolExecutor(1) as pool:
        references = pool.submit(lambda: [generate(both.url, prompt) for prompt in prompts])
        routed = [generate(url, prompt, stream=i % 3 == 2) for i, prompt in enumerate(prompts)]
        references = references.result()
    for i, (prompt, got, expected) in enumerate(zip(prompts, routed, references, strict=True)):
        assert got[0] == expected[0], f"prompt {i} ({len(prompt)} tokens): {got[0]!r} != {expected[0]!r}"
        if got[1] is not None:
            assert got[1] == expected[1], f"prompt {i} ({len(prompt)} tokens): tokens differ"
    # Every prompt (all above the 8-token threshold) went to the prefill engine and its KV moved.
    assert metric(url, names.ROUTER_PD_DECISIONS_TOTAL, reason="remote") - remote == len(prompts)
    assert metric(decode.url, names.KV_TRANSFER_SECONDS + "_count") - transfers == len(prompts)
    assert metric(decode.url, names.KV_TRANSFER_FAILURES_TOTAL) == 0
    assert metric(url, names.ROUTER_PD_FALLBACKS_TOTAL) == 0
    assert_baseline(both.url, prefill.url, decode.url)


def test_greedy_outputs_identical_token_for_token(engines, tokens):
    both, prefill, decode, logs = engines
    with router(logs, [prefill.url], [decode.url]) as url:
        check_equal_outputs(both, prefill, decode, make_prompts(tokens, 0), url)
        # A prompt at the threshold (8) goes straight to the decode engine, which prefills it itself.
        short = tokens[3000:3008]
        assert generate(url, short) == generate(both.url, short)
        assert metric(url, names.ROUTER_PD_DECISIONS_TOTAL, reason="short_prompt") == 1
        assert_baseline(both.url, prefill.url, decode.url)


def test_client_abort_mid_transfer_leaks_nothing(engines, tokens, tmp_path):
    both, prefill, decode, _ = engines
    with router(tmp_path, [prefill.url], [decode.url]) as url:
        port = int(url.rsplit(":", 1)[1])
        for k in range(3):
            body = json.dumps({"model": "smollm2-135m", "prompt": long_prompt(tokens, k), "max_tokens": 50,
                               "temperature": 0, "stream": True}).encode()
            with socket.create_connection(("127.0.0.1", port), timeout=120) as sock:
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                             b"content-length: %d\r\n\r\n%s" % (len(body), body))
                # Leave as soon as the decode engine is pulling (or, if that was too quick to see,
                # the prefill engine holds the lease or the decode engine runs the request).
                wait_for(lambda: metric(decode.url, names.WAITING_FOR_KV_REQUESTS) > 0
                         or metric(prefill.url, names.KV_PINNED_BLOCKS) > 0
                         or metric(decode.url, names.RUNNING_SEQS) > 0, 120, 0.005, what="transfer started")
        assert_baseline(both.url, prefill.url, decode.url)
        # Fresh prompts (the first run's are cached on the decode engine now): equal again. Eight
        # of the 20 lengths (1, 8 and 10 blocks, each also +1; under a block; just over the
        # threshold) show the aborts left nothing behind; the first test covers all 20.
        fresh = make_prompts(tokens, 400)
        check_equal_outputs(both, prefill, decode, [fresh[i] for i in FRESH_AFTER_ABORT], url)


def test_decode_killed_mid_transfer_prefill_frees_at_lease_expiry(engines, tokens, tmp_path):
    both, prefill, doomed, _ = engines
    expired = metric(prefill.url, names.KV_TRANSFER_EXPIRED_TOTAL)
    with router(tmp_path, [prefill.url], [doomed.url]) as url:
        result: dict = {}

        def send():
            try:
                result["answer"] = generate(url, long_prompt(tokens, 5))
            except (AssertionError, httpx.HTTPError) as error:
                result["error"] = error

        client = threading.Thread(target=send)
        client.start()
        # The decode engine has the request in its waiting-for-KV state: the pull is in flight.
        wait_for(lambda: metric(doomed.url, names.WAITING_FOR_KV_REQUESTS) > 0
                 or metric(doomed.url, names.KV_TRANSFER_SECONDS + "_count") > 0, 120, 0.005,
                 what="decode engine pulling KV")
        doomed.proc.send_signal(signal.SIGKILL)
        client.join(60)
        assert not client.is_alive()
        assert "answer" not in result  # the client got an error, not a made-up answer
    # Nobody released the lease: the prefill engine frees the blocks when it expires.
    wait_for(lambda: metric(prefill.url, names.KV_PINNED_BLOCKS) == 0, LEASE_S + 10, 0.1,
             what="prefill lease expired")
    assert metric(prefill.url, names.KV_TRANSFER_EXPIRED_TOTAL) == expired + 1
    assert_baseline(both.url, prefill.url)


def test_prefill_killed_decode_recomputes_and_router_falls_back(engines, tokens, tmp_path):
    both, doomed, _, logs = engines
    with servers(([*ENGINE, "--role", "decode", *KEY], logs / "decode-2.log")) as (decode,):  # the first is dead
        _prefill_killed(both, doomed, decode, tokens, tmp_path)


def _prefill_killed(both, doomed, decode, tokens, tmp_path) -> None:
    prompt, other = tokens[3100:3149], tokens[3200:3233]
    # The reference, without leaving the prompt in both's prefix cache (it must pull, not reuse).
    expected = generate(both.url, prompt, skip_prefix_cache=True)
    # The prefill engine answers, then dies before the decode engine pulls: the pull fails and
    # the decode engine recomputes the prompt itself, within its --kv-transfer-timeout (5 s).
    body = {"model": "smollm2-135m", "prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": 0}
    answer = HTTP.post(f"{doomed.url}/v1/completions",
                       json={**body, "max_tokens": 1, "kv_transfer_params": remote_decode()})
    params = answer.json()["kv_transfer_params"]
    doomed.proc.send_signal(signal.SIGKILL)
    doomed.proc.wait(10)
    failures = metric(decode.url, names.KV_TRANSFER_FAILURES_TOTAL)
    started = time.monotonic()
    answer = HTTP.post(f"{decode.url}/v1/completions",
                       json={**body, "kv_transfer_params": {**params, "do_remote_prefill": True}})
    assert time.monotonic() - started < 5 + 30
    choice = answer.json()["choices"][0]
    assert (choice["text"], choice["logprobs"]["tokens"]) == expected
    assert metric(decode.url, names.KV_TRANSFER_FAILURES_TOTAL) == failures + 1
    # Through the router, the dead prefill engine is a connection error: local prefill.
    with router(tmp_path, [doomed.url], [decode.url]) as url:
        assert generate(url, prompt) == expected
        assert generate(url, other) == generate(both.url, other, skip_prefix_cache=True)
        assert metric(url, names.ROUTER_PD_DECISIONS_TOTAL, reason="remote") == 0
    assert_baseline(both.url, decode.url)
