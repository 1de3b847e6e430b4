"""Replica planning for latency targets: what p95 TTFT and ITL one replica gives at a share of a
measured workload, by running the simulator's own replica (replica.py: the real LLMEngine,
Scheduler and BlockManager stepping in the profile's time) on a seeded synthetic trace, and the
fewest replicas (and the largest max_num_seqs) whose predictions meet the targets.

In: the pod's EngineConfig and server options, a StepProfile, a Workload (arrival rate over the
pool, mean prompt and output tokens: what the engines' counters give) and targets. Out:
Predictions. Pure: a prediction is a function of its arguments (seeded), so the autoscaler's
policy (operator/autoscaling/slo.py) calls it every tick, and a memo keeps repeated ticks cheap.

The trace a prediction runs: Poisson arrivals at rate/replicas (the router spreads load evenly),
lengths drawn uniformly in [0.5, 1.5] x the means (the counters give means only); the first
WARMUP_FRACTION of requests are left out of the p95s, as a replica at steady state is asked
about. A replica that cannot keep up shows it as a queue that grows over the horizon: its
predicted TTFT grows past any target, and a request its server would refuse (429) counts as
missing the target.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace

from iterserve.replica_model.profile import StepProfile
from iterserve.replica_model.replica import Replica, RequestRecord, ServerOptions

WARMUP_FRACTION = 0.2
MAX_REQUESTS = 240  # per prediction: enough for a p95 over the steady part, cheap enough per tick
MIN_HORIZON_S = 30.0
MAX_HORIZON_S = 600.0


@dataclass(frozen=True)
class Workload:
    arrival_rate: float  # requests per second over the whole pool
    prompt_tokens: float  # mean
    output_tokens: float  # mean

    def rounded(self) -> Workload:
        """Two significant figures: ticks whose measurements differ by noise share a prediction."""
        def r(x: float) -> float:
            return float(f"{x:.2g}") if x > 0 else 0.0
        return Workload(r(self.arrival_rate), max(1.0, r(self.prompt_tokens)), max(1.0, r(self.output_tokens)))


@dataclass(frozen=True)
class Prediction:
    replicas: int
    max_num_seqs: int
    ttft_p95_s: float  # inf: requests refused, or none finished
    itl_p95_s: float
    requests: int

    def meets(self, ttft_s: float | None, itl_s: float | None, factor: float = 1.0) -> bool:
        return ((ttft_s is None or self.ttft_p95_s <= ttft_s * factor)
                and (itl_s is None or self.itl_p95_s <= itl_s * factor))


def _p95(values: list[float]) -> float:
    if not values:
        return math.inf
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(0.95 * len(ordered)) - 1)]


def _trace(workload: Workload, replicas: int, seed: int) -> list[RequestRecord]:
    rate = workload.arrival_rate / replicas
    count = int(min(MAX_REQUESTS, max(MIN_HORIZON_S * rate, 40)))
    rng = random.Random(seed)
    records, at = [], 0.0
    for index in range(count):
        at += rng.expovariate(rate)
        if at > MAX_HORIZON_S:
            break
        prompt = max(1, round(workload.prompt_tokens * rng.uniform(0.5, 1.5)))
        output = max(1, round(workload.output_tokens * rng.uniform(0.5, 1.5)))
        records.append(RequestRecord(index, at, prompt, output))
    return records


def predict(engine, server: ServerOptions, profile: StepProfile, workload: Workload, replicas: int,
            max_num_seqs: int, seed: int = 0) -> Prediction:
    """p95 TTFT and ITL of one of `replicas` replicas taking its share of `workload`."""
    key = (repr(engine), server, profile.to_json(), workload.rounded(), replicas, max_num_seqs, seed)
    found = _MEMO.get(key)
    if found is None:
        found = _predict(engine, server, profile, workload.rounded(), replicas, max_num_seqs, seed)
        if len(_MEMO) >= MEMO_SIZE:
            _MEMO.pop(next(iter(_MEMO)))
        _MEMO[key] = found
    return found


MEMO_SIZE = 512
_MEMO: dict[tuple, Prediction] = {}  # a pure function's answers (the configs' reprs name them in full)


def _predict(engine, server, profile, workload: Workload, replicas: int, max_num_seqs: int,
             seed: int, fast: bool = True) -> Prediction:
    if workload.arrival_rate <= 0:
        return Prediction(replicas, max_num_seqs, 0.0, 0.0, 0)
    config = replace(engine, max_num_seqs=max_num_seqs,
                     max_num_batched_tokens=max(engine.max_num_batched_tokens or 0, max_num_seqs) or None)
    replica = Replica("plan", config, profile, server)
    records = _trace(workload, replicas, seed)
    refused = False
    next_index = 0
    while next_index < len(records) or replica.busy:
        if not replica.busy:
            replica.clock.now = max(replica.clock.now, records[next_index].arrival)
        while next_index < len(records) and records[next_index].arrival <= replica.clock.now:
            record = records[next_index]
            refused |= not replica.submit(record, replica.clock.now)
            next_index += 1
        if replica.busy:
            before = replica.clock.now
            resume = replica.fast_forward(before) if fast else None
            if resume is not None:  # decode-only steps until the next arrival joins (replica.py)
                if next_index < len(records) and records[next_index].arrival < resume:
                    replica.end_run(records[next_index].arrival, inclusive=False)
                else:
                    replica.finish_run()
                continue
            replica.step(replica.clock.now)
            if replica.clock.now <= before and replica.busy and next_index < len(records):
                replica.clock.now = records[next_index].arrival  # nothing schedulable until the next arrival
            elif replica.clock.now <= before and replica.busy:
                refused = True  # stuck: a request that never fits counts as missing the target
                break
    steady = records[int(len(records) * WARMUP_FRACTION):]
    ttfts = [r.first_token - r.arrival for r in steady if r.first_token is not None]
    itl = _p95(list(replica.gaps))  # every gap, as the engine's ITL histogram observes them
    if refused or len(ttfts) < len(steady):
        return Prediction(replicas, max_num_seqs, math.inf, itl, len(steady))
    return Prediction(replicas, max_num_seqs, _p95(ttfts), itl, len(steady))


@dataclass(frozen=True)
class Plan:
    replicas: int  # the fewest within bounds that meet the targets (max_replicas when none does)
    max_num_seqs: int  # the largest that meets the ITL target at those replicas (the spec's when it does not bind)
    prediction: Prediction
    met: bool  # False: even max_replicas misses a target (the plan is the best there is)


def seqs_candidates(spec_seqs: int, floor: int) -> list[int]:
    """max_num_seqs values tried when the ITL target binds, largest first: halving to the floor."""
    out, value = [], spec_seqs
    while value > floor:
        out.append(value)
        value //= 2
    out.append(max(1, floor))
    return out


def plan(engine, server: ServerOptions, profile: StepProfile, workload: Workload, min_replicas: int,
         max_replicas: int, ttft_s: float | None, itl_s: float | None, factor: float = 1.0,
         seqs_floor: int = 1) -> Plan:
    """The fewest replicas in [min_replicas, max_replicas] (at least 1) whose predictions meet
    targets x factor, with the largest max_num_seqs that does (predictions are taken to improve
    with replicas: a binary search). `factor` < 1 asks for headroom (the hysteresis band)."""
    spec_seqs = engine.max_num_seqs
    candidates = seqs_candidates(spec_seqs, seqs_floor) if itl_s is not None else [spec_seqs]

    def best(replicas: int) -> Prediction | None:
        for seqs in candidates:
            prediction = predict(engine, server, profile, workload, replicas, seqs)
            if prediction.meets(ttft_s, itl_s, factor):
                return prediction
            if itl_s is not None and prediction.itl_p95_s <= itl_s * factor:
                return None  # ITL met, TTFT not: fewer seqs only lengthens the queue
        return None

    low, high = max(1, min_replicas), max(1, max_replicas)
    top = best(high)
    if top is None:  # no count meets them: the most replicas, at the spec's max_num_seqs (a cap would only lengthen the queue)
        return Plan(high, spec_seqs, predict(engine, server, profile, workload, high, spec_seqs), False)
    found = top
    while low < high:
        middle = (low + high) // 2
        prediction = best(middle)
        if prediction is None:
            low = middle + 1
        else:
            high, found = middle, prediction
    return Plan(found.replicas, found.max_num_seqs, found, True)
