"""The SLO policy's step profile fitted online on the decode pods' own steps: each tick reads the
step records every warm decode pod made since the last read (`GET /admin/steps`, engine_admin.py,
with the admin token; a multi-node group's leader only, as hook.py hands the pods over) into the
InferenceService's one OnlineProfile (iterserve/replica_model/online.py), and the tick's SLO
reading plans with that profile's choice (`with_online_profile`: the settings carry it, so the
policy stays pure).

In: the pool's pods (name, URL, when their warm-up ends on the operator's clock). Out: the feed's
OnlineProfile, fed. Guard rails:
  - Records from a pod's warm-up are left out, as the policy leaves out its samples: a record's
    `time` is on the engine's monotonic clock, placed on the operator's through the answer's
    `now` (an answer read at T with now N puts a record of time t at T - (N - t)).
  - Bounded per tick: at most MAX_PODS_READ pods (in turn, when the pool has more), RECORDS_PER_TICK
    records over all of them, each answer STEPS_MAX_BYTES within the scrape deadline, the calls
    concurrent; a pod whose answer is malformed, too large or slow is skipped this tick (its
    cursor stays) and one malformed record is dropped and counted (OnlineProfile.dropped), so no
    pod can break the tick or poison the fit.
  - The feed starts over when the model, the engine settings or the given profile change.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from iterserve.engine.server.protocol import MAX_STEP_RECORDS_PER_CALL
from iterserve.operator.autoscaling.engine_admin import AdminError, EngineAdmin
from iterserve.operator.autoscaling.settings import Settings
from iterserve.replica_model.online import OnlineProfile

MAX_PODS_READ = 16  # pods read per tick; a larger pool is read in turn
RECORDS_PER_TICK = 2048  # records asked for per tick over all pods read (the window holds 2000)
MIN_RECORDS_PER_POD = 64


@dataclass(frozen=True)
class StepSource:
    """A decode pod the feed may read: its base URL and when its warm-up ends (operator clock)."""

    name: str
    url: str
    warm_from: float


@dataclass
class StepFeed:
    """One InferenceService's online profile and where each pod's reading stands."""

    online: OnlineProfile
    fingerprint: str  # what the steps describe: a change starts the feed over
    cursors: dict[str, int] = field(default_factory=dict)  # pod -> the last seq read
    turn: int = 0  # where this tick's pods start, when there are more than MAX_PODS_READ
    warming: int = 0  # records left out as the warm-up's
    errors: dict[str, str] = field(default_factory=dict)  # pod -> its last read's failure

    async def read(self, admin: EngineAdmin, pods: Sequence[StepSource], clock: Callable[[], float]) -> int:
        """Reads this tick's records into the OnlineProfile; returns how many it kept (warm)."""
        live = {p.name for p in pods}
        self.cursors = {name: seq for name, seq in self.cursors.items() if name in live}
        self.errors = {}
        now = clock()
        warm = sorted((p for p in pods if now >= p.warm_from), key=lambda p: p.name)
        if not warm:
            return 0
        start = self.turn % len(warm)
        chosen = (warm[start:] + warm[:start])[:MAX_PODS_READ]
        self.turn = start + len(chosen)  # the next tick starts with the first pod not read
        limit = min(MAX_STEP_RECORDS_PER_CALL, max(MIN_RECORDS_PER_POD, RECORDS_PER_TICK // len(chosen)))
        counts = await asyncio.gather(*(self._read_one(admin, pod, limit, clock) for pod in chosen))
        return sum(counts)

    async def _read_one(self, admin: EngineAdmin, pod: StepSource, limit: int, clock: Callable[[], float]) -> int:
        cursor = self.cursors.get(pod.name, 0)
        try:
            page = await admin.steps(pod.url, cursor, limit)
        except AdminError as error:
            self.errors[pod.name] = str(error)[:300]
            return 0
        received = clock()
        # A newest seq below the cursor: the engine restarted and numbers from 1 again.
        self.cursors[pod.name] = 0 if page.last_seq < cursor else page.next_after
        kept = []
        for record in page.records:
            at = record.get("time") if isinstance(record, dict) else None
            if isinstance(at, bool) or not isinstance(at, int | float) or not math.isfinite(at):
                self.online.dropped += 1
            elif received - (page.now - at) < pod.warm_from:
                self.warming += 1
            else:
                kept.append(record)
        self.online.observe(kept)
        return len(kept)


def fingerprint(spec) -> str:
    """What a step's time depends on: the model, the engine's settings (max_num_seqs aside: the
    autoscaler changes that live), the given profile."""
    return "|".join((spec.model.model_dump_json(), spec.engine.model_dump_json(exclude={"max_num_seqs"}),
                     spec.autoscaling.slo.step_profile))


def with_online_profile(settings: Settings, online: OnlineProfile) -> Settings:
    """The settings whose SLO reading plans with the online profile's current choice."""
    profile, _ = online.current()
    return replace(settings, slo=replace(settings.slo, profile=profile, profile_choice=online.choice()))
