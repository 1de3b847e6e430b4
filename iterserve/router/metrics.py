"""The router's Prometheus metrics (names from iterserve.engine.metrics): counters kept as the
router works, per-endpoint gauges read from its endpoint table at scrape time (so an endpoint
that left leaves no series behind)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from iterserve.engine import metrics as names
from iterserve.router.activator import HELD_OUTCOMES
from iterserve.router.disagg import FALLBACK_REASONS, PD_REASONS
from iterserve.router.picking import PICK_REASONS

disable_created_metrics()  # as the engine does: no consumer reads the _created series


class RouterMetrics:
    def __init__(self, endpoints: Callable[[], Iterable], now: Callable[[], float], stale_after_s: float,
                 held: Callable[[], int] = lambda: 0):
        self.registry = CollectorRegistry()
        held_now = Gauge(names.ROUTER_HELD_REQUESTS, "Requests held while no replica is ready (the activator): "
                         "the autoscaler's signal to bring a pool at zero back.", registry=self.registry)
        held_now.set_function(held)
        holds = Counter(names.ROUTER_HOLDS_TOTAL, "Requests held while no replica was ready, by how the hold "
                        "ended (forwarded to a replica, timed out with 503, refused at once: too many held).",
                        ["outcome"], registry=self.registry)
        self.holds = {outcome: holds.labels(outcome) for outcome in HELD_OUTCOMES}
        picks = Counter(names.ROUTER_PICKS_TOTAL, "Requests by how their replica was picked "
                        "(saturated and none_ready: no replica; the request was refused).", ["reason"],
                        registry=self.registry)
        self.picks = {reason: picks.labels(reason) for reason in PICK_REASONS}
        self.retries = Counter(names.ROUTER_RETRIES_TOTAL, "Requests re-sent to another replica "
                               "before any byte reached the client.", registry=self.registry)
        self.ejections = Counter(names.ROUTER_EJECTIONS_TOTAL, "Replicas taken out after a "
                                 "connection error.", [names.ROUTER_ENDPOINT_LABEL], registry=self.registry)
        self.requests = Counter(names.ROUTER_REQUESTS_TOTAL, "Responses by the status the client got.",
                                ["code"], registry=self.registry)
        decisions = Counter(names.ROUTER_PD_DECISIONS_TOTAL, "P/D path: where each completions or chat "
                            "request was prefilled (remote: on a prefill replica; any other reason: on its "
                            "decode replica).", ["reason"], registry=self.registry)
        self.pd_decisions = {reason: decisions.labels(reason) for reason in PD_REASONS}
        fallbacks = Counter(names.ROUTER_PD_FALLBACKS_TOTAL, "P/D path: remote prefills given up "
                            "(the decode replica prefilled locally), by why.", ["reason"], registry=self.registry)
        self.pd_fallbacks = {reason: fallbacks.labels(reason) for reason in FALLBACK_REASONS}
        self.pd_prefill_seconds = Histogram(
            names.ROUTER_PD_PREFILL_SECONDS, "P/D path: seconds of a successful remote prefill call "
            "(the prompt's forward pass on the prefill replica, plus queueing).", registry=self.registry,
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
        self.registry.register(_EndpointCollector(endpoints, now, stale_after_s))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _EndpointCollector(Collector):
    def __init__(self, endpoints, now, stale_after_s):
        self.endpoints, self.now, self.stale_after_s = endpoints, now, stale_after_s

    def collect(self) -> Iterable[Metric]:
        now = self.now()
        label = [names.ROUTER_ENDPOINT_LABEL]
        load = GaugeMetricFamily(names.ROUTER_ENDPOINT_LOAD, "Load as the router sees it: "
                                 "max(waiting + running scraped, in flight).", labels=label)
        in_flight = GaugeMetricFamily(names.ROUTER_ENDPOINT_IN_FLIGHT, "Requests in flight from "
                                      "this router.", labels=label)
        routable = GaugeMetricFamily(names.ROUTER_ENDPOINT_ROUTABLE, "1 if the replica can be "
                                     "picked, 0 while ejected.", labels=label)
        stale = 0
        for endpoint in self.endpoints():
            seen = endpoint.load(now, self.stale_after_s)
            load.add_metric([endpoint.url], seen.load)
            in_flight.add_metric([endpoint.url], endpoint.in_flight)
            routable.add_metric([endpoint.url], 1 if seen.routable else 0)
            stale += seen.routable and not endpoint.is_fresh(now, self.stale_after_s)
        yield load
        yield in_flight
        yield routable
        yield GaugeMetricFamily(names.ROUTER_STALE_ENDPOINTS, "Routable replicas whose last good "
                                "scrape is too old: picked on local counts only.", value=stale)
