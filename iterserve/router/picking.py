"""Which replica gets the next request: a pure function of the replicas' loads (no I/O, no clock).

The router calls `pick` once per request; the simulator imports the same function, so what it
predicts is what the router does.

    pick(endpoints: Sequence[EndpointLoad], rng: random.Random, policy=PickPolicy(),
         affinity: str | None = None) -> Pick

An endpoint's load is max(waiting + running as last scraped, requests this router has in flight
to it): the scrape sees other routers' traffic, the local count sees what was sent since the
scrape (so one snapshot cannot send a burst to the same replica). The scraped count is brought
forward by this router's own changes since the scrape (`since_scrape`: sent minus finished), so
a replica that just finished requests does not look busy until the next scrape. A stale scrape
counts as absent: the endpoint stays routable on local counts alone. Least load wins; a tie goes to
the endpoint picked longest ago (`last_picked`), so equal loads rotate as round robin does, and
only endpoints never picked (or equally long ago) are chosen between at random: a random
tie-break splits a Poisson stream into Poisson streams, which queue more than round robin's more
regular ones, and with identical replicas loads tie often. With `affinity` (the endpoint that recently served this prompt prefix) that endpoint wins
while its load is within `policy.affinity_tolerance` of the least. An endpoint whose load reached
its capacity (max_num_seqs + policy.max_queue) is saturated and never picked.

With `model` (the request's `model`: the base model or a LoRA adapter), endpoints whose model list
(`models`, from their GET /v1/models) does not name it are left out while any routable one does
name it or has no known list: they would answer 404. Among the rest, endpoints running or queueing
the adapter now (`active_adapters`, vLLM's lora_requests_info: it sits in a device slot) are
preferred while their load is within `policy.affinity_tolerance` of the least; a pick that either
rule narrowed counts as `adapter_affinity`. `unknown_model` says when the router itself may answer
404: every endpoint's list is known and none names the model.

`PickIndex` is the same rule (no affinity, no model) for a caller that keeps thousands of
endpoints and changes a few loads between picks (the simulator's fleet): the endpoints sit in a
heap by (load, last_picked, order), so a pick costs a logarithm of the fleet, not a pass over it,
and it returns what `pick` returns over the same loads in `order`, drawing from the rng exactly
as `pick` does (tests/unit/test_router_pick_index.py holds the two equal on random loads).
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Sequence
from dataclasses import dataclass

from iterserve.engine.config import DEFAULT_MAX_WAITING_REQUESTS, EngineConfig

# Pick.reason values (also the `reason` label of the router's picks counter).
LEAST_LOAD = "least_load"  # one endpoint had the least load
TIE_BREAK = "tie_break"  # several had the least load; chosen at random
PREFIX_AFFINITY = "prefix_affinity"  # the endpoint that saw the prompt's prefix, loads within tolerance
ADAPTER_AFFINITY = "adapter_affinity"  # the request's model (a LoRA adapter) narrowed the endpoints
SATURATED = "saturated"  # no pick: every routable endpoint is at capacity
NONE_READY = "none_ready"  # no pick: no routable endpoint
ROUND_ROBIN = "round_robin"  # the comparison baseline (`iterserve router --policy round-robin`)
PICK_REASONS = (LEAST_LOAD, TIE_BREAK, PREFIX_AFFINITY, ADAPTER_AFFINITY, ROUND_ROBIN, SATURATED, NONE_READY)

DEFAULT_MAX_NUM_SEQS = EngineConfig.max_num_seqs  # the engine's default, assumed until a scrape says otherwise


@dataclass(frozen=True, slots=True)
class EndpointLoad:
    """One replica as the router sees it at the moment of a pick."""

    url: str
    in_flight: int = 0  # requests this router has sent and not yet seen finish
    waiting: int | None = None  # last scrape's queue depth; None: no fresh scrape
    running: int | None = None  # last scrape's running sequences; None: no fresh scrape
    max_num_seqs: int | None = None  # last scrape's batch cap; None: unknown
    routable: bool = True  # False while ejected after a connection error
    since_scrape: int = 0  # in_flight now minus in_flight when the scrape was taken
    last_picked: int = 0  # the router's pick sequence number when this endpoint was last chosen (0: never)
    models: frozenset[str] | None = None  # the base model and adapters it serves; None: not known
    active_adapters: frozenset[str] = frozenset()  # adapters with requests running or waiting there now

    def may_serve(self, model: str) -> bool:
        return self.models is None or model in self.models

    @property
    def load(self) -> int:
        if self.waiting is None and self.running is None:
            return self.in_flight
        scraped = (self.waiting or 0) + (self.running or 0) + self.since_scrape
        return max(scraped, self.in_flight)

    def capacity(self, max_queue: int) -> int:
        return (self.max_num_seqs or DEFAULT_MAX_NUM_SEQS) + max_queue


@dataclass(frozen=True, slots=True)
class PickPolicy:
    # Requests an endpoint may queue beyond its max_num_seqs before it is saturated: by default what the
    # engine itself queues, so the engines' waiting count (autoscaler, backlog alert) still sees the load.
    max_queue: int = DEFAULT_MAX_WAITING_REQUESTS
    affinity_tolerance: int = 4  # the prefix's endpoint wins while its load <= least load + this


@dataclass(frozen=True, slots=True)
class Pick:
    url: str | None  # None: nothing to pick, see reason
    reason: str
    load: int | None = None  # the picked endpoint's load before this request


def pick(endpoints: Sequence[EndpointLoad], rng: random.Random, policy: PickPolicy = PickPolicy(),
         affinity: str | None = None, model: str | None = None) -> Pick:
    routable = [e for e in endpoints if e.routable]
    if not routable:
        return Pick(None, NONE_READY)
    narrowed = False
    if model is not None:
        serving = [e for e in routable if e.may_serve(model)]
        if serving and len(serving) < len(routable):
            routable, narrowed = serving, True
    open_ = [e for e in routable if e.load < e.capacity(policy.max_queue)]
    if not open_:
        return Pick(None, SATURATED)
    least = min(e.load for e in open_)
    if model is not None:
        warm = [e for e in open_ if model in e.active_adapters and e.load <= least + policy.affinity_tolerance]
        if warm and len(warm) < len(open_):
            open_, narrowed = warm, True
    if affinity is not None:
        for e in open_:
            if e.url == affinity and e.load <= least + policy.affinity_tolerance:
                return Pick(e.url, ADAPTER_AFFINITY if narrowed else PREFIX_AFFINITY, e.load)
    least_here = min(e.load for e in open_)
    best = [e for e in open_ if e.load == least_here]
    if len(best) == 1:
        return Pick(best[0].url, ADAPTER_AFFINITY if narrowed else LEAST_LOAD, least_here)
    longest_ago = min(e.last_picked for e in best)
    return Pick(rng.choice([e for e in best if e.last_picked == longest_ago]).url,
                ADAPTER_AFFINITY if narrowed else TIE_BREAK, least_here)


class PickIndex:
    """`pick(endpoints in ascending order, rng, policy)` (no affinity, no model) over endpoints
    kept indexed: `update` one when its load, capacity, last_picked or routability changes,
    `remove` one that left, `pick` as often as wanted."""

    def __init__(self, policy: PickPolicy = PickPolicy()):
        self.policy = policy
        # Open endpoints' (load, last_picked, order, url); an entry that is not the url's current one is stale.
        self._heap: list[tuple[int, int, int, str]] = []
        self._current: dict[str, tuple[int, int, int, str]] = {}
        self._open_at: dict[int, int] = {}  # load -> how many open endpoints have it
        self._saturated: set[str] = set()  # routable, at capacity

    def __len__(self) -> int:
        return len(self._current) + len(self._saturated)

    def update(self, endpoint: EndpointLoad, order: int) -> None:
        """Enter or re-enter `endpoint`; `order` is its place in the sequence `pick` would be given
        (unique per url)."""
        url = endpoint.url
        self.remove(url)
        if not endpoint.routable:
            return
        load = endpoint.load
        if load >= endpoint.capacity(self.policy.max_queue):
            self._saturated.add(url)
            return
        entry = (load, endpoint.last_picked, order, url)
        self._current[url] = entry
        self._open_at[load] = self._open_at.get(load, 0) + 1
        heapq.heappush(self._heap, entry)
        if len(self._heap) > 2 * len(self._current) + 64:  # drop the stale entries
            self._heap = list(self._current.values())
            heapq.heapify(self._heap)

    def remove(self, url: str) -> None:
        entry = self._current.pop(url, None)
        if entry is None:
            self._saturated.discard(url)
            return
        left = self._open_at[entry[0]] - 1
        if left:
            self._open_at[entry[0]] = left
        else:
            del self._open_at[entry[0]]

    def pick(self, rng: random.Random) -> Pick:
        current, heap = self._current, self._heap
        if not current:
            return Pick(None, SATURATED if self._saturated else NONE_READY)
        while current.get(heap[0][3]) is not heap[0]:
            heapq.heappop(heap)
        load, last_picked, _, url = heap[0]
        if self._open_at[load] == 1:
            return Pick(url, LEAST_LOAD, load)
        # Several share the least load: pick() draws among those picked longest ago, in order
        # (the heap yields them in order), even when that is one endpoint.
        tied = []
        while heap:
            top = heap[0]
            if current.get(top[3]) is not top:
                heapq.heappop(heap)
            elif top[0] == load and top[1] == last_picked:
                tied.append(heapq.heappop(heap))
            else:
                break
        for entry in tied:
            heapq.heappush(heap, entry)
        return Pick(rng.choice([entry[3] for entry in tied]), TIE_BREAK, load)


def unknown_model(endpoints: Sequence[EndpointLoad], model: str) -> bool:
    """Whether no endpoint serves `model`, as far as the router can know: every endpoint's model
    list is known and none names it (then the router answers 404 itself)."""
    return bool(endpoints) and all(e.models is not None and model not in e.models for e in endpoints)


def pick_round_robin(endpoints: Sequence[EndpointLoad], turn: int, policy: PickPolicy = PickPolicy()) -> Pick:
    """The baseline: the turn-th open endpoint (by URL), whatever the loads; saturated and
    ejected endpoints are skipped as `pick` skips them."""
    routable = sorted((e for e in endpoints if e.routable), key=lambda e: e.url)
    if not routable:
        return Pick(None, NONE_READY)
    open_ = [e for e in routable if e.load < e.capacity(policy.max_queue)]
    if not open_:
        return Pick(None, SATURATED)
    chosen = open_[turn % len(open_)]
    return Pick(chosen.url, ROUND_ROBIN, chosen.load)
