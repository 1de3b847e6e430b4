"""One replica as the router tracks it: in-flight count, last scrape, ejection; and the loop
that scrapes its /metrics (and its GET /v1/models: the base model and LoRA adapters it serves,
every MODELS_REFRESH_S while it serves adapters, every MODELS_IDLE_REFRESH_S otherwise).

A scrape that fails (an HTTP error, a timeout, unreadable text) only makes the endpoint stale:
it stays routable on the router's own in-flight count. A connection error (refused, reset)
ejects it for a backoff that doubles while it keeps failing (up to max_backoff_s); the first
scrape that connects after the backoff brings it back. Each ejection and recovery is logged.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import Callable
from urllib.parse import urlsplit

import aiohttp

from iterserve.engine import metrics as names
from iterserve.router.picking import EndpointLoad

logger = logging.getLogger("iterserve.router")

# A replica that cannot be reached or cut the connection (aiohttp's client errors included).
CONNECTION_ERRORS = (ConnectionError, OSError, asyncio.IncompleteReadError, aiohttp.ClientConnectionError,
                     aiohttp.ClientPayloadError)
MAX_METRICS_BYTES = 16 * 1024 * 1024
# Scraped gauges: ours first, vLLM's names for any other vLLM-compatible server.
WAITING_NAMES = (names.WAITING_REQUESTS.encode(), names.VLLM_WAITING.encode())
RUNNING_NAMES = (names.RUNNING_SEQS.encode(), names.VLLM_RUNNING.encode())
MAX_NUM_SEQS_NAMES = (names.MAX_NUM_SEQS.encode(),)
LORA_INFO_PREFIX = names.VLLM_LORA_REQUESTS_INFO.encode() + b"{"
_LABEL = re.compile(rb'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')
MAX_MODELS_BYTES = 1024 * 1024
MAX_MODELS = 4096  # model ids kept per replica
MODELS_REFRESH_S = 1.0  # a replica serving adapters: they are loaded and unloaded at run time
MODELS_IDLE_REFRESH_S = 10.0  # a replica without LoRA: its list changes only with a restart
MODELS_STALE_S = 30.0  # a list older than this is not known any more


class Endpoint:
    def __init__(self, url: str, clock: Callable[[], float] = time.monotonic):
        parts = urlsplit(url)
        self.url = url
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 80
        self.clock = clock
        self.in_flight = 0
        self.waiting: int | None = None
        self.running: int | None = None
        self.max_num_seqs: int | None = None
        self.scraped_at: float | None = None
        self.in_flight_at_scrape = 0
        self.last_picked = 0  # the router's pick number when this endpoint was last chosen (ties rotate)
        self.ejected_until: float | None = None
        self.backoff_s = 0.0
        self.recovered_at: float | None = None
        self.ejections = 0
        self.removed = False
        self.models: frozenset[str] | None = None  # from GET /v1/models; None: never read
        self.models_at: float | None = None
        self.models_tried_at: float | None = None  # the last GET /v1/models, answered or not
        self.lora = False  # its /metrics has vLLM's lora_requests_info (it serves adapters)
        self.active_adapters: frozenset[str] = frozenset()  # running or waiting there at the last scrape

    # -- state ----------------------------------------------------------------------------------
    def is_fresh(self, now: float, stale_after_s: float) -> bool:
        return self.scraped_at is not None and now - self.scraped_at <= stale_after_s

    def load(self, now: float, stale_after_s: float) -> EndpointLoad:
        fresh = self.is_fresh(now, stale_after_s)
        return EndpointLoad(
            url=self.url, in_flight=self.in_flight,
            waiting=self.waiting if fresh else None, running=self.running if fresh else None,
            max_num_seqs=self.max_num_seqs, routable=self.ejected_until is None,
            since_scrape=self.in_flight - self.in_flight_at_scrape if fresh else 0,
            last_picked=self.last_picked,
            models=self.models if self.models_at is not None and now - self.models_at <= MODELS_STALE_S else None,
            active_adapters=self.active_adapters if fresh else frozenset(),
        )

    def models_due(self, now: float) -> bool:
        every = MODELS_REFRESH_S if self.lora else MODELS_IDLE_REFRESH_S
        return self.models_tried_at is None or now - self.models_tried_at >= every

    def eject(self, why: str, base_backoff_s: float, max_backoff_s: float) -> bool:
        """Takes the endpoint out; returns True if this ejected it (False: it was already out).

        The backoff doubles when an endpoint fails again within max_backoff_s of recovering
        (a flapping replica), and starts from base_backoff_s otherwise; failures while out
        only keep it out for another backoff."""
        now = self.clock()
        if self.ejected_until is not None:
            self.ejected_until = max(self.ejected_until, now + self.backoff_s)
            return False
        flapping = self.recovered_at is not None and now - self.recovered_at < max_backoff_s
        self.backoff_s = min(max_backoff_s, self.backoff_s * 2) if flapping and self.backoff_s else base_backoff_s
        self.ejected_until = now + self.backoff_s
        self.ejections += 1
        logger.warning("ejected %s: %s (back in %.1f s at the earliest)", self.url, why, self.backoff_s)
        return True

    def connected(self) -> bool:
        """A connection succeeded; returns True if this brought an ejected endpoint back."""
        if self.ejected_until is None or self.clock() < self.ejected_until:
            return False
        self.ejected_until = None
        self.recovered_at = self.clock()
        logger.warning("recovered %s (ejected %d time(s) so far)", self.url, self.ejections)
        return True


def parse_lora_info(text: bytes) -> frozenset[str] | None:
    """The adapters running or waiting, from vLLM's lora_requests_info (the newest sample: vLLM
    may keep older label sets with older timestamps); None when the gauge is absent (no LoRA)."""
    newest, at = None, float("-inf")
    for line in text.split(b"\n"):
        if line.startswith(LORA_INFO_PREFIX):
            try:
                value = float(line.rsplit(b" ", 1)[-1])
            except ValueError:
                continue
            if value >= at:
                newest, at = line, value
    if newest is None:
        return None
    labels = dict(_LABEL.findall(newest[:newest.rfind(b"}") + 1]))
    running = labels.get(names.LORA_RUNNING_LABEL.encode(), b"")
    waiting = labels.get(names.LORA_WAITING_LABEL.encode(), b"")
    return frozenset(n.decode("utf-8", "replace") for n in (running + b"," + waiting).split(b",") if n)


def parse_models(body: bytes) -> frozenset[str]:
    """The ids of an OpenAI model list (GET /v1/models); ValueError when it is not one."""
    try:
        cards = json.loads(body)["data"]
        ids = frozenset(str(card["id"]) for card in cards[:MAX_MODELS])
    except (KeyError, TypeError, RecursionError) as error:
        raise ValueError(f"not an OpenAI model list ({type(error).__name__})") from None
    if not ids:  # a server serves at least its base model: an empty list says nothing
        raise ValueError("the model list is empty")
    return ids


def parse_load(text: bytes) -> tuple[int, int, int | None]:
    """(waiting, running, max_num_seqs or None) from a Prometheus text exposition.

    Raises ValueError if it has neither a waiting nor a running gauge we know."""
    found: dict[bytes, float] = {}
    wanted = set(WAITING_NAMES + RUNNING_NAMES + MAX_NUM_SEQS_NAMES)
    for line in text.split(b"\n"):
        if not line or line[0] == 35:  # '#'
            continue
        end = line.find(b"{")
        if end < 0:
            end = line.find(b" ")
        name = line[:end]
        if name in wanted and name not in found:
            found[name] = float(line.rsplit(b" ", 1)[-1])

    def first(candidates):
        return next((found[n] for n in candidates if n in found), None)

    waiting, running = first(WAITING_NAMES), first(RUNNING_NAMES)
    if waiting is None and running is None:
        raise ValueError("no waiting/running gauge in /metrics")
    cap = first(MAX_NUM_SEQS_NAMES)
    return int(waiting or 0), int(running or 0), int(cap) if cap is not None else None


async def scrape_once(endpoint: Endpoint, session: aiohttp.ClientSession, timeout_s: float) -> None:
    """GET /metrics (pooled connection) and update endpoint.

    Raises a CONNECTION_ERRORS exception when the endpoint cannot be reached, or ScrapeFailed."""
    in_flight = endpoint.in_flight
    try:
        async with asyncio.timeout(timeout_s), session.get(endpoint.url + "/metrics") as answer:
            if answer.status != 200:
                raise ScrapeFailed(f"/metrics answered {answer.status}")
            parts, total = [], 0
            while chunk := await answer.content.readany():
                total += len(chunk)
                if total > MAX_METRICS_BYTES:  # a replica must not grow the router without bound
                    raise ScrapeFailed(f"/metrics is over {MAX_METRICS_BYTES} bytes")
                parts.append(chunk)
    except TimeoutError:
        raise ScrapeFailed(f"/metrics took over {timeout_s:.1f} s") from None
    body = b"".join(parts)
    try:
        endpoint.waiting, endpoint.running, cap = parse_load(body)
    except ValueError as error:
        raise ScrapeFailed(str(error)) from None
    if cap is not None:
        endpoint.max_num_seqs = cap
    adapters = parse_lora_info(body)
    endpoint.lora, endpoint.active_adapters = adapters is not None, adapters or frozenset()
    endpoint.scraped_at = endpoint.clock()
    endpoint.in_flight_at_scrape = in_flight


async def scrape_models(endpoint: Endpoint, session: aiohttp.ClientSession, timeout_s: float) -> None:
    """GET /v1/models and update endpoint.models. Raises ScrapeFailed (or a CONNECTION_ERRORS one)."""
    endpoint.models_tried_at = endpoint.clock()
    try:
        async with asyncio.timeout(timeout_s), session.get(endpoint.url + "/v1/models") as answer:
            if answer.status != 200:
                raise ScrapeFailed(f"/v1/models answered {answer.status}")
            parts, total = [], 0
            while chunk := await answer.content.readany():
                total += len(chunk)
                if total > MAX_MODELS_BYTES:
                    raise ScrapeFailed(f"/v1/models is over {MAX_MODELS_BYTES} bytes")
                parts.append(chunk)
    except TimeoutError:
        raise ScrapeFailed(f"/v1/models took over {timeout_s:.1f} s") from None
    try:
        endpoint.models = parse_models(b"".join(parts))
    except ValueError as error:
        raise ScrapeFailed(f"/v1/models: {error}") from None
    endpoint.models_at = endpoint.clock()


class ScrapeFailed(Exception):
    pass
