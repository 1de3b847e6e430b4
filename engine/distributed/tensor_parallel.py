"""--tensor-parallel-size N on one node: rank 0 is the engine's own process (scheduler, sampler,
HTTP server); ranks 1..N-1 are processes it spawns, each holding its slice of the weights and its
shard of the KV cache (engine/model/parallel.py says which slice).

Per step, rank 0 sends each worker ONE message, the step plan: block swaps, the flat batch's token
ids, positions, query and sequence lengths, block tables, and which hidden rows go through the LM
head (the sampled rows, then prompt-logprob rows). Every rank then runs the same forward; the
collectives inside it (two all-reduces per layer, one for the embedding, one gather of the logits)
meet in the same order on every rank. Only rank 0 samples.

P/D disaggregation (engine/kv_transfer/sharded.py): every rank serves and pulls its own KV shard
(its heads of its stage's layers, from or to the same rank of a group of the same shape);
rank 0's connector decides each transfer's outcome and the step plans carry it (kv_loads,
kv_forget), over the same connection, which also carries the KV transfer messages between rank 0
and the other ranks (read on a thread of its own at both ends, so a lease or a pull order does not
wait for a step); the other nodes' ranks get them through the store (multinode.Mailbox).

Workers are `python -m iterserve.engine.distributed.tensor_parallel RANK PORT` processes; each
connects back to rank 0 over 127.0.0.1 (authenticated with a key passed in its environment) and
receives its config there. The plan travels over that connection, not a collective: an idle server sends nothing, and a worker blocked
on the pipe sees rank 0's death as end-of-file and exits. Rank 0 watches its workers: a worker that
exits ends the group (the log line names the rank, its pid and exit code), the next step raises,
and GET /health answers 503 (AsyncEngine.alive reads `group_failure`). Collectives time out
(engine/distributed/group.py), so no rank hangs on a dead peer.
"""

from __future__ import annotations

import logging
import os
import queue
import secrets
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from datetime import timedelta
from functools import partial
from multiprocessing.connection import Client, Listener

import torch
from torch.distributed import TCPStore

from iterserve.engine.attention.backend import AttentionMetadata
from iterserve.engine.config import ConfigError, EngineConfig
from iterserve.engine.distributed import multinode, pipeline
from iterserve.engine.distributed.group import Group
from iterserve.engine.kv_transfer.sharded import KV, ShardedTransport, ShardServer
from iterserve.engine.kv_transfer.wire import KVTransferError
from iterserve.engine.model import parallel
from iterserve.engine.model.loader import ModelConfig
from iterserve.engine.model_runner import ModelRunner, pick_device
from iterserve.engine.scheduler import SchedulerOutput

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 600.0  # a worker's model load and rendezvous
_KEY_ENV = "ITERSERVE_TP_KEY"  # the local connection's key, handed to the workers in their environment


@dataclass
class StepPlan:
    swap_out: list[tuple[int, int]]
    swap_in: list[tuple[int, int]]
    input_ids: list[int]
    positions: list[int]
    query_lens: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]
    logit_rows: list[list[int]]  # each: one compute_logits call over these hidden rows, in order
    # engine/lora: each row's adapter (empty when no row has one), and each named adapter's
    # (directory, load number) for the workers to read it (LoraManager.sources / ensure)
    lora_rows: list[str | None] = field(default_factory=list)
    lora_sources: dict[str, tuple[str, int]] = field(default_factory=dict)
    # engine/kv_transfer/sharded.py: pulled shards to load (key, block ids) before the forward, and
    # staged shards to drop (their pull failed or was given up, or the sequence was preempted)
    kv_loads: list[tuple[str, list[int]]] = field(default_factory=list)
    kv_forget: list[str] = field(default_factory=list)


def step_plan(out: SchedulerOutput) -> StepPlan:
    """What every rank needs to replay rank 0's step (ModelRunner._forward and its logits calls)."""
    plan = StepPlan(list(out.swap_out), list(out.swap_in), [], [], [], [], [], [])
    sample_rows: list[int] = []
    prompt_rows: list[list[int]] = []
    for chunk in out.chunks:
        seq, start, end = chunk.seq, chunk.start, chunk.start + chunk.num_tokens
        offset = len(plan.input_ids)
        plan.input_ids += seq.token_slice(start, end)
        plan.lora_rows += [seq.lora_name] * chunk.num_tokens
        plan.positions += range(start, end)
        plan.query_lens.append(chunk.num_tokens)
        plan.seq_lens.append(end)
        plan.block_tables.append(list(seq.block_table))
        if chunk.sample:
            sample_rows.extend(range(len(plan.input_ids) - 1 - chunk.num_spec, len(plan.input_ids)))
        if seq.params.prompt_logprobs is not None and chunk.start < seq.num_prompt_tokens - 1:
            prompt_rows.append(list(range(offset, offset + chunk.num_tokens)))
    plan.logit_rows = ([sample_rows] if sample_rows else []) + prompt_rows
    if not any(plan.lora_rows):
        plan.lora_rows = []
    return plan


class ShardRunner(ModelRunner):
    """A ModelRunner over one rank's slice of the model: its pipeline stage's layers, and within them
    its tensor-parallel share. `group` joins every rank; `tp_group` the ranks of this stage (the
    same object when there is one stage; None when the stage is one rank)."""

    def __init__(self, config: EngineConfig, group: Group, tp_group: Group | None, show_progress: bool = True):
        self.group = group
        self.tp_group = tp_group
        self.tp = config.tensor_parallel_size
        self.stages = config.pipeline_parallel_size
        self.stage, self.tp_rank = divmod(group.rank, self.tp)
        self.micro_batches = pipeline.MicroBatchPolicy.from_config(config)
        if config.compile:
            raise ConfigError(f"{_sizes(config)} with --compile is not supported; drop --compile")
        if config.quantization == "auto":  # the default: the file's blocks are not sharded, so the dense model
            config = replace(config, quantization="none")
        super().__init__(config, show_progress=show_progress)
        self.split = None  # two threads issuing collectives would interleave them differently per rank
        # KV transfer pairs rank r with rank r of a group of the same shape (kv_transfer/sharded.py).
        self._kv_layout = replace(self._kv_layout, shard=f"{self.tp_rank}/{self.tp}",
                                  stage=f"{self.stage}/{self.stages}", first_layer=self.first_layer)
        self.kv_shards: ShardServer | None = None  # a worker's side of KV transfer (worker_main)

    def shard(self, loaded, config: EngineConfig) -> ModelConfig:
        if self.quantization != "none":
            raise ConfigError(f"{_sizes(config)} with --quantization {self.quantization}: quantized linears are not "
                              "sharded; use --quantization none (or --dtype float32)")
        if config.speculative_config and '"draft_model"' in config.speculative_config.replace(" ", ""):
            raise ConfigError(f"{_sizes(config)} with a draft model (--speculative-config): the draft is not "
                              'sharded; use "method": "ngram"')
        full = local = loaded.config
        self.first_layer = 0  # the model's number of this stage's first layer
        try:
            if self.stages > 1:
                layers = parallel.stage_layers(full.num_layers, self.stage, self.stages)
                self.first_layer = layers.start
                parallel.stage_weights(loaded.weights, layers)
                local = parallel.stage_config(full, layers)
            if self.tp > 1:
                shard = parallel.Shard(self.tp_rank, self.tp)
                parallel.shard_weights(loaded.weights, full, shard)
                local = parallel.local_config(local, shard)
        except parallel.ParallelConfigError as error:
            raise ConfigError(str(error)) from None
        return local

    def parallelize(self, full_config: ModelConfig) -> None:
        if self.tp_group is not None:
            parallel.parallelize(self.model, full_config, self.tp_group)
        self.hidden_size = full_config.hidden_size

    def lora_shard(self):
        return parallel.Shard(self.tp_rank, self.tp) if self.tp > 1 else None

    @torch.inference_mode()
    def replay(self, plan: StepPlan) -> None:
        """A worker's step: rank 0's plan through the same forward and logits calls."""
        if plan.swap_out:
            self._copy_blocks(plan.swap_out, self.kv_caches, self.cpu_caches)
        if plan.swap_in:
            self._copy_blocks(plan.swap_in, self.cpu_caches, self.kv_caches)
        for key in plan.kv_forget:
            self.kv_shards.forget(key)
        if plan.kv_loads:
            self._load_kv([self.kv_shards.take(key, blocks) for key, blocks in plan.kv_loads])
        if not plan.input_ids:
            return
        device = self.device
        meta = AttentionMetadata.build(plan.query_lens, plan.seq_lens, plan.block_tables, self.block_size, device)
        ids = torch.tensor(plan.input_ids, dtype=torch.long, device=device)
        positions = torch.tensor(plan.positions, dtype=torch.long, device=device)
        for name, source in plan.lora_sources.items():  # adapters rank 0 loaded since this rank last read them
            self.lora.ensure(name, source)
        self.model.lora_step = self.lora.step(plan.lora_rows) if plan.lora_rows else None
        if self.stages == 1:
            hidden = self.model(ids, positions, self.kv_caches, meta)
        else:  # micro-batches through the stages (engine/distributed/pipeline.py)
            hidden = pipeline.pipeline_forward(self, self.model, ids, positions, plan.query_lens, plan.seq_lens,
                                               plan.block_tables, self.micro_batches)
            if hidden is None:  # not the last stage
                return
        for rows in plan.logit_rows:
            logits = self.model.compute_logits(hidden[torch.tensor(rows, device=device)])
            if self.stages > 1 and self.tp_rank == 0:  # the last stage's logits go to rank 0's sampler
                self.group.send(logits, 0)


class FirstStage:
    """Rank 0's model under pipeline parallelism: runs stage 0 and sends its output on; the "hidden
    states" it returns are row numbers, and compute_logits receives those rows' logits from the
    last stage (which computes them for the same rows, in the same order: StepPlan.logit_rows)."""

    def __init__(self, model, runner: ShardRunner, vocab: int):
        self.model = model
        self.runner = runner
        self.vocab = vocab

    def __getattr__(self, name):
        return getattr(self.model, name)

    def __call__(self, input_ids, positions, kv_caches, meta):
        runner, step = self.runner, self.runner.step
        pipeline.pipeline_forward(runner, self.model, input_ids, positions, step.query_lens, step.seq_lens,
                                  step.block_tables, runner.micro_batches)
        return torch.arange(input_ids.shape[0], device=input_ids.device).unsqueeze(1)

    def compute_logits(self, rows: torch.Tensor) -> torch.Tensor:
        runner = self.runner
        return runner.group.recv((rows.shape[0], self.vocab), torch.float32, (runner.stages - 1) * runner.tp)


def _sizes(config: EngineConfig) -> str:
    return f"--tensor-parallel-size {config.tensor_parallel_size} --pipeline-parallel-size {config.pipeline_parallel_size}"


class TensorParallelRunner(ShardRunner):
    """Rank 0: the engine's executor. Sends each step's plan, then runs its own share of it."""

    def __init__(self, config: EngineConfig, show_progress: bool = True):
        tp, stages = config.tensor_parallel_size, config.pipeline_parallel_size
        size = tp * stages
        local = multinode.local_size(config)  # ranks on this node
        if config.node_rank != 0:
            raise ConfigError(f"--node-rank {config.node_rank} runs ranks only, no engine: start that node with "
                              f"`iterserve serve --nnodes {config.nnodes} --node-rank {config.node_rank} ...` "
                              "(engine/distributed/multinode.py)")
        device = pick_device(config.device)
        if device.type == "cuda" and torch.cuda.device_count() < local:
            raise ConfigError(f"--tensor-parallel-size {tp} x --pipeline-parallel-size {stages} over --nnodes "
                              f"{config.nnodes} needs {local} CUDA devices on this node; {torch.cuda.device_count()} "
                              "are visible")
        if device.type == "cuda":
            torch.cuda.set_device(0)
        self.group_failure: BaseException | None = None
        self._workers: list[subprocess.Popen] = []
        self._pipes: list = []
        self._closing = False
        self._plans: multinode.PlanPublisher | None = None  # the other nodes' ranks read plans from the store
        self._send_lock = threading.Lock()  # step plans (engine thread) and KV messages (transfer threads)
        self._kv_transport: ShardedTransport | None = None
        self._deadline = time.monotonic() + config.rendezvous_timeout
        address, self._master_ip = "127.0.0.1", None
        if config.nnodes > 1:  # the store first: the other nodes connect while rank 0 loads
            self._master_ip = multinode.resolve(config.master_addr, self._deadline)
            address = multinode.leader_address(self._master_ip, config.master_port)
        group = Group(0, size, device, address=address)
        if config.nnodes > 1:
            group.open_store(port=config.master_port)
            logger.info("rendezvous store on port %d (--master-addr %s = %s); this node's ranks listen on %s; "
                        "waiting for nodes 1..%d", config.master_port, config.master_addr, self._master_ip, address,
                        config.nnodes - 1)
        tp_group = _tp_group(group, tp, stages, device)
        _cpu_threads(local)
        super().__init__(config, group, tp_group, show_progress)  # rank 0's slice first: its KV pool sizes the others
        worker_config = replace(multinode.agreed_config(config, self.device, self.dtype),
                                num_kv_blocks=self.num_kv_blocks, num_cpu_blocks=self.num_cpu_blocks,
                                kv_cache_memory=None)
        try:
            self._start_workers(worker_config, group, tp_group)
        except BaseException:
            self.close()
            raise
        logger.info("tensor parallelism %d x pipeline stages %d: %d ranks (%s), pids %s", tp, stages, size,
                    "nccl" if device.type == "cuda" else "gloo", [os.getpid()] + [p.pid for p in self._workers])
        threading.Thread(target=self._watch, name="iterserve-tp-watch", daemon=True).start()
        for rank, pipe in enumerate(self._pipes, start=1):
            threading.Thread(target=self._read_answers, args=(rank, pipe), name=f"iterserve-tp-answers{rank}",
                             daemon=True).start()
        self._mailbox: multinode.Mailbox | None = None  # KV transfer messages to the other nodes' ranks
        if config.nnodes > 1 and config.role != "both":
            self._mailbox = multinode.Mailbox(self._master_ip, config.master_port, config.rendezvous_timeout)
            for rank in range(local, size):
                threading.Thread(target=self._mailbox.read_forever, args=(f"kvr/{rank}", partial(self._answer, rank)),
                                 name=f"iterserve-kv-mailbox{rank}", daemon=True).start()

    def _answer(self, rank: int, message: tuple) -> None:
        if self._kv_transport is not None and message[:1] == (KV,):
            self._kv_transport.deliver(rank, message)

    def _read_answers(self, rank: int, pipe) -> None:
        """A worker's answers to KV transfer messages (the only thing workers send after start-up)."""
        while True:
            try:
                message = pipe.recv()
            except (EOFError, OSError):
                return  # the worker is gone (_watch reports it) or the group was closed
            if self._kv_transport is not None and isinstance(message, tuple) and message[:1] == (KV,):
                self._kv_transport.deliver(rank, message)

    def send(self, rank: int, message: tuple) -> None:
        """A KV transfer message to a rank (kv_transfer/sharded.py's RankLinks): over its connection on
        this node, through the store on another."""
        with self._send_lock:
            if self._closing or (rank > len(self._pipes) and self._mailbox is None):
                raise KVTransferError(f"tensor rank {rank} is gone: the group has ended")
            try:
                if rank <= len(self._pipes):
                    self._pipes[rank - 1].send(message)
                else:
                    self._mailbox.send(f"kv/{rank}", message)
            except (OSError, EOFError, RuntimeError) as error:  # RuntimeError: torch's store errors
                raise KVTransferError(f"tensor rank {rank} is gone: {error}") from None

    def parallelize(self, full_config: ModelConfig) -> None:
        super().parallelize(full_config)
        if self.stages > 1:
            self.model = FirstStage(self.model, self, full_config.vocab_size)

    def _start_workers(self, config: EngineConfig, group: Group, tp_group: Group | None) -> None:
        """Spawn this node's ranks 1..local-1 (`python -m` this module: no re-import of the caller's main
        script), hand each its config over an authenticated local connection, and the other nodes'
        ranks theirs through the store; rendezvous, wait for their models."""
        size, local = group.size, multinode.local_size(config)
        port = group.open_store() if group.store is None else group.store.port
        key = secrets.token_bytes(32)
        listener = Listener(("127.0.0.1", 0), authkey=key)
        try:
            env = {**os.environ, _KEY_ENV: key.hex()}
            for rank in range(1, local):
                self._workers.append(subprocess.Popen(
                    [sys.executable, "-m", "iterserve.engine.distributed.tensor_parallel", str(rank),
                     str(listener.address[1])], env=env))
            pipes: dict[int, object] = {}
            accepting = threading.Thread(target=lambda: pipes.update(
                (pipe.recv(), pipe) for pipe in (listener.accept() for _ in range(local - 1))), daemon=True)
            accepting.start()
            deadline = time.monotonic() + START_TIMEOUT_S
            while accepting.is_alive():
                accepting.join(0.5)
                self._check_alive("during start-up")
                if time.monotonic() > deadline:
                    raise ConfigError(f"tensor-parallel ranks did not connect within {START_TIMEOUT_S:.0f} s")
        finally:
            listener.close()
        self._pipes = [pipes[rank] for rank in range(1, local)]
        for rank, pipe in enumerate(self._pipes, start=1):
            pipe.send((config, rank, size, port, logging.getLogger().level, group.address))
        if config.nnodes > 1:
            group.store.set("config", multinode.config_json(config))
            multinode.await_ranks(group.store, 0, config, self._deadline, f"port {port}")
            self._plans = multinode.PlanPublisher(group.store, list(range(local, size)))
        group.connect(port=port)
        if tp_group is not None and tp_group is not group:
            tp_group.connect(parent=group)
        for rank, pipe in enumerate(self._pipes, start=1):
            deadline = time.monotonic() + START_TIMEOUT_S
            while not pipe.poll(0.5):
                self._check_alive("during start-up")
                if time.monotonic() > deadline:
                    raise ConfigError(f"tensor-parallel rank {rank} was not ready within {START_TIMEOUT_S:.0f} s")
            status, detail = pipe.recv()
            if status != "ready":
                raise ConfigError(f"tensor-parallel rank {rank} failed to start: {detail}")
        if self._plans is not None:
            self._await_remote(group.store, range(local, size))

    def _await_remote(self, store, ranks: range) -> None:
        """The other nodes' ranks: each writes ready/RANK once loaded, or `failed` with the reason."""
        while not store.check([f"ready/{rank}" for rank in ranks]):
            if store.check(["failed"]):
                raise ConfigError(f"a rank of another node failed to start: {store.get('failed').decode()}")
            if time.monotonic() > self._deadline + START_TIMEOUT_S:
                missing = [rank for rank in ranks if not store.check([f"ready/{rank}"])]
                raise ConfigError(f"ranks {missing} of the other nodes were not ready within {START_TIMEOUT_S:.0f} s "
                                  "of the rendezvous")
            time.sleep(0.2)

    def _check_alive(self, when: str) -> None:
        for rank, process in enumerate(self._workers, start=1):
            if process.poll() is not None:
                raise ConfigError(f"tensor-parallel rank {rank} (pid {process.pid}) exited {when} "
                                  f"(code {process.returncode}); see its log above")

    def _watch(self) -> None:
        nodes = _NodeWatch(self.config, self._master_ip) if self._plans is not None else None
        while not self._closing:
            failure = None
            for rank, process in enumerate(self._workers, start=1):
                if process.poll() is not None and not self._closing:
                    failure = (f"tensor-parallel rank {rank} (pid {process.pid}) exited with code {process.returncode}; "
                               f"the group of {self.group.size} ranks cannot compute without it")
            if failure is None and nodes is not None:
                try:
                    failure = nodes.check()
                except Exception as error:  # noqa: BLE001 - the leader's own store failing ends the group too
                    failure = f"the rendezvous store failed: {type(error).__name__}: {error}"
            if failure is not None and not self._closing:
                self.group_failure = RuntimeError(failure)
                logger.error("%s: ending the group (GET /health answers 503)", failure)
                self._stop_workers()
                if nodes is not None:  # the whole group restarts: the other nodes lose the store and exit too
                    logger.error("a multi-node group's leader exits (code 1) in %.0f s", multinode.LEADER_EXIT_GRACE_S)
                    threading.Timer(multinode.LEADER_EXIT_GRACE_S, os._exit, (1,)).start()
                return
            time.sleep(0.2)

    def execute(self, out: SchedulerOutput):
        if self.group_failure is not None:
            raise self.group_failure
        plan = step_plan(out)
        if self._kv_transport is not None:
            self._plan_kv(out, plan)
        if plan.lora_rows:
            plan.lora_sources = self.lora.sources({name for name in plan.lora_rows if name is not None})
        try:
            with self._send_lock:
                for pipe in self._pipes:
                    pipe.send(plan)
            if self._plans is not None:
                self._plans.publish(plan)
            self.step = plan  # FirstStage splits it into micro-batches
        except (BrokenPipeError, ConnectionResetError, EOFError, RuntimeError) as error:
            raise RuntimeError(f"a tensor-parallel rank is gone: {error}") from error
        return super().execute(out)

    def _plan_kv(self, out: SchedulerOutput, plan: StepPlan) -> None:
        """The workers' part of rank 0's KV decisions: load the shards of the pulls this step loads,
        drop every other settled pull's."""
        settled = self._kv_transport.take_settled()
        loads = {load.seq.request_id: load for load in out.kv_loads}
        unknown = set(loads) - set(settled)
        if unknown:  # a load without a sharded pull: rank 0 alone would hold the prompt's KV
            raise RuntimeError(f"KV loads of {sorted(unknown)} have no pull on the other tensor ranks")
        plan.kv_loads = [(settled[request_id], list(load.block_ids)) for request_id, load in loads.items()]
        plan.kv_forget = [key for request_id, key in settled.items() if request_id not in loads]

    def enable_kv_store(self) -> None:
        pass  # every rank's KV pool is the store of its shard

    def kv_transport(self, clock) -> ShardedTransport:
        self._kv_transport = ShardedTransport(self, clock)
        return self._kv_transport

    def close(self) -> None:
        """Stop the workers (the end of the engine)."""
        self._closing = True
        self._stop_workers()

    def _stop_workers(self) -> None:
        if self._plans is not None:
            try:
                self._plans.finish(0.0 if self.group_failure else 5.0)  # the other nodes' ranks end
            except Exception:  # noqa: BLE001 - the store may be gone already
                pass
            self._plans = None
        for pipe in self._pipes:
            try:
                pipe.send(None)
            except (OSError, EOFError):
                pass
        for process in self._workers:
            try:
                process.wait(5.0)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(5.0)
        for pipe in self._pipes:
            pipe.close()
        self._pipes = []
        self.group.close()


class _NodeWatch:
    """Rank 0's view of the other nodes: a `failed` key, or a heartbeat that stopped (engine/distributed/multinode.py)."""

    def __init__(self, config: EngineConfig, master_ip: str):
        self.config = config
        self.store = TCPStore(master_ip, config.master_port, None, False, timeout=timedelta(seconds=10))
        self.beats = {node: (-1, time.monotonic()) for node in range(1, config.nnodes)}

    def check(self) -> str | None:
        if self.store.check(["failed"]):
            return f"another node left the group: {self.store.get('failed').decode()}"
        now = time.monotonic()
        for node, (count, since) in self.beats.items():
            beat = self.store.add(f"heartbeat/{node}", 0)
            if beat != count:
                self.beats[node] = (beat, now)
            elif now - since > multinode.HEARTBEAT_TIMEOUT_S:
                ranks = multinode.node_ranks(self.config, node)
                return (f"node {node} (ranks {ranks[0]}..{ranks[-1]}) sent no heartbeat for "
                        f"{multinode.HEARTBEAT_TIMEOUT_S:.0f} s: its process is gone or stalled")
        return None


def _tp_group(group: Group, tp: int, stages: int, device: torch.device) -> Group | None:
    """This rank's tensor-parallel group: the whole group with one stage, its stage's ranks otherwise."""
    if tp == 1:
        return None
    if stages == 1:
        return group
    stage, tp_rank = divmod(group.rank, tp)
    return Group(tp_rank, tp, device, prefix=f"stage{stage}/", address=group.address)


def _cpu_threads(size: int) -> None:
    """On a CPU each rank takes its share of the cores, so N ranks do not oversubscribe them."""
    if not torch.cuda.is_available():
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))


def worker_main(rank: int, address_port: int) -> None:
    """A spawned rank: fetch its config from rank 0, join the group, load its slice, then replay plans
    until rank 0 ends (a None message, or end-of-file when rank 0's process is gone)."""
    pipe = Client(("127.0.0.1", address_port), authkey=bytes.fromhex(os.environ.pop(_KEY_ENV)))
    pipe.send(rank)
    config, rank, size, port, log_level, address = pipe.recv()
    logging.basicConfig(level=log_level or logging.INFO, format=f"%(asctime)s tp-rank{rank} %(levelname)s %(message)s")
    device = pick_device(config.device)
    if device.type == "cuda":
        torch.cuda.set_device(rank)
    _cpu_threads(multinode.local_size(config))
    try:
        group = Group(rank, size, device, address=address)
        if config.nnodes > 1:
            group.store = TCPStore("127.0.0.1", port, None, False, timeout=timedelta(seconds=config.rendezvous_timeout))
            multinode.await_ranks(group.store, rank, config, time.monotonic() + config.rendezvous_timeout,
                                  f"port {port}")
        group.connect(port=port)
        tp_group = _tp_group(group, config.tensor_parallel_size, config.pipeline_parallel_size, device)
        if tp_group is not None and tp_group is not group:
            tp_group.connect(parent=group)
        runner = ShardRunner(config, group, tp_group, show_progress=False)
    except BaseException as error:  # noqa: BLE001 - reported to rank 0, which refuses to start
        pipe.send(("error", f"{type(error).__name__}: {error}"))
        return
    sending = threading.Lock()

    def reply(message: tuple) -> None:
        with sending:
            pipe.send(message)

    runner.kv_shards = ShardServer(rank, runner.kv_layout(), runner.read_kv, reply)
    plans: queue.Queue = queue.Queue()
    pipe.send(("ready", None))
    threading.Thread(target=_read_plans, args=(pipe, runner.kv_shards, plans), name="iterserve-tp-plans",
                     daemon=True).start()
    while True:
        plan = plans.get()
        if plan is EOFError:
            logger.error("rank 0 is gone; rank %d exits", rank)
            return
        if plan is None:
            return
        try:
            runner.replay(plan)
        except BaseException:
            logger.exception("rank %d failed a step; the group ends", rank)
            os._exit(1)


def _read_plans(pipe, shards: ShardServer, plans: queue.Queue) -> None:
    """A worker's messages from rank 0: KV transfer messages are handled at once, step plans queued
    for the step loop (EOFError: rank 0 is gone)."""
    while True:
        try:
            message = pipe.recv()
        except (EOFError, OSError):
            plans.put(EOFError)
            return
        if isinstance(message, tuple) and message[:1] == (KV,):
            try:
                shards.handle(message)
            except Exception:  # noqa: BLE001 - a malformed message fails that transfer, not the rank
                logger.exception("KV transfer message %r failed", message[1])
            continue
        plans.put(message)
        if message is None:
            return


if __name__ == "__main__":
    worker_main(int(sys.argv[1]), int(sys.argv[2]))
