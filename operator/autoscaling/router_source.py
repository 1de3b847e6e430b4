"""The activator's signal: how many requests the InferenceService's router pods hold while no
engine replica is ready (their `iterserve_router_held_requests` gauge, iterserve/router/activator.py),
read from each trusted router pod's /metrics, bounded like every other scrape. The router asks for
capacity this way without any API write: its ServiceAccount keeps only what discovery needs.

In: the router pods' base URLs. Out: the sum over the pods read, or None when none could be read
(unknown: the policy adds nothing to the waiting signal, and a pool at zero stays there until a
router pod is read)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import httpx
from prometheus_client.parser import text_string_to_metric_families

from iterserve.engine import metrics as names
from iterserve.operator.autoscaling.bounded_http import bounded_request

logger = logging.getLogger("iterserve.autoscaler")
ROUTER_METRICS_MAX_BYTES = 4 * 1024 * 1024  # a router's /metrics: a few series per engine replica


def held_requests_in(text: str) -> float | None:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == names.ROUTER_HELD_REQUESTS:
                return sample.value
    return None


async def read_held_requests(urls: Sequence[str], timeout: float = 2.0) -> float | None:
    """Held requests summed over the router pods that answered; None when none did."""
    if not urls:
        return None

    async def one(client: httpx.AsyncClient, url: str) -> float | None:
        try:
            answer = await bounded_request(client, "GET", f"{url.rstrip('/')}/metrics",
                                           max_bytes=ROUTER_METRICS_MAX_BYTES, deadline_s=timeout)
            return held_requests_in(answer.text()) if answer.status == 200 else None
        except Exception as error:  # noqa: BLE001 - an unreadable router is reported as unknown, not fatal
            logger.debug("router %s: held requests unreadable: %s", url, error)
            return None

    async with httpx.AsyncClient(timeout=timeout) as client:
        values = [v for v in await asyncio.gather(*(one(client, u) for u in urls)) if v is not None]
    return sum(values) if values else None
