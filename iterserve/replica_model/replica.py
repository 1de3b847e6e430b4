"""One simulated engine replica: the real LLMEngine, Scheduler and BlockManager, with the KV pool
the spec's kvCacheMemory buys for the profiled model, a clock of its own, and an executor that
samples no model: a step "takes" the profile's time, which advances the replica's clock.

Fast-forward: most steps of a busy replica are decode-only steps whose outcome is known in
advance (the same running sequences, each one token longer, no arrival, no finish, a KV block
taken exactly where a sequence crosses a block boundary while the pool has room). `fast_forward`
plans such a run of steps in one go (their start times, from the profile, to the same bits as
stepping) and `catch_up` applies them when something is about to read the replica: tokens, block
tables (through the block manager's own allocate and prefix-cache naming, in step order),
request records, the TTFT/ITL histograms and every inter-token gap, step counters and the clock
end exactly where stepping would leave them. The real engine step runs whenever the outcome is
not known in advance: an arrival, a finish, a preemption, a cap change, a prompt chunk.

The engine options come from the spec through the operator's own `engine_args` and the server's
own flag parser (operator/engine_config.py), so a replica runs with exactly the options a pod would.
"""

from __future__ import annotations

import functools
from array import array
from bisect import bisect_left, bisect_right
from dataclasses import dataclass, field, replace

import numpy as np

from iterserve.engine.config import EngineConfig, kv_pool_blocks
from iterserve.engine.fake_executor import FAKE_KV_BYTES_PER_TOKEN, FAKE_MODEL, FakeExecutor
from iterserve.engine.llm_engine import LLMEngine
from iterserve.engine.sampling_params import InvalidRequestError, SamplingParams
from iterserve.engine.step_log import StepRecords
from iterserve.replica_model.profile import StepFeatures, StepProfile

PROMPT_TOKEN = 100  # every simulated prompt token; the fake executor's tokens depend on it only
# Trace prompts share no KV block (prompt_tokens), so a prefix-cache lookup can never hit: the
# requests skip it (hashing every prompt block was a quarter of a large fleet's run). Which
# physical blocks a sequence gets changes; nothing the simulator reports does. Tests set False.
SKIP_PREFIX_CACHE = True


def prompt_tokens(index: int, count: int) -> list[int]:
    """A prompt of `count` tokens that shares no KV block with another request's (a trace says
    nothing of content, so no prefix-cache hits are assumed)."""
    return [PROMPT_TOKEN + index] + [PROMPT_TOKEN] * (count - 1)


@functools.lru_cache(maxsize=4096)
def _params(max_tokens: int, skip_prefix_cache: bool) -> SamplingParams:
    """A request's sampling parameters, built (and validated) once per length: the engine only reads them."""
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0, skip_prefix_cache=skip_prefix_cache)


class SimClock:
    def __init__(self, now: float = 0.0):
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class _NoText:
    """The simulator reads token counts, never text: nothing to decode, no EOS to stop at."""

    eos_token_id = None
    vocab_size = None

    def decode(self, token_ids, skip_special_tokens: bool = True) -> str:
        return ""


@dataclass(frozen=True)
class ServerOptions:
    """What the pod's `iterserve serve` does around the engine."""

    max_waiting_requests: int = 256
    drain_timeout: float = 30.0


def kv_blocks(config: EngineConfig, profile: StepProfile) -> tuple[int, int]:
    """GPU and CPU blocks, as the model runner sizes them for the profiled model."""
    return kv_pool_blocks(config, profile.kv_bytes_per_token)


@dataclass
class RequestRecord:
    """One trace request as the simulation saw it (times in simulated seconds)."""

    index: int
    arrival: float
    prompt_tokens: int
    output_tokens: int
    pod: str | None = None
    status: str = "unfinished"  # ok | rejected | invalid | aborted | unfinished
    first_token: float | None = None
    last_token: float | None = None
    tokens: int = 0
    max_gap: float = 0.0
    finish_reason: str | None = None
    error: str | None = None
    held: bool = False  # arrived while no replica was ready: the router held it (a cold start)


class Histogram:
    """A Prometheus histogram's cumulative buckets, as the engine's /metrics would show them."""

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)

    def observe(self, value: float, count: int = 1) -> None:
        self.counts[bisect_left(self.bounds, value)] += count

    def cumulative(self) -> tuple[tuple[float, float], ...]:
        out, total = [], 0
        for bound, count in zip((*self.bounds, float("inf")), self.counts, strict=True):
            total += count
            out.append((bound, float(total)))
        return tuple(out)


@dataclass
class EngineCounters:
    """What the engine's server counts and the autoscaler reads (SLO mode): finished requests,
    their prompt and generated tokens, and the TTFT and ITL histograms with the engine's buckets."""

    requests: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    ttft: Histogram = field(default_factory=lambda: Histogram(_buckets()[0]))
    itl: Histogram = field(default_factory=lambda: Histogram(_buckets()[1]))


def _buckets() -> tuple[tuple[float, ...], tuple[float, ...]]:
    from iterserve.engine.server.metrics import ITL_BUCKETS, TTFT_BUCKETS

    return TTFT_BUCKETS, ITL_BUCKETS


@dataclass
class DecodeRun:
    """Decode-only steps planned by Replica.fast_forward and not all applied yet."""

    seqs: list  # the running sequences, in the order the scheduler serves them
    records: list[RequestRecord]  # theirs
    computed: list[int]  # each one's computed tokens when the run starts
    starts: list[float]  # starts[j]: when step j starts; starts[-1]: when the step after the run starts
    # (step, 0: a KV block taken before it runs | 1: a block named in the prefix cache after it, sequence)
    block_events: list[tuple[int, int, int]]
    applied: int = 0  # steps applied so far
    next_event: int = 0

    @property
    def steps(self) -> int:
        return len(self.starts) - 1


MIN_RUN_STEPS = 2  # a shorter run is cheaper as real steps
SHORT_RUN = 12  # up to this many steps, plain Python beats numpy's cost per call


@dataclass
class Replica:
    """An engine pod's engine. `step()` runs one engine step at the replica's clock; `fast_forward`
    and `catch_up` run many decode-only steps at once (the module docstring)."""

    name: str
    config: EngineConfig
    profile: StepProfile
    server: ServerOptions = field(default_factory=ServerOptions)
    clock: SimClock = field(default_factory=SimClock)
    engine: LLMEngine = field(init=False)
    in_flight: dict[str, RequestRecord] = field(default_factory=dict)
    gaps: array = field(default_factory=lambda: array("d"))  # every inter-token gap, for ITL percentiles
    steps: int = 0
    counters: EngineCounters = field(default_factory=EngineCounters)
    run: DecodeRun | None = None  # planned decode-only steps (fast_forward)
    fast_steps: int = 0  # steps applied by catch_up rather than run by the engine

    def __post_init__(self) -> None:
        config = replace(self.config, step_log=None).resolve(self.profile.model_context_len)
        gpu, cpu = kv_blocks(config, self.profile)
        config.check_kv_capacity(gpu, cpu)
        self.config = config
        executor = FakeExecutor(gpu, cpu, step_time=self.profile, sleep=self.clock.advance)
        self.engine = LLMEngine(config, executor, _NoText(), clock=self.clock, model_name="simulated")
        # Nothing reads a simulated replica's step records (GET /admin/steps is a server's): a
        # one-record ring instead of the engine's 4096 keeps a 1,000-replica fleet ~1.3 GiB smaller.
        self.engine.step_records = StepRecords(capacity=1)

    @property
    def num_kv_blocks(self) -> int:
        return self.engine.block_manager.num_blocks

    def submit(self, record: RequestRecord, now: float) -> bool:
        """Like the server: 429 past max_waiting_requests, 400 for a prompt that cannot fit."""
        assert self.run is None, "apply or end the planned decode run first"
        record.pod = self.name
        if self.engine.stats().num_waiting >= self.server.max_waiting_requests:
            record.status, record.error = "rejected", "429: waiting queue full"
            return False
        try:
            self.engine.add_request(
                prompt_token_ids=prompt_tokens(record.index, record.prompt_tokens),
                params=_params(record.output_tokens, SKIP_PREFIX_CACHE),
                request_id=str(record.index), arrival_time=now)
        except InvalidRequestError as error:
            record.status, record.error = "invalid", f"400: {error}"
            return False
        self.in_flight[str(record.index)] = record
        return True

    def step(self, now: float) -> float:
        """One engine step starting at `now` (or when the previous one ended); returns its end."""
        assert self.run is None, "apply or end the planned decode run first"
        self.clock.now = max(self.clock.now, now)
        outputs = self.engine.step()
        self.steps += 1
        end = self.clock.now
        for output in outputs:
            record = self.in_flight.get(output.request_id)
            if record is None:
                continue
            if output.outputs[0].new_token_ids:
                if record.first_token is None:
                    record.first_token = end
                    self.counters.ttft.observe(end - record.arrival)
                else:
                    gap = end - record.last_token
                    self.gaps.append(gap)
                    self.counters.itl.observe(gap)
                    record.max_gap = gap if gap > record.max_gap else record.max_gap
                record.last_token = end
                record.tokens += 1
            if output.finished:
                reason = output.outputs[0].finish_reason
                record.finish_reason = reason
                record.status = "aborted" if reason == "abort" else "ok"
                del self.in_flight[output.request_id]
                self.counters.requests += 1
                self.counters.prompt_tokens += record.prompt_tokens
                self.counters.generation_tokens += record.tokens
        return end

    # -- fast-forward ---------------------------------------------------------------------------
    def fast_forward(self, now: float) -> float | None:
        """Plan the steps from `now` on whose outcome is known in advance: decode-only steps of the
        same running sequences, up to the step before the first one finishes (max_tokens or the
        model length) and before the first KV block the pool cannot give. Nothing is applied
        (catch_up does that). Returns when the first step after them starts, or None when the
        step at `now` must run for real."""
        engine = self.engine
        sched, blocks = engine.scheduler, engine.block_manager
        # The engine's queues for the next step (requests, aborts, a cap change) must be empty:
        # read directly, as nothing public says so (the simulator runs this engine on purpose).
        if (self.run is not None or not sched.running or engine._inbox or engine._aborts or sched.waiting
                or sched.swapped or sched.waiting_for_kv or sched._pending_max_num_seqs is not None
                or engine.proposer is not None or (engine.kv_connector is not None and engine.kv_connector._leases)
                or not isinstance(engine.tokenizer, _NoText)
                or len(sched.running) > self.config.max_num_batched_tokens):
            return None
        seqs = list(sched.running)
        size, cache, limit = blocks.block_size, blocks.prefix_cache, self.config.max_model_len
        records, computed = [], []
        steps = None
        for seq in seqs:
            record = self.in_flight.get(seq.request_id)
            params, done = seq.params, seq.num_computed_tokens
            if (record is None or record.first_token is None or not seq.output_token_ids
                    or done != seq.num_tokens - 1 or seq.spec_token_ids or params.stop or params.stop_token_set
                    or seq.kv_transfer is not None
                    or params.logprobs is not None or not (params.ignore_eos or seq.eos_token_id is None)
                    or size * len(seq.block_table) < done
                    or (cache is not None and not params.skip_prefix_cache and seq.num_cached_blocks != done // size)):
                return None
            records.append(record)
            computed.append(done)
            # the step that appends the token reaching max_tokens or the model length finishes it
            left = min(params.max_tokens - len(seq.output_token_ids), limit - seq.num_tokens) - 1
            steps = left if steps is None or left < steps else steps
        if steps < MIN_RUN_STEPS:
            return None
        events = []
        for i, seq in enumerate(seqs):
            events.extend((j, 0, i) for j in range(size * len(seq.block_table) - computed[i], steps, size))
            if cache is not None and not seq.params.skip_prefix_cache:
                events.extend((j, 1, i) for j in range(-(computed[i] + 1) % size, steps, size))
        if events:
            events.sort()
            free, taken = blocks.num_free_blocks, 0
            for j, kind, _ in events:
                taken += kind == 0
                if taken > free:  # this step would preempt: it runs for real
                    steps = j
                    events = [e for e in events if e[0] < steps]
                    break
        if steps < MIN_RUN_STEPS:
            return None
        n, context, longest = len(seqs), sum(computed) + len(seqs), max(computed) + 1
        if steps <= SHORT_RUN:  # numpy's fixed cost is more than a few steps' worth
            durations = [self.profile.step_seconds(StepFeatures(0, n, context + n * j, n, longest + j))
                         for j in range(steps)]
        else:
            durations = self.profile.decode_steps_seconds(n, context, longest, steps).tolist()
        if min(durations) <= 0:  # a step taking no time leaves the replica idle: stepping stops there
            steps = next(j for j, d in enumerate(durations) if d <= 0)
            events = [e for e in events if e[0] < steps]
            if steps < MIN_RUN_STEPS:
                return None
        # clock.advance adds each step's time in turn
        starts = [max(self.clock.now, now)]
        for d in durations[:steps]:
            starts.append(starts[-1] + d)
        self.run = DecodeRun(seqs, records, computed, starts, events)
        return starts[-1]

    def catch_up(self, until: float, inclusive: bool = True) -> None:
        """Apply the planned steps that start before `until` (inclusive: or at it)."""
        run = self.run
        if run is None:
            return
        target = (bisect_right if inclusive else bisect_left)(run.starts, until, 0, run.steps)
        if target > run.applied:
            self._apply(run, target)

    def end_run(self, now: float, inclusive: bool) -> float:
        """Something is about to change this engine at `now`: apply the planned steps before it,
        drop the rest; returns when the next (real) step starts."""
        self.catch_up(now, inclusive)
        run, self.run = self.run, None
        return run.starts[run.applied]

    def finish_run(self) -> None:
        """The run's last step is done (its next step is due): apply them all."""
        run, self.run = self.run, None
        if run.applied < run.steps:
            self._apply(run, run.steps)

    def _apply(self, run: DecodeRun, target: int) -> None:
        """What engine.step() and step() would have done over steps run.applied .. target - 1."""
        engine, blocks = self.engine, self.engine.block_manager
        first, count = run.applied, target - run.applied
        token_after = engine.executor.token_after
        for seq in run.seqs:  # the fake model's tokens (the executor's rule), appended as sampled
            tokens = seq.output_token_ids
            last, position = tokens[-1], seq.num_tokens
            for _ in range(count):
                last = token_after(last, position)
                tokens.append(last)
                position += 1
        events, e = run.block_events, run.next_event
        while e < len(events) and events[e][0] < target:
            j, kind, i = events[e]
            seq = run.seqs[i]
            if kind == 0:  # the scheduler's allocate, before step j
                seq.num_computed_tokens = run.computed[i] + j
                blocks.allocate(seq, 1)
            else:  # the scheduler's update, after step j
                seq.num_computed_tokens = run.computed[i] + j + 1
                blocks.cache_computed_blocks(seq)
            e += 1
        run.next_event = e
        for seq, done in zip(run.seqs, run.computed, strict=True):
            seq.num_computed_tokens = done + target
        starts, itl, gaps = run.starts, self.counters.itl, self.gaps
        end = starts[first + 1]
        for record in run.records:  # the first step's gaps: from each request's own last token
            gap = end - record.last_token
            gaps.append(gap)
            itl.observe(gap)
            record.max_gap = gap if gap > record.max_gap else record.max_gap
        if 1 < count <= SHORT_RUN:  # later steps: every request's gap is the previous step's length
            n = len(run.records)
            later = [starts[j + 1] - starts[j] for j in range(first + 1, target)]
            for gap in later:
                itl.observe(gap, n)
                gaps.extend((gap,) * n)
            top = max(later)
            for record in run.records:
                record.max_gap = top if top > record.max_gap else record.max_gap
        elif count > SHORT_RUN:
            n = len(run.records)
            times = np.asarray(starts[first + 1 : target + 1])
            later = times[1:] - times[:-1]
            for bucket, hits in enumerate(np.bincount(np.searchsorted(itl.bounds, later, side="left"),
                                                      minlength=len(itl.counts)).tolist()):
                if hits:
                    itl.counts[bucket] += hits * n
            gaps.frombytes(np.repeat(later, n).tobytes())
            top = float(later.max())
            for record in run.records:
                record.max_gap = top if top > record.max_gap else record.max_gap
        end = starts[target]
        for seq, record in zip(run.seqs, run.records, strict=True):
            record.last_token = end
            record.tokens += count
            seq.metrics.last_token_time = end
        engine.num_steps += count
        engine.executor.steps += count
        engine.last_step_was_idle = False
        self.steps += count
        self.fast_steps += count
        self.clock.now = end
        run.applied = target

    def abort_all(self, why: str) -> list[RequestRecord]:
        assert self.run is None, "apply or end the planned decode run first"
        aborted = list(self.in_flight.values())
        for record in aborted:
            self.engine.abort_request(str(record.index))
            record.status, record.error = "aborted", why
        self.in_flight.clear()
        self.engine.step()  # applies the aborts, frees the blocks
        return aborted

    def queue_and_batch(self) -> tuple[int, int, int]:
        """engine.stats()'s num_waiting, num_running and max_num_seqs, without building the rest
        (the router's pick reads these of every pod on every arrival)."""
        engine = self.engine
        sched = engine.scheduler
        return (len(sched.waiting) + len(engine._inbox) + len(sched.waiting_for_kv), len(sched.running),
                sched.max_num_seqs)

    @property
    def busy(self) -> bool:
        return self.engine.has_unfinished_requests()


def fake_model_profile(scale: float = 1.0) -> StepProfile:
    """The fake model's step time (what `--fake-model` engines sleep), read from the engine itself."""
    engine = LLMEngine.from_config(EngineConfig(model=FAKE_MODEL, num_kv_blocks=128, max_model_len=512,
                                                fake_step_time_scale=scale))
    linear = engine.executor.step_time
    return StepProfile("fake-model", {"const": linear.base_s, "prefill_tokens": linear.per_prefill_token_s,
                                      "decode_seqs": linear.per_decode_token_s, "num_seqs": linear.per_seq_s},
                       FAKE_KV_BYTES_PER_TOKEN, None, False,
                       f"the --fake-model engine's LinearStepTime (scale {scale:g})")
