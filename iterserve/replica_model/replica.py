"""One simulated engine replica: the real LLMEngine, Scheduler and BlockManager, with the KV pool
the spec's kvCacheMemory buys for the profiled model, a clock of its own, and an executor that
samples no model: a step "takes" the profile's time, which advances the replica's clock.

The engine options come from the spec through the operator's own `engine_args` and the server's
own flag parser (operator/engine_config.py), so a replica runs with exactly the options a pod would.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left
from dataclasses import dataclass, field, replace

from iterserve.engine.config import EngineConfig, kv_pool_blocks
from iterserve.engine.fake_executor import FAKE_KV_BYTES_PER_TOKEN, FAKE_MODEL, FakeExecutor
from iterserve.engine.llm_engine import LLMEngine
from iterserve.engine.sampling_params import InvalidRequestError, SamplingParams
from iterserve.replica_model.profile import StepProfile

PROMPT_TOKEN = 100  # every simulated prompt token; the fake executor's tokens depend on it only


def prompt_tokens(index: int, count: int) -> list[int]:
    """A prompt of `count` tokens that shares no KV block with another request's (a trace says
    nothing of content, so no prefix-cache hits are assumed)."""
    return [PROMPT_TOKEN + index] + [PROMPT_TOKEN] * (count - 1)


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

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1

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
class Replica:
    """An engine pod's engine. `step()` runs one engine step at the replica's clock."""

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

    def __post_init__(self) -> None:
        config = replace(self.config, step_log=None).resolve(self.profile.model_context_len)
        gpu, cpu = kv_blocks(config, self.profile)
        config.check_kv_capacity(gpu, cpu)
        self.config = config
        executor = FakeExecutor(gpu, cpu, step_time=self.profile, sleep=self.clock.advance)
        self.engine = LLMEngine(config, executor, _NoText(), clock=self.clock, model_name="simulated")

    @property
    def num_kv_blocks(self) -> int:
        return self.engine.block_manager.num_blocks

    def submit(self, record: RequestRecord, now: float) -> bool:
        """Like the server: 429 past max_waiting_requests, 400 for a prompt that cannot fit."""
        record.pod = self.name
        if self.engine.stats().num_waiting >= self.server.max_waiting_requests:
            record.status, record.error = "rejected", "429: waiting queue full"
            return False
        try:
            self.engine.add_request(
                prompt_token_ids=prompt_tokens(record.index, record.prompt_tokens),
                params=SamplingParams(max_tokens=record.output_tokens, ignore_eos=True, temperature=0),
                request_id=str(record.index), arrival_time=now)
        except InvalidRequestError as error:
            record.status, record.error = "invalid", f"400: {error}"
            return False
        self.in_flight[str(record.index)] = record
        return True

    def step(self, now: float) -> float:
        """One engine step starting at `now` (or when the previous one ended); returns its end."""
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

    def abort_all(self, why: str) -> list[RequestRecord]:
        aborted = list(self.in_flight.values())
        for record in aborted:
            self.engine.abort_request(str(record.index))
            record.status, record.error = "aborted", why
        self.in_flight.clear()
        self.engine.step()  # applies the aborts, frees the blocks
        return aborted

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
