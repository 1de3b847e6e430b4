"""One replica as the router tracks it: in-flight count, last scrape, ejection; and the loop
that scrapes its /metrics.

A scrape that fails (an HTTP error, a timeout, unreadable text) only makes the endpoint stale:
it stays routable on the router's own in-flight count. A connection error (refused, reset)
ejects it for a backoff that doubles while it keeps failing (up to max_backoff_s); the first
scrape that connects after the backoff brings it back. Each ejection and recovery is logged.
"""

from __future__ import annotations

import asyncio
import logging
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
        )

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
    endpoint.scraped_at = endpoint.clock()
    endpoint.in_flight_at_scrape = in_flight


class ScrapeFailed(Exception):
    pass
