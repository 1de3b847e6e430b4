"""The fleet of one InferenceService on a simulated clock: pods, routing, metrics, the autoscaler.

Pods go Pending (asked for, not created) -> Starting (created, loading the model: a start-up delay
drawn from a distribution) -> Ready -> Draining (deleted: no new requests, in-flight ones get
drainSeconds, then the rest are aborted) -> gone. A sampler reads each ready pod's engine stats
every scrape interval; the autoscaler ticks every `intervalSeconds` on samples at least `lag`
seconds old, through the operator's own pieces (settings_from_spec, memory, policy.decide,
config_max_num_seqs, the reconcile's effective_max_num_seqs) and applies max_num_seqs changes
with the engine's own set_max_num_seqs, the call the admin API makes.

Everything happens in one event queue ordered by (time, kind, sequence number), so a run is a
pure function of trace, spec, profile and seed.

A busy replica whose next steps are decode-only steps with a known outcome gets one event for the
whole run of them (Replica.fast_forward): its STEP event is due when the first step after the
run starts. Whatever reads a replica first brings it to where stepping would have left it
(`catch_up`: the scrape, the timeline); whatever changes it (a request routed to it, a
max_num_seqs change, the drain deadline) also ends the run there, and the next step runs for
real. `SimOptions.plain_loop` steps every step and scans every pod on each arrival: the
reference a test holds the fast loop to, byte for byte.

Least-load routing (the iterserve router) picks with the router's own rule on what the router
sees of each replica: max(its last scrape's queue + batch brought forward by its own sends and
finishes since, its in-flight count). With one router the scraped part never exceeds the
in-flight count (every request a replica holds came through it), so the load is the router's
in-flight count, whatever the scrape's age; the capacity is the replica's max_num_seqs (taken
current) plus maxQueue. The plain loop builds every ready pod's EndpointLoad from the engine on
each arrival and calls `pick`; the fast loop keeps the pods in a `PickIndex`, updated when a pod
gets a request, finishes one, is retuned, becomes ready or is deleted, and the two give the same
run.
"""

from __future__ import annotations

import bisect
import functools
import heapq
import itertools
import math
import random
from array import array
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from iterserve.operator.autoscaling import memory as mem
from iterserve.operator.autoscaling.policy import PodSample, decide
from iterserve.operator.autoscaling.report import config_max_num_seqs
from iterserve.operator.autoscaling.settings import settings_from_spec
from iterserve.operator.engine_config import engine_config_for
from iterserve.operator.resources import effective_max_num_seqs
from iterserve.replica_model.profile import StepProfile
from iterserve.replica_model.replica import Replica, RequestRecord
from iterserve.router.picking import EndpointLoad, PickIndex, PickPolicy
from iterserve.simulate.traces import TraceRequest

# Event kinds, in the order they run when due at the same instant.
POD_CREATE, POD_READY, ARRIVAL, STEP, SCRAPE, TICK, DRAIN_DEADLINE, ROUTER_TIMEOUT, TIMELINE = range(9)


@dataclass(frozen=True)
class Delay:
    """A start-up delay distribution: 'fixed:30' (or '30'), 'uniform:20:40', 'normal:60:10',
    'lognormal:60:20' (mean and standard deviation of the delay itself, in seconds)."""

    kind: str = "fixed"
    a: float = 30.0
    b: float = 0.0

    @classmethod
    def parse(cls, text: str | float) -> Delay:
        parts = str(text).split(":")
        try:
            if len(parts) == 1:
                return cls("fixed", float(parts[0]))
            if parts[0] == "fixed" and len(parts) == 2:
                return cls("fixed", float(parts[1]))
            if parts[0] in ("uniform", "normal", "lognormal") and len(parts) == 3:
                return cls(parts[0], float(parts[1]), float(parts[2]))
        except ValueError:
            pass
        raise ValueError(f"cannot read start-up delay {text!r}: write 30, uniform:20:40, normal:60:10 or lognormal:60:20")

    def draw(self, rng: random.Random) -> float:
        if self.kind == "fixed":
            return self.a
        if self.kind == "uniform":
            return rng.uniform(self.a, self.b)
        if self.kind == "normal":
            return max(0.0, rng.gauss(self.a, self.b))
        sigma2 = math.log(1 + (self.b / self.a) ** 2)
        return rng.lognormvariate(math.log(self.a) - sigma2 / 2, math.sqrt(sigma2))


@dataclass(frozen=True)
class SimOptions:
    seed: int = 0
    startup: Delay = field(default_factory=Delay)
    create_delay_s: float = 1.0  # spec.replicas raised -> the pod exists (controllers, scheduling)
    scrape_interval_s: float | None = None  # default: the autoscaler's interval
    metrics_lag_s: float = 0.0  # the autoscaler sees samples at least this old (Prometheus: ~scrape interval)
    # round-robin (a Service), least-load (the iterserve router's pick()); None: as the spec's
    # routing.mode deploys it (Router: least-load; None and Gateway: round-robin)
    router: str | None = None
    timeline_interval_s: float | None = None  # default: the autoscaler's interval, at least 1 s
    tail_s: float = 0.0  # keep the fleet (and the autoscaler) running this long after the last request
    initial_pods_ready: bool = True  # the spec's replicas are up at t=0 (False: they start then)
    # Give up this long after the last arrival (requests still open are reported "unfinished"):
    # a fleet at zero replicas that never scales up would otherwise tick forever.
    give_up_after_s: float = 3600.0
    # True: every engine step is an event, and each arrival scans every pod ever created for the
    # ready ones (the reference the fast loop is tested against; same results, slower).
    plain_loop: bool = False
    # True: least-load routing builds every ready pod's load on each arrival and calls pick(), as
    # the plain loop does, instead of keeping the pods in a PickIndex (same run; the reference).
    scan_routing: bool = False


@dataclass
class Pod:
    name: str
    created_at: float
    starts_with_seqs: int
    replica: Replica
    ready_at: float | None = None
    deleted_at: float | None = None
    gone_at: float | None = None
    stepping: bool = False  # a STEP event is queued
    step_event: int = 0  # which queued STEP event is current (an ended decode run leaves one behind)
    last_picked: int = 0  # the pick number when the router last chose this pod (0: never): ties rotate
    seen: tuple[int, int] = (-1, -1)  # in flight and max_num_seqs as the pick index last had them
    samples: deque = field(default_factory=lambda: deque(maxlen=64))

    @property
    def accepting(self) -> bool:
        return self.ready_at is not None and self.deleted_at is None


@dataclass
class Result:
    requests: list[RequestRecord]
    pods: list[Pod]
    timeline: list[dict]
    scale_events: list[dict]
    retunes: list[dict]
    decisions: dict[str, int]
    end: float
    gaps: array  # every inter-token gap (float64), pod by pod, in step order
    preemptions: int
    steps: int


Picker = Callable[[Sequence[Pod], int, random.Random], "Pod | None"]


def round_robin(pods: Sequence[Pod], counter: int, rng: random.Random) -> Pod:
    return pods[counter % len(pods)]


def least_load(pods: Sequence[Pod], counter: int, rng: random.Random, max_queue: int | None = None) -> Pod | None:
    """The router's own picking function (iterserve/router/picking.py) over every pod, fed what the
    router sees: its in-flight count per replica and the replica's queue and batch (the plain
    loop's reference; the fast loop picks from a PickIndex). None: every replica saturated (the
    router answers 429). max_queue: spec.routing.maxQueue (None: the router's default)."""
    from iterserve.router.picking import pick

    policy = PickPolicy() if max_queue is None else PickPolicy(max_queue=max_queue)
    loads = []
    for pod in pods:
        waiting, running, max_num_seqs = pod.replica.queue_and_batch()
        loads.append(EndpointLoad(pod.name, len(pod.replica.in_flight), waiting, running, max_num_seqs,
                                  last_picked=pod.last_picked))
    url = pick(loads, rng, policy).url  # once: a call inside the search below ran it once per pod
    chosen = next((p for p in pods if p.name == url), None)
    if chosen is not None:
        chosen.last_picked = counter + 1
    return chosen


def _router_queue_timeout(spec) -> float:
    """spec.routing.queueTimeoutSeconds, else the router's default."""
    from iterserve.router.proxy import RouterOptions

    routing = getattr(spec, "routing", None)
    if routing is not None and routing.queue_timeout_seconds is not None:
        return float(routing.queue_timeout_seconds)
    return RouterOptions().queue_timeout_s


def router_for(spec) -> str:
    """What sits in front of the pods when the spec is deployed."""
    routing = getattr(spec, "routing", None)
    return "least-load" if routing is not None and routing.mode == "Router" else "round-robin"


PICKERS: dict[str, Picker] = {"round-robin": round_robin, "least-load": least_load}


class ClusterSim:
    def __init__(self, spec, profile: StepProfile, trace: Sequence[TraceRequest], options: SimOptions,
                 progress: Callable[[float], None] | None = None):
        self.spec, self.profile, self.options = spec, profile, options
        self.settings = settings_from_spec(spec)
        auto = spec.autoscaling
        self.interval = float(auto.interval_seconds) if auto is not None else 15.0
        self.scrape_interval = options.scrape_interval_s or self.interval
        self.rng = random.Random(options.seed)  # start-up delays
        self.route_rng = random.Random(options.seed + 1)  # the router's tie breaks
        self.router = options.router or router_for(spec)
        self.picker = PICKERS[self.router]
        routing = getattr(spec, "routing", None)
        max_queue = routing.max_queue if routing is not None else None
        if self.picker is least_load and max_queue is not None:
            self.picker = functools.partial(least_load, max_queue=max_queue)
        # The fast loop's least-load routing: the accepting pods by load (the module docstring).
        self._index = None
        if self.picker is not round_robin and not (options.plain_loop or options.scan_routing):
            self._index = PickIndex(PickPolicy() if max_queue is None else PickPolicy(max_queue=max_queue))
        self.progress = progress
        self.records = [RequestRecord(i, r.arrival_s, r.prompt_tokens, r.output_tokens) for i, r in enumerate(trace)]
        self.events: list[tuple] = []
        self._order = itertools.count()
        self._names = itertools.count(1)
        self._rr = itertools.count()
        self.pods: list[Pod] = []
        # The accepting pods (ready, not deleted) in creation order, what routing picks from: kept
        # as pods change state, so an arrival costs the ready pods, not every pod ever created.
        self._accepting: list[Pod] = []
        self._order_of: dict[str, int] = {}
        self._by_name: dict[str, Pod] = {}
        self.replicas = spec.replicas
        self.configmap_seqs = spec.engine.max_num_seqs  # what new pods start with
        self.memory = mem.fresh_memory(spec.replicas, 0.0)
        self.router_queue: deque[RequestRecord] = deque()  # no ready pod yet
        self.saturated: deque[RequestRecord] = deque()  # the router's hold while every replica is full
        self.router_queue_timeout = _router_queue_timeout(spec)
        self.timeline: list[dict] = []
        self.scale_events: list[dict] = []
        self.retunes: list[dict] = []
        self.decisions: dict[str, int] = {}
        self.open_requests = 0
        self.now = 0.0
        self.kind = TIMELINE  # of the event being handled
        self._running: dict[str, Pod] = {}  # pods with planned decode-only steps (fast_forward)
        # Fail early on a spec whose engine could not start.
        self._configs = {spec.engine.max_num_seqs: engine_config_for(spec, spec.engine.max_num_seqs)}

    # -- events -------------------------------------------------------------------------------
    def _at(self, when: float, kind: int, payload=None) -> None:
        heapq.heappush(self.events, (when, kind, next(self._order), payload))

    def run(self) -> Result:
        for _ in range(self.spec.replicas):
            self._create_pod(0.0, ready=self.options.initial_pods_ready)
        for record in self.records:
            self._at(record.arrival, ARRIVAL, record)
        self.open_requests = len(self.records)
        if self.settings.mode != "Off":
            self._at(0.0, TICK)
        self._at(0.0, SCRAPE)
        timeline_every = self.options.timeline_interval_s or max(1.0, self.interval)
        self._at(0.0, TIMELINE, timeline_every)
        end = None
        last_arrival = max((r.arrival for r in self.records), default=0.0)
        give_up = last_arrival + self.options.give_up_after_s
        while self.events:
            when, kind, _, payload = heapq.heappop(self.events)
            if end is None and self.open_requests == 0:
                end = self.now + self.options.tail_s
            if (end is not None and when > end) or (end is None and when > give_up):
                break
            self.now = when
            if self.progress is not None:
                self.progress(when)
            self.kind = kind
            self._handle(kind, payload)
        for pod in self._running.values():  # the steps a plain loop would have run before stopping
            run = pod.replica.run
            pod.replica.catch_up(end if end is not None else give_up)
            if run.applied:
                self.now = max(self.now, run.starts[run.applied - 1])
        end = self.now if end is None else end
        for pod in self.pods:
            if pod.gone_at is None:
                pod.gone_at = end
        replicas = [p.replica for p in self.pods]
        gaps = array("d")
        for replica in replicas:
            gaps.extend(replica.gaps)
        return Result(self.records, self.pods, self.timeline, self.scale_events, self.retunes, self.decisions,
                      end, gaps, sum(r.engine.scheduler.num_preemptions for r in replicas),
                      sum(r.steps for r in replicas))

    def _handle(self, kind: int, payload) -> None:
        if kind == ARRIVAL:
            self._route(payload)
        elif kind == STEP:
            pod, event = payload
            if event == pod.step_event:
                self._step(pod)
        elif kind == POD_CREATE:
            if self.replicas > self._live_count():
                self._create_pod(self.now, ready=False)
        elif kind == POD_READY:
            self._ready(payload)
        elif kind == SCRAPE:
            self._scrape()
            self._at(self.now + self.scrape_interval, SCRAPE)
        elif kind == TICK:
            self._tick()
            self._at(self.now + self.interval, TICK)
        elif kind == DRAIN_DEADLINE:
            self._drain_deadline(payload)
        elif kind == ROUTER_TIMEOUT:
            if payload.pod is None and payload.status == "unfinished" and payload in self.saturated:
                self.saturated.remove(payload)
                payload.status = "rejected"
                payload.error = f"429: every replica saturated for {self.router_queue_timeout:g} s (router)"
                self.open_requests -= 1
        elif kind == TIMELINE:
            self._timeline_row(payload)
            self._at(self.now + payload, TIMELINE, payload)

    # -- pods ---------------------------------------------------------------------------------
    def _live(self) -> list[Pod]:
        return [p for p in self.pods if p.deleted_at is None]

    def _live_count(self) -> int:
        return sum(1 for p in self.pods if p.deleted_at is None)

    def _create_pod(self, now: float, ready: bool) -> None:
        seqs = effective_max_num_seqs(self.spec, self.configmap_seqs)
        if seqs not in self._configs:  # parsing the flags costs ~0.1 s: once per value, not per pod
            self._configs[seqs] = engine_config_for(self.spec, seqs)
        config, server = self._configs[seqs]
        name = f"pod-{next(self._names)}"
        pod = Pod(name, now, seqs, Replica(name, config, self.profile, server))
        self._order_of[name] = len(self.pods)
        self._by_name[name] = pod
        self.pods.append(pod)
        if ready:
            pod.ready_at = now
            self._accepting.append(pod)  # created in order: the index stays in creation order
            self._seen(pod)
        else:
            self._at(now + self.options.startup.draw(self.rng), POD_READY, pod)

    def _created_order(self, pod: Pod) -> int:
        return self._order_of[pod.name]

    def _ready(self, pod: Pod) -> None:
        if pod.deleted_at is not None:
            return
        pod.ready_at = self.now
        bisect.insort(self._accepting, pod, key=self._created_order)
        self._seen(pod)
        while self.router_queue:
            self._route(self.router_queue.popleft())

    def _set_replicas(self, desired: int) -> None:
        """The Deployment follows spec.replicas: new pods, or deletions (not-ready pods first,
        then the newest, as a ReplicaSet picks)."""
        previous, self.replicas = self.replicas, desired
        live = self._live()
        if desired > len(live):
            for _ in range(desired - len(live)):
                self._at(self.now + self.options.create_delay_s, POD_CREATE)
        elif desired < len(live):
            victims = sorted(live, key=lambda p: (p.ready_at is not None, -p.created_at, p.name))
            for pod in victims[: len(live) - desired]:
                self._delete(pod)
        return previous

    def _delete(self, pod: Pod) -> None:
        pod.deleted_at = self.now
        at = next((i for i, p in enumerate(self._accepting) if p is pod), None)
        if at is not None:
            del self._accepting[at]
        if self._index is not None:
            self._index.remove(pod.name)
        if not pod.replica.busy:
            pod.gone_at = self.now
            return
        self._at(self.now + pod.replica.server.drain_timeout, DRAIN_DEADLINE, pod)

    def _drain_deadline(self, pod: Pod) -> None:
        if pod.gone_at is not None:
            return
        self._end_run(pod)
        aborted = pod.replica.abort_all("drain timeout")
        self.open_requests -= len(aborted)
        pod.gone_at = self.now

    # -- requests -----------------------------------------------------------------------------
    def _route(self, record: RequestRecord, held: bool = False) -> bool:
        """Sends the request to a pod; False when the router is holding it."""
        ready = [p for p in self.pods if p.accepting] if self.options.plain_loop else self._accepting
        if not ready:
            self.router_queue.append(record)  # no endpoint yet: the client waits for one
            record.held = True
            return False
        if self._index is not None:
            counter, url = next(self._rr), self._index.pick(self.route_rng).url
            pod = None if url is None else self._by_name[url]
            if pod is not None:
                pod.last_picked = counter + 1
        else:
            pod = self.picker(ready, next(self._rr), self.route_rng)
        if pod is None:  # the router holds it until a replica has room, or answers 429
            if not held:
                self.saturated.append(record)
                self._at(self.now + self.router_queue_timeout, ROUTER_TIMEOUT, record)
            return False
        if held:
            self.saturated.remove(record)
        self._end_run(pod)
        submitted = pod.replica.submit(record, self.now)
        self._seen(pod, picked=True)
        if not submitted:
            self.open_requests -= 1
            return True
        if not pod.stepping:
            pod.stepping = True
            self._at(self.now, STEP, (pod, pod.step_event))
        return True

    def _retry_saturated(self) -> None:
        while self.saturated and self._route(self.saturated[0], held=True):
            pass

    def _step(self, pod: Pod) -> None:
        replica = pod.replica
        if replica.run is not None:  # the run's steps are all due: the replica stands after them
            replica.finish_run()
            del self._running[pod.name]
        if not self.options.plain_loop:
            resume = replica.fast_forward(self.now)
            if resume is not None:
                self._running[pod.name] = pod
                self._at(resume, STEP, (pod, pod.step_event))
                return
        before = len(replica.in_flight)
        end = replica.step(self.now)
        finished = before - len(replica.in_flight)
        self.open_requests -= finished
        if finished and pod.deleted_at is None:
            self._seen(pod)
        if finished and self.saturated:
            self._retry_saturated()
        if replica.busy and end > self.now:
            self._at(end, STEP, (pod, pod.step_event))
            return
        pod.stepping = False  # idle, or nothing schedulable until something changes
        if pod.deleted_at is not None and not replica.busy and pod.gone_at is None:
            pod.gone_at = self.now

    def _seen(self, pod: Pod, picked: bool = False) -> None:
        """The pick index follows the pod's in-flight count, max_num_seqs and (picked) last pick."""
        if self._index is None or not pod.accepting:
            return
        replica = pod.replica
        seen = (len(replica.in_flight), replica.engine.scheduler.max_num_seqs)
        if seen != pod.seen or picked:
            pod.seen = seen
            self._index.update(EndpointLoad(pod.name, seen[0], max_num_seqs=seen[1], last_picked=pod.last_picked),
                               self._order_of[pod.name])

    def _kick(self, pod: Pod) -> None:
        if not pod.stepping and pod.replica.busy and pod.gone_at is None:
            pod.stepping = True
            self._at(self.now, STEP, (pod, pod.step_event))

    def _end_run(self, pod: Pod) -> None:
        """The pod's engine is about to change now: its planned steps that a plain loop would have
        run by now apply (those due at this instant too when this event comes after STEP events),
        the rest are dropped, and its next step is an event of its own."""
        if pod.replica.run is None:
            return
        resume = pod.replica.end_run(self.now, inclusive=self.kind > STEP)
        del self._running[pod.name]
        pod.step_event += 1
        self._at(resume, STEP, (pod, pod.step_event))

    def _catch_up_all(self) -> None:
        """Before reading every pod (after this instant's STEP events): apply what is due."""
        for pod in self._running.values():
            pod.replica.catch_up(self.now, inclusive=self.kind > STEP)

    # -- metrics and the autoscaler -----------------------------------------------------------
    def _scrape(self) -> None:
        self._catch_up_all()
        for pod in self.pods:
            if not pod.accepting:
                continue
            stats = pod.replica.engine.stats()
            counters = pod.replica.counters
            pod.samples.append(PodSample(pod.name, self.now, waiting=float(stats.num_waiting),
                                         running=float(stats.num_running), kv_usage=stats.kv_usage,
                                         preemptions_total=float(stats.num_preemptions),
                                         max_num_seqs=float(stats.max_num_seqs),
                                         requests_total=float(counters.requests),
                                         prompt_tokens_total=float(counters.prompt_tokens),
                                         generation_tokens_total=float(counters.generation_tokens),
                                         ttft_buckets=counters.ttft.cumulative(),
                                         itl_buckets=counters.itl.cumulative()))

    def _tick(self) -> None:
        """Autoscaler.tick (operator/autoscaling/loop.py) with the pods, the scrape and the
        writes simulated: the same memory, decision and max_num_seqs bookkeeping."""
        settings, now = self.settings, self.now
        live = self._live()
        infos = [mem.PodInfo(p.name, p.created_at, p.ready_at) for p in live]
        seen_until = now - self.options.metrics_lag_s
        samples = []
        for pod in live:
            if pod.ready_at is None:
                continue
            latest = next((s for s in reversed(pod.samples) if s.at <= seen_until + 1e-9), None)
            if latest is not None and not any(s is latest for s in self.memory.history.get(pod.name, ())):
                samples.append(latest)
        self.memory = mem.record_samples(self.memory, samples, [p.name for p in infos], settings, now)
        # The router's held requests (no ready pod yet): the activator's signal, as router_source reads it.
        state = replace(mem.state_for(self.memory, self.replicas, infos), held_requests=float(len(self.router_queue)))
        decision = decide(settings, state, self.memory.history, now)
        self.decisions[decision.reason] = self.decisions.get(decision.reason, 0) + 1

        replicas_applied = False
        if settings.mode == "Builtin" and decision.replicas_changed:
            self._set_replicas(decision.desired_replicas)
            replicas_applied = True
            self.scale_events.append({"t": round(now, 6), "from": decision.current_replicas,
                                      "to": decision.desired_replicas, "reason": decision.reason})
        applied = []
        by_name = {p.name: p for p in live}
        for change in decision.seqs_changes:
            pod = by_name.get(change.pod)
            if pod is None or not pod.accepting:
                continue
            self._end_run(pod)
            pod.replica.engine.set_max_num_seqs(change.to_max_num_seqs)  # what PATCH /admin/config calls
            self._seen(pod)
            applied.append(change)
            self.retunes.append({"t": round(now, 6), "pod": change.pod, "from": change.from_max_num_seqs,
                                 "to": change.to_max_num_seqs, "reason": change.reason})
            self._kick(pod)
        self.memory = mem.record_decision(self.memory, decision, settings, now, replicas_applied, applied)
        if settings.mode == "Builtin" and (decision.metrics.available or applied):
            self.configmap_seqs = config_max_num_seqs(decision, applied, settings.spec_max_num_seqs)

    def _timeline_row(self, every: float) -> None:
        self._catch_up_all()
        pods = {}
        for pod in self.pods:
            if pod.gone_at is not None or pod.ready_at is None:
                continue
            stats = pod.replica.engine.stats()
            pods[pod.name] = {"waiting": stats.num_waiting, "running": stats.num_running,
                              "kv_usage": round(stats.kv_usage, 4), "max_num_seqs": stats.max_num_seqs,
                              "preemptions": stats.num_preemptions, "draining": pod.deleted_at is not None}
        live = self._live()
        self.timeline.append({
            "t": round(self.now, 6),
            "replicas_desired": self.replicas,
            "pods_starting": sum(1 for p in live if p.ready_at is None),
            "replicas_ready": sum(1 for p in live if p.ready_at is not None),
            "pods_draining": sum(1 for p in self.pods if p.deleted_at is not None and p.gone_at is None),
            "router_queue": len(self.router_queue),
            "pods": pods,
        })
