"""The engine loop: requests in, one scheduled model step at a time, outputs out.

Threading: `add_request`, `abort_request` and `set_max_num_seqs` may be called from any thread;
they only validate and enqueue. `step()` runs on one thread (the engine thread) and applies the
queued changes at its start, so a change always takes effect at the next step.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from iterserve.engine.block_manager import BlockManager
from iterserve.engine.config import ConfigError, EngineConfig
from iterserve.engine.detokenizer import append_new_text
from iterserve.engine.executor import Executor, kv_transfer_of, load_executor
from iterserve.engine.kv_transfer import params as kv_params
from iterserve.engine.kv_transfer.connector import KVConnector
from iterserve.engine.lora.adapter import UnknownAdapterError
from iterserve.engine.model.generation_config import defaults_of
from iterserve.engine.outputs import CompletionOutput, RequestOutput
from iterserve.engine.sampling_params import InvalidRequestError, SamplingParams
from iterserve.engine.scheduler import Scheduler, SchedulerOutput
from iterserve.engine.sequence import Sequence
from iterserve.engine.spec_decode import (
    NgramProposer,
    SpecDecodeStats,
    SpecPolicy,
    SpeculativeConfig,
)
from iterserve.engine.step_log import StepLog, StepRecords, as_record
from iterserve.engine.step_result import RequestFailed, StepToken
from iterserve.engine.stop import cut_at_stop_string

logger = logging.getLogger(__name__)

@dataclass(slots=True)
class EngineStats:
    num_waiting: int
    num_running: int
    num_swapped: int
    kv_usage: float
    num_preemptions: int
    max_num_seqs: int
    num_kv_blocks: int
    block_size: int
    num_steps: int
    # Prefix caching: cached blocks nobody holds (free, not in kv_usage, KV kept until evicted),
    # prompt tokens looked up and found cached since start, and the hit rate over recent admissions.
    num_cached_blocks: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prefix_cache_hit_rate: float = 0.0
    # Prefill/decode disaggregation (engine/kv_transfer): requests whose prompt KV is being pulled,
    # blocks pinned under leases for decode engines, and transfer outcomes since start.
    num_waiting_for_kv: int = 0
    num_pinned_blocks: int = 0
    kv_pulls_ok: int = 0
    kv_pulls_failed: int = 0
    kv_leases_expired: int = 0
    # Prompt tokens not computed yet (waiting and still-prefilling requests, and the inbox's).
    queued_prompt_tokens: int = 0
    # Speculative decoding (engine/spec_decode/policy.py SpecDecodeStats), since start.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()
    # LoRA adapters (engine/lora): --max-loras (0: LoRA off), the adapters of running and waiting
    # requests, and requests accepted per adapter since start.
    max_loras: int = 0
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()
    lora_requests: tuple[tuple[str, int], ...] = ()


@dataclass(slots=True)
class StepTiming:
    schedule_s: float = 0.0
    model_s: float = 0.0
    postprocess_s: float = 0.0


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        executor: Executor,
        tokenizer,
        clock: Callable[[], float] = time.monotonic,
        model_name: str | None = None,
    ):
        self.config = config
        self.executor = executor
        self.tokenizer = tokenizer
        self.clock = clock
        self.model_name = model_name or config.model
        self.block_manager = BlockManager(
            executor.num_kv_blocks, config.block_size, executor.num_cpu_blocks, config.watermark,
            enable_prefix_caching=bool(config.enable_prefix_caching),
        )
        self.scheduler = Scheduler(config, self.block_manager)
        self._sequences: dict[str, Sequence] = {}
        self._lock = threading.Lock()
        self._inbox: deque[Sequence] = deque()
        self._aborts: deque[str] = deque()
        self._request_counter = itertools.count()
        self._step_log = StepLog(config.step_log) if config.step_log else None
        self.step_records = StepRecords()  # the newest steps' figures (GET /admin/steps)
        self._load_1m, self._load_read_at = 0.0, -1.0  # os.getloadavg(), read at most once a second
        # request id -> (why it failed, the request field at fault or None), until its output is made
        self._errors: dict[str, tuple[str, str | None]] = {}
        self.num_steps = 0
        self.last_step_was_idle = False
        self.num_request_failures = 0
        self.last_timing = StepTiming()
        self.kv_connector: KVConnector | None = None
        self.lora = getattr(executor, "lora", None)  # engine/lora's LoraManager (the Executor's optional lora)
        self._lora_requests: dict[str, int] = {}  # requests accepted per adapter
        self.speculative = SpeculativeConfig.parse(config.speculative_config)
        self.proposer = self._make_proposer(self.speculative) if self.speculative is not None else None
        kv_side = kv_transfer_of(executor)
        if kv_side is not None:
            self.kv_connector = KVConnector(config, self.block_manager, kv_side.kv_layout(), kv_side.read_kv, clock,
                                            transport=kv_side.kv_transport(clock))
            self.scheduler.connector = self.kv_connector

    def _make_proposer(self, spec: SpeculativeConfig):
        """The executor's own proposer (a draft model runs beside the model), else n-gram lookup."""
        proposer = getattr(self.executor, "proposer", None)
        if proposer is None:
            if spec.method != "ngram":
                raise ConfigError(f"--speculative-config: method {spec.method} needs the real model (a draft model "
                                  'runs beside it); with this executor use "method": "ngram"')
            proposer = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
        self.scheduler.spec_stats = SpecDecodeStats()
        # The off-switch's default depends on where the model runs (the fake model has no device: cpu).
        device = getattr(getattr(self.executor, "device", None), "type", "cpu")
        self.scheduler.spec_policy = SpecPolicy(spec.batch_limit(device), spec.min_acceptance_rate)
        return proposer

    def set_wake(self, wake: Callable[[], None]) -> None:
        """Called (from any thread) when a KV pull finishes or a lease is released, so an engine loop
        that sleeps while nothing can be scheduled steps again."""
        if self.kv_connector is not None:
            self.kv_connector.wake = wake

    def start_kv_transfer(self, host: str = "127.0.0.1", port: int = 0, advertise_host: str | None = None) -> int:
        """Listen for decode engines' KV pulls (role prefill only); returns the bound port."""
        if self.config.role != "prefill":
            raise ConfigError(f"--role {self.config.role} serves no KV to other engines; it opens no KV transfer "
                              "listener (only --role prefill does)")
        if self.kv_connector is None:
            raise ConfigError("this executor cannot transfer KV")
        kv_transfer_of(self.executor).enable_kv_store()  # a connector exists only for such an executor
        return self.kv_connector.listen(host, port, advertise_host)

    def collect_kv_leases(self) -> int:
        """On the engine thread: free KV leases released by decode engines or past their expiry."""
        return self.kv_connector.collect() if self.kv_connector is not None else 0

    @classmethod
    def from_config(cls, config: EngineConfig, clock: Callable[[], float] = time.monotonic) -> LLMEngine:
        """An engine on the model the config names, or on the fake model (engine/executor.py)."""
        executor, tokenizer, model_name, config = load_executor(config)
        return cls(config, executor, tokenizer, clock, model_name)

    # -- called from any thread -----------------------------------------------------------------
    def add_request(
        self,
        prompt: str | None = None,
        params: SamplingParams | None = None,
        prompt_token_ids: list[int] | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
        kv_transfer_params: dict | None = None,
        lora_name: str | None = None,
    ) -> str:
        """Validate and queue a request; raises InvalidRequestError (nothing is queued then).
        kv_transfer_params: the P/D wire contract's object (engine/kv_transfer/params.py).
        lora_name: a served LoRA adapter (engine/lora) to run the request with; None: the base model."""
        params = params or SamplingParams()
        if lora_name is not None and (self.lora is None or not self.lora.is_registered(lora_name)):
            raise UnknownAdapterError(f"model: LoRA adapter {lora_name!r} is not loaded here; GET /v1/models lists "
                                      "the served adapters, POST /v1/load_lora_adapter loads one", "model")
        kv_transfer = self._check_kv_transfer(kv_transfer_params)
        if kv_transfer is not None and kv_transfer.remote_prefill is not None and params.prompt_logprobs is not None:
            raise InvalidRequestError("kv_transfer_params.do_remote_prefill: prompt logprobs (echo with logprobs) need the "
                                      "prompt computed on this engine; send the request without kv_transfer_params",
                                      "kv_transfer_params.do_remote_prefill")
        if prompt_token_ids is None:
            if not isinstance(prompt, str):
                raise InvalidRequestError("prompt must be a string or a list of token ids", param="prompt")
            prompt_token_ids = self.tokenizer.encode(prompt)
        self._check_prompt(prompt_token_ids)
        request_id = request_id or f"req-{next(self._request_counter)}"
        # generation_config.json's other end-of-sequence ids stop it too (as vLLM does)
        params = defaults_of(self.tokenizer).with_eos(params, self.tokenizer.eos_token_id)
        seq = Sequence(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            arrival_time=self.clock() if arrival_time is None else arrival_time,
            prompt=prompt,
            eos_token_id=self.tokenizer.eos_token_id,
            kv_transfer=kv_transfer,
            lora_name=lora_name,
        )
        with self._lock:
            if request_id in self._sequences:
                raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
            self._sequences[request_id] = seq
            self._inbox.append(seq)
            if lora_name is not None:
                self._lora_requests[lora_name] = self._lora_requests.get(lora_name, 0) + 1
        return request_id

    def _check_kv_transfer(self, raw: dict | None):
        key = self.kv_connector.auth_key if self.kv_connector is not None else None
        wall_clock = self.kv_connector.wall_clock if self.kv_connector is not None else time.time
        kv = kv_params.accept(raw, self.config.role, key, wall_clock())
        if kv is None:
            return None
        role = self.config.role
        if kv.remote_decode:
            if role == "decode":
                raise InvalidRequestError(f"{kv_params.PARAM}.do_remote_decode: this engine runs --role decode and "
                                          "leases no KV; send the prefill call to a --role prefill (or both) engine",
                                          f"{kv_params.PARAM}.do_remote_decode")
            if self.kv_connector is None or self.kv_connector.port is None:
                raise InvalidRequestError(f"{kv_params.PARAM}.do_remote_decode: this engine has no KV transfer "
                                          "listener (start it with --role prefill)",
                                          f"{kv_params.PARAM}.do_remote_decode")
        elif role == "prefill":
            raise InvalidRequestError(f"{kv_params.PARAM}.do_remote_prefill: this engine runs --role prefill and "
                                      "pulls no KV; send the decode call to a --role decode (or both) engine",
                                      f"{kv_params.PARAM}.do_remote_prefill")
        elif self.kv_connector is None:
            raise InvalidRequestError(f"{kv_params.PARAM}.do_remote_prefill: this executor cannot load KV",
                                      f"{kv_params.PARAM}.do_remote_prefill")
        return kv

    def _check_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise InvalidRequestError("prompt is empty; send at least one token", param="prompt")
        limit = self.config.max_model_len
        if len(token_ids) >= limit:
            raise InvalidRequestError(
                f"prompt has {len(token_ids)} tokens, but max_model_len is {limit} (prompt plus at least "
                "one generated token must fit); shorten the prompt",
                param="prompt",
            )
        # A prompt the pool can never hold (less the watermark admission keeps free) would sit at the
        # head of the queue forever: refuse it now.
        manager = self.block_manager
        usable = manager.num_blocks - manager.watermark_blocks
        if manager.blocks_for(len(token_ids)) > usable:
            raise InvalidRequestError(
                f"prompt has {len(token_ids)} tokens, but the KV cache can admit at most {usable * manager.block_size} "
                f"({usable} blocks of {manager.block_size} beyond the watermark); shorten the prompt",
                param="prompt",
            )
        if not self.config.chunked_prefill and len(token_ids) > self.config.max_num_batched_tokens:
            raise InvalidRequestError(
                f"prompt has {len(token_ids)} tokens, more than max_num_batched_tokens "
                f"({self.config.max_num_batched_tokens}) with chunked prefill off; shorten the prompt",
                param="prompt",
            )
        vocab = getattr(self.tokenizer, "vocab_size", None)
        if vocab is not None and any(not 0 <= t < vocab for t in token_ids):
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})", param="prompt")

    def abort_request(self, request_id: str) -> None:
        self._aborts.append(request_id)

    def set_max_num_seqs(self, value: int) -> int:
        """Change the running-sequence cap at the next step; running sequences are never killed."""
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise InvalidRequestError("max_num_seqs must be a positive integer", param="max_num_seqs")
        if value > self.config.max_num_batched_tokens:
            raise InvalidRequestError(
                f"max_num_seqs ({value}) may not exceed max_num_batched_tokens "
                f"({self.config.max_num_batched_tokens})",
                param="max_num_seqs",
            )
        previous = self.scheduler.max_num_seqs
        self.scheduler.request_max_num_seqs(value)
        logger.info("max_num_seqs changes from %d to %d at the next step", previous, value)
        return previous

    def has_unfinished_requests(self) -> bool:
        return bool(self._inbox) or self.scheduler.has_unfinished()

    def stats(self) -> EngineStats:
        sched = self.scheduler
        cache = self.block_manager.prefix_cache
        return EngineStats(
            # Requests whose prompt KV is being pulled wait too (as in vLLM, whose waiting queue holds them).
            num_waiting=len(sched.waiting) + len(self._inbox) + len(sched.waiting_for_kv),
            num_running=len(sched.running),
            num_swapped=len(sched.swapped),
            kv_usage=self.block_manager.usage(),
            num_preemptions=sched.num_preemptions,
            max_num_seqs=sched.max_num_seqs,
            num_kv_blocks=self.block_manager.num_blocks,
            block_size=self.config.block_size,
            num_steps=self.num_steps,
            num_cached_blocks=self.block_manager.num_cached_blocks,
            prefix_cache_queries=cache.queries if cache else 0,
            prefix_cache_hits=cache.hits if cache else 0,
            prefix_cache_hit_rate=cache.hit_rate() if cache else 0.0,
            queued_prompt_tokens=sched.queued_prompt_tokens(tuple(self._inbox)),
            **self._spec_stats(),
            **self._kv_stats(),
            **self._lora_stats(),
        )

    def _lora_stats(self) -> dict:
        if self.lora is None:
            return {}
        sched = self.scheduler

        def names(seqs) -> tuple[str, ...]:
            return tuple(dict.fromkeys(s.lora_name for s in seqs if s.lora_name is not None))

        return {"max_loras": self.config.max_loras,
                "running_lora_adapters": names((*tuple(sched.running), *tuple(sched.swapped))),
                "waiting_lora_adapters": names((*tuple(sched.waiting), *tuple(self._inbox))),
                "lora_requests": tuple(self._lora_requests.items())}

    def _spec_stats(self) -> dict:
        spec = self.scheduler.spec_stats
        if spec is None:
            return {}
        return {"spec_num_drafts": spec.num_drafts, "spec_num_draft_tokens": spec.num_draft_tokens,
                "spec_num_accepted_tokens": spec.num_accepted_tokens,
                "spec_accepted_per_pos": tuple(spec.accepted_per_pos)}

    def _kv_stats(self) -> dict:
        connector = self.kv_connector
        if connector is None:
            return {}
        counts = connector.counts
        return {"num_waiting_for_kv": len(self.scheduler.waiting_for_kv),
                "num_pinned_blocks": connector.num_pinned_blocks, "kv_pulls_ok": counts.pulls_ok,
                "kv_pulls_failed": counts.pulls_failed, "kv_leases_expired": counts.leases_expired}

    # -- the engine thread ----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        t_start = time.perf_counter()
        cpu_start = time.thread_time()
        finished_now: list[Sequence] = []
        self._drain_inbox(finished_now)
        if self.kv_connector is not None:
            self.kv_connector.collect()
        if self.proposer is not None:
            self._propose()
        out = self.scheduler.schedule()
        for seq, message in out.kv_failed:
            self._fail_request(seq, message, finished_now)
        now = self.clock()
        for chunk in out.chunks:
            if chunk.seq.metrics.first_scheduled_time is None:
                chunk.seq.metrics.first_scheduled_time = now
        t_scheduled = time.perf_counter()
        sampled = self.executor.execute(out) if not out.is_empty else []
        t_model = time.perf_counter()
        sampled = self._finish_failed(out, sampled, finished_now)
        verified = {chunk.seq.request_id: len(chunk.seq.output_token_ids) for chunk in out.chunks if chunk.num_spec}
        progressed = self.scheduler.update(out, sampled)
        outputs = self._make_outputs(progressed, finished_now, verified)
        t_end = time.perf_counter()
        self.num_steps += 1
        self.last_step_was_idle = out.is_empty and not outputs
        self.last_timing = StepTiming(t_scheduled - t_start, t_model - t_scheduled, t_end - t_model)
        if not out.is_empty:
            self._record_step(out, t_end, t_end - t_start, time.thread_time() - cpu_start)
        return outputs

    def _propose(self) -> None:
        """Speculative decoding: proposals for the decoding sequences the policy lets speculate
        (engine/spec_decode/policy.py), each capped so its tokens stay within max_tokens and the
        context; the scheduler verifies them in this step's batch."""
        running = self.scheduler.running
        for seq in running:
            seq.spec_token_ids, seq.spec_draft_probs = [], None
        policy = self.scheduler.spec_policy
        if not running or not policy.step_allows(len(running)):
            return
        k, limit = self.speculative.num_speculative_tokens, self.config.max_model_len
        seqs, counts = [], []
        for seq in running:
            if seq.num_computed_tokens != seq.num_tokens - 1:
                continue
            room = min(k, seq.params.max_tokens - len(seq.output_token_ids) - 1, limit - seq.num_tokens - 1)
            if room > 0 and policy.seq_allows(seq):
                seqs.append(seq)
                counts.append(room)
        if not seqs:
            return
        for seq, count, proposal in zip(seqs, counts, self.proposer.propose(seqs, counts), strict=True):
            seq.spec_token_ids = list(proposal.tokens[:count])
            seq.spec_draft_probs = proposal.probs if seq.spec_token_ids else None

    def _drain_inbox(self, finished_now: list[Sequence]) -> None:
        while self._inbox:
            self.scheduler.add(self._inbox.popleft())
        while self._aborts:
            request_id = self._aborts.popleft()
            seq = self._sequences.get(request_id)
            if seq is not None and not seq.is_finished:
                self.scheduler.finish(seq, "abort")
                finished_now.append(seq)

    def _finish_failed(self, out: SchedulerOutput, sampled: list[StepToken],
                       finished_now: list[Sequence]) -> list[int | None]:
        """Finish, with an error, each request whose own part of the step failed (see step_result)."""
        if not any(isinstance(token, RequestFailed) for token in sampled):
            return sampled
        tokens: list[int | None] = []
        for chunk, token in zip(out.chunks, sampled, strict=True):
            if isinstance(token, RequestFailed):
                self._fail_request(chunk.seq, token.message, finished_now, token.param)
                token = None
            tokens.append(token)
        return tokens

    def _fail_request(self, seq: Sequence, message: str, finished_now: list[Sequence],
                      param: str | None = None) -> None:
        """One request failed: it finishes with an error and frees its KV; the others go on. param: the
        request field at fault where its own input made it fail."""
        if seq.finish_reason in ("error", "abort"):
            return
        if param is None:
            logger.error("request %s failed and was finished with an error: %s", seq.request_id, message)
        else:
            logger.warning("request %s was finished with an error in its %s: %s", seq.request_id, param, message)
        self._errors[seq.request_id] = (message, param)
        self.num_request_failures += 1
        if not seq.is_finished:
            self.scheduler.finish(seq, "error")
        seq.finish_reason = "error"
        finished_now.append(seq)

    def _make_outputs(self, progressed: list[Sequence], finished_now: list[Sequence],
                      verified: dict[str, int] | None = None) -> list[RequestOutput]:
        now = self.clock()
        outputs = []
        for seq in progressed:
            metrics = seq.metrics
            if metrics.first_token_time is None:
                metrics.first_token_time = now
            metrics.last_token_time = now
            start = verified.get(seq.request_id) if verified else None
            try:
                if start is None or len(seq.output_token_ids) - start <= 1:
                    new_ids, new_text = [seq.output_token_ids[-1]], self._new_text(seq)
                else:
                    new_ids, new_text = self._new_texts(seq, start)
            except Exception as error:  # noqa: BLE001 - detokenizing or a stop check failed for this request
                logger.exception("post-processing request %s failed", seq.request_id)
                self._fail_request(seq, f"processing the output failed: {type(error).__name__}: {error}",
                                   finished_now)
                continue
            outputs.append(self._output(seq, new_ids, new_text))
        outputs.extend(self._output(seq, [], "") for seq in finished_now)
        finished_ids = [o.request_id for o in outputs if o.finished]
        if finished_ids:
            with self._lock:
                for request_id in finished_ids:
                    self._sequences[request_id].metrics.finished_time = now
                    del self._sequences[request_id]
            self.executor.release(finished_ids)
        return outputs

    def _new_text(self, seq: Sequence) -> str:
        """Detokenize seq's new token and apply its stop strings; returns the text to stream."""
        new_text = append_new_text(seq, self.tokenizer) if self.tokenizer is not None else ""
        new_text, stopped = cut_at_stop_string(seq, new_text)
        if stopped:
            self.scheduler.finish(seq, "stop")
        return new_text

    def _new_texts(self, seq: Sequence, start: int) -> tuple[list[int], str]:
        """Several tokens from one verified step, detokenized and stop-checked one at a time as plain
        decoding would: tokens after the one that completes a stop string are dropped."""
        tokens = seq.output_token_ids
        new_ids = tokens[start:]
        del tokens[start:]
        text = ""
        for count, token in enumerate(new_ids, 1):
            tokens.append(token)
            piece = append_new_text(seq, self.tokenizer) if self.tokenizer is not None else ""
            piece, stopped = cut_at_stop_string(seq, piece)
            text += piece
            if stopped:
                if not seq.is_finished:
                    self.scheduler.finish(seq, "stop")
                elif count < len(new_ids):  # a token rule ended it later than this stop string does
                    seq.finish_reason = "stop"
                if seq.logprobs is not None:
                    del seq.logprobs[len(tokens):]
                return new_ids[:count], text
        return new_ids, text

    def _output(self, seq: Sequence, new_token_ids: list[int], new_text: str) -> RequestOutput:
        completion = CompletionOutput(
            index=0,
            text=seq.output_text,
            token_ids=list(seq.output_token_ids),
            finish_reason=seq.finish_reason,
            new_token_ids=new_token_ids,
            new_text=new_text,
            logprobs=seq.logprobs,
        )
        error, error_param = self._errors.pop(seq.request_id, (None, None))
        return RequestOutput(
            request_id=seq.request_id,
            prompt=seq.prompt,
            prompt_token_ids=seq.prompt_token_ids,
            outputs=[completion],
            finished=seq.is_finished,
            metrics=seq.metrics,
            error=error,
            error_param=error_param,
            prompt_logprobs=seq.prompt_logprobs,
            kv_transfer_params=seq.kv_transfer.params_out if seq.kv_transfer is not None and seq.is_finished
            else None,
        )

    def _record_step(self, out: SchedulerOutput, t_end: float, duration: float, cpu: float) -> None:
        """The step's figures into the ring (engine/step_log.py FIELDS order, seq aside) and the
        step log when there is one. One pass over the chunks: this runs on every step."""
        prefill = decode = context = longest = pairs = 0
        for chunk in out.chunks:
            end = chunk.start + chunk.num_tokens
            context += end
            if end > longest:
                longest = end
            if chunk.is_decode:
                decode += chunk.num_tokens
            else:
                prefill += chunk.num_tokens
                pairs += chunk.num_tokens * end  # query-key pairs: prefill attention is quadratic
        if t_end - self._load_read_at >= 1.0:  # a one-minute average: once a second is plenty
            self._load_1m, self._load_read_at = os.getloadavg()[0], t_end
        timing = self.last_timing
        stored = self.step_records.append((
            self.num_steps, self.clock(), duration,
            # The engine thread's own CPU time for the step: its compute, which is what the wall
            # time would be on a core of its own (a shared node's other work inflates duration_s).
            cpu, self._load_1m, timing.schedule_s, timing.model_s, timing.postprocess_s,
            prefill, decode, len(out.chunks),
            # Tokens each chunk attends to (its start plus itself), summed and the largest: what a
            # step-time model needs beyond the token counts (iterserve simulate fit).
            context, longest, pairs,
            len(self.scheduler.running), len(self.scheduler.waiting), self.block_manager.gpu.num_used,
            self.block_manager.num_cached_blocks, len(out.preempted),
        ))
        if self._step_log is not None:
            self._step_log.write(as_record(stored))

    def close(self) -> None:
        close_executor = getattr(self.executor, "close", None)  # a tensor-parallel group stops its ranks
        if close_executor is not None:
            close_executor()
        if self.kv_connector is not None:
            self.kv_connector.close()
        if self._step_log is not None:
            self._step_log.close()
