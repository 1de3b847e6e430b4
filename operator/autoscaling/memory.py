"""What the autoscaler remembers between ticks for one pool of one InferenceService (the loop keeps
one Memory per pool): recent samples per pod, its raw proposals, the replica changes it made and
the max_num_seqs it set on each pod.

Pure functions over a frozen value, so the operator's timer and the simulator keep it the same
way. Lost on operator restart: `fresh_memory` seeds it with the current replicas as a proposal,
so a restarted operator scales down only after a full scale-down window of its own readings.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

from iterserve.operator.autoscaling.policy import (
    Decision,
    PodSample,
    PodState,
    Recommendation,
    ScaleEvent,
    SeqsChange,
    Settings,
    State,
)

MAX_SAMPLES_PER_POD = 240


@dataclass(frozen=True)
class PodSeqs:
    max_num_seqs: int
    changed_at: float


@dataclass(frozen=True)
class Memory:
    history: dict[str, tuple[PodSample, ...]] = field(default_factory=dict)
    recommendations: tuple[Recommendation, ...] = ()
    scale_events: tuple[ScaleEvent, ...] = ()
    last_scale_up_at: float | None = None
    seqs: dict[str, PodSeqs] = field(default_factory=dict)


def fresh_memory(replicas: int, now: float) -> Memory:
    return Memory(recommendations=(Recommendation(now, replicas),))


@dataclass(frozen=True)
class PodInfo:
    """A pod as the API shows it (terminating pods excluded by the caller)."""

    name: str
    created_at: float
    ready_at: float | None


def record_samples(memory: Memory, samples: Iterable[PodSample], live_pods: Sequence[str],
                   settings: Settings, now: float) -> Memory:
    """Adds this tick's samples, forgets pods that are gone and samples too old to matter."""
    keep_from = now - settings.memory_seconds
    history = {name: memory.history.get(name, ()) for name in live_pods}
    for sample in samples:
        if sample.pod in history:
            history[sample.pod] = history[sample.pod] + (sample,)
    history = {name: tuple(s for s in kept if s.at >= keep_from)[-MAX_SAMPLES_PER_POD:]
               for name, kept in history.items()}
    seqs = {name: value for name, value in memory.seqs.items() if name in history}
    return replace(memory, history=history, seqs=seqs)


def state_for(memory: Memory, replicas: int, pods: Sequence[PodInfo]) -> State:
    return State(
        replicas=replicas,
        pods=tuple(PodState(p.name, p.created_at, p.ready_at,
                            memory.seqs[p.name].max_num_seqs if p.name in memory.seqs else None,
                            memory.seqs[p.name].changed_at if p.name in memory.seqs else None)
                   for p in pods),
        recommendations=memory.recommendations,
        scale_events=memory.scale_events,
        last_scale_up_at=memory.last_scale_up_at,
    )


def record_decision(memory: Memory, decision: Decision, settings: Settings, now: float,
                    replicas_applied: bool, seqs_applied: Sequence[SeqsChange]) -> Memory:
    """Remembers the proposal, and the changes that were actually carried out."""
    keep_from = now - settings.memory_seconds
    recommendations = memory.recommendations
    if decision.recommendation is not None:
        recommendations = recommendations + (decision.recommendation,)
    scale_events, last_up = memory.scale_events, memory.last_scale_up_at
    if replicas_applied and decision.replicas_changed:
        scale_events = scale_events + (ScaleEvent(now, decision.current_replicas, decision.desired_replicas),)
        if decision.desired_replicas > decision.current_replicas:
            last_up = now
    seqs = dict(memory.seqs)
    for change in seqs_applied:
        seqs[change.pod] = PodSeqs(change.to_max_num_seqs, now)
    return replace(
        memory,
        recommendations=tuple(r for r in recommendations if r.at >= keep_from),
        scale_events=tuple(e for e in scale_events if e.at >= keep_from),
        last_scale_up_at=last_up,
        seqs=seqs,
    )
