"""Several nodes (`--nnodes N --node-rank R --master-addr HOST --master-port P`): the group's
tensor x pipeline ranks are spread evenly, `local = world / N` per node, and global rank =
node_rank x local + local_rank (so a pipeline stage's tensor-parallel ranks share a node when
tensor <= local).

- Node 0 is the leader: its `iterserve serve` is rank 0 (scheduler, sampler, HTTP API) and spawns
  its other local ranks as on one node (engine/distributed/tensor_parallel.py). It opens the
  rendezvous store, a torch TCPStore on --master-port (every interface).
- Node R > 0 runs ranks only (`run_worker_node`): it spawns its `local` rank processes (`python -m
  iterserve.engine.distributed.multinode RANK ...`), serves GET /health and /ready on
  --worker-health-port (no OpenAI API) and beats a heartbeat into the store.
- Rendezvous: --master-addr may be a DNS name that does not resolve yet (pods start in any order):
  it is resolved, and the store connected, with retries until --rendezvous-timeout. Rank 0 loads
  its slice, then publishes the config the others load with (its KV pool size and its resolution of
  --dtype/--device auto included: agreed_config) under `config`; every rank writes `joined/RANK`
  and waits for all, logging the missing ranks and their nodes every 10 s; the timeout's error
  names them. Then the gloo (or NCCL) groups form over the same store, each rank's gloo bound to
  the address its node reaches the leader from (the leader's: leader_address).
- Steps: the other nodes' ranks read rank 0's step plan from the store (`plan/N`, JSON; a rank
  waits on the key, so an idle group costs one wake-up per second), and record how far they read
  (`at/RANK`) so rank 0 deletes the plans everyone has read.
- KV transfer (--role prefill|decode; engine/kv_transfer/sharded.py): rank 0 and the other nodes'
  ranks exchange its messages through the store too (`Mailbox`: `kv/RANK/N` to a rank, `kvr/RANK/N`
  back, JSON, each read once and deleted), on store connections of their own; a prefill rank
  listens on --kv-transfer-port + rank and advertises its node's address (`kv_address`: the
  route's source towards the leader, its pod IP; the node's --host where that route is the
  loopback), which the lease answer names. It binds that address, or every interface when the
  leader's KV listener does.
- Failure: a worker node whose rank exits, or that loses the store (the leader is gone), logs why,
  answers /health 503, stops its ranks and exits 1 (the pod restarts). The leader ends the group
  when a node writes `failed` or its heartbeat stops for HEARTBEAT_TIMEOUT_S: /health turns 503
  and the leader exits 1 after LEADER_EXIT_GRACE_S, so the whole group restarts together.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict, fields, replace
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

from iterserve.engine.config import ConfigError, EngineConfig

logger = logging.getLogger(__name__)

HEARTBEAT_S = 1.0  # a worker node's heartbeat period
HEARTBEAT_TIMEOUT_S = 10.0  # the leader ends the group when a node's heartbeat is older
PLAN_POLL_S = 1.0  # an idle rank's wait on the next plan before it checks again
LEADER_EXIT_GRACE_S = 3.0  # a broken multi-node group's leader answers 503 this long, then exits 1
PROGRESS_EVERY = 16  # rank 0 deletes read plans every this many steps
_MISSING_LOG_S = 10.0
_MAX_CONFIG_BYTES = 1 << 20


def local_size(config: EngineConfig) -> int:
    """Ranks per node."""
    return config.tensor_parallel_size * config.pipeline_parallel_size // config.nnodes


def node_ranks(config: EngineConfig, node: int) -> range:
    local = local_size(config)
    return range(node * local, (node + 1) * local)


def resolve(host: str, deadline: float) -> str:
    """host's address, retrying a name that does not resolve yet until the deadline."""
    attempt = 0
    while True:
        try:
            return socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0]
        except (socket.gaierror, UnicodeError) as error:
            if time.monotonic() > deadline:
                raise ConfigError(f"--master-addr {host} did not resolve within --rendezvous-timeout ({error}); "
                                  "check the leader's name (its pod may not exist)") from None
            if attempt % 10 == 0:
                logger.info("--master-addr %s does not resolve yet (%s); retrying until --rendezvous-timeout",
                            host, error)
            attempt += 1
            time.sleep(min(2.0, 0.1 * attempt))


def own_address(master_ip: str, port: int) -> str:
    """This node's address as the leader's network sees it: the source address of the route to it."""
    family = socket.AF_INET6 if ":" in master_ip else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((master_ip, port))  # UDP: no packet is sent
        return probe.getsockname()[0]


def kv_address(host: str, master_ip: str, port: int) -> str:
    """The address a worker node's prefill ranks advertise for their KV listeners (and bind, unless
    the leader binds every interface): the source address of the route to the leader, as its gloo
    binds. But when that route is the loopback (the leader runs on this machine), the node's own
    --host if it names one address of this machine: where pods share one machine's loopback, each on
    a 127.x pod IP of its own (the local pod runtime), 127.0.0.1 would be every pod's, and two
    prefill groups' rank r would both bind kvTransferPort + r on it."""
    route = own_address(master_ip, port)
    if route.startswith("127.") or route == "::1":
        if host not in ("0.0.0.0", "::", "") and _bindable(host):
            return host
    return route


def _bindable(address: str) -> bool:
    """Whether this machine owns `address` (a socket can listen on it)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind((address, 0))
        return True
    except OSError:
        return False


def leader_address(master_ip: str, port: int) -> str:
    """The leader's address as the other nodes reach it: --master-addr's own address when it is this
    machine's (the pod IP behind a headless Service's name: the others connect to it by definition),
    else the address its hostname resolves to (the pod's), else the source address of the route to
    --master-addr. Not own_address(master_ip): the route to one's own address goes through lo, whose
    source is 127.0.0.1, which no other machine reaches."""
    if _bindable(master_ip):
        return master_ip
    try:
        mine = socket.getaddrinfo(socket.gethostname(), None, type=socket.SOCK_STREAM)[0][4][0]
    except (OSError, UnicodeError):
        mine = None
    if mine is not None and not mine.startswith("127.") and mine != "::1" and _bindable(mine):
        return mine
    return own_address(master_ip, port)


def agreed_config(config: EngineConfig, device: torch.device, dtype: torch.dtype) -> EngineConfig:
    """The config every other rank loads with: the leader's own resolution of the per-process `auto`
    choices whose disagreement breaks the first collective (--dtype auto times a bf16 matmul on each
    machine; --device auto looks for CUDA), so a node whose own measurement differs takes rank 0's."""
    return replace(config, device=device.type, dtype=str(dtype).removeprefix("torch."))


def check_leader_choices(config: EngineConfig) -> None:
    """A worker node refuses, naming the cause, a device or dtype the leader resolved that it cannot run."""
    from iterserve.engine.model_runner import pick_device

    told = f"the leader (node 0) resolved --device {config.device} --dtype {config.dtype} for every rank"
    fix = "start every node with a --device and --dtype all of them run (e.g. --device cpu --dtype float32)"
    try:
        device = pick_device(config.device)
        dtype = getattr(torch, config.dtype)
        a = torch.ones(2, 2, dtype=dtype, device=device)
        (a @ a).sum().item()
    except (ConfigError, RuntimeError, AttributeError, TypeError) as error:
        raise ConfigError(f"{told}; this node cannot run it ({error}); {fix}") from None


def connect_store(master_ip: str, port: int, deadline: float, running=lambda: None):
    """A client of the leader's store, retried until the deadline (the leader may start later);
    `running()` is called between attempts (it raises to give up)."""
    from torch.distributed import TCPStore

    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise ConfigError(f"the leader's rendezvous store at {master_ip}:{port} did not answer within "
                              "--rendezvous-timeout; check --master-addr/--master-port and that node 0 runs")
        try:
            return TCPStore(master_ip, port, None, False, timeout=timedelta(seconds=min(5.0, remaining)))
        except (RuntimeError, OSError) as error:  # DistNetworkError / DistStoreError: not up yet
            logger.debug("store %s:%d not reachable yet: %s", master_ip, port, error)
            running()
            time.sleep(0.5)


def await_ranks(store, rank: int, config: EngineConfig, deadline: float, where: str) -> None:
    """Write joined/RANK and wait for every rank's; logs (and at the deadline raises) the missing ones."""
    world = config.tensor_parallel_size * config.pipeline_parallel_size
    store.set(f"joined/{rank}", socket.gethostname())
    logged = time.monotonic()
    while True:
        missing = [r for r in range(world) if not store.check([f"joined/{r}"])]
        if not missing:
            return
        local = local_size(config)
        nodes = sorted({r // local for r in missing})
        text = f"ranks {missing} (node {', '.join(map(str, nodes))}) of {world}"
        if time.monotonic() > deadline:
            raise ConfigError(f"rendezvous at {where}: {text} did not join within --rendezvous-timeout "
                              f"{config.rendezvous_timeout:g} s; start every node with --nnodes {config.nnodes} and "
                              "its own --node-rank, reaching --master-addr")
        if time.monotonic() - logged > _MISSING_LOG_S:
            logger.warning("rendezvous at %s: waiting for %s", where, text)
            logged = time.monotonic()
        time.sleep(0.1)


def config_json(config: EngineConfig) -> str:
    return json.dumps(asdict(config))


def config_from_json(data: bytes) -> EngineConfig:
    if len(data) > _MAX_CONFIG_BYTES:
        raise ConfigError(f"the leader's config is {len(data)} bytes, over {_MAX_CONFIG_BYTES}")
    values = json.loads(data)
    known = {f.name for f in fields(EngineConfig)}
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items() if k in known}
    return EngineConfig(**values)


class PlanPublisher:
    """Rank 0's side of the plans the other nodes' ranks read from the store."""

    def __init__(self, store, readers: list[int]):
        self.store = store
        self.readers = readers
        self.next = 0
        self.deleted = 0

    def publish(self, plan) -> None:
        """One step's plan (a StepPlan), or None: the group ends."""
        self.store.set(f"plan/{self.next}", "null" if plan is None else json.dumps(asdict(plan)))
        self.next += 1
        if self.next % PROGRESS_EVERY == 0:
            read = min(int(value) for value in self.store.multi_get([f"at/{r}" for r in self.readers]))
            for step in range(self.deleted, read + 1):
                self.store.delete_key(f"plan/{step}")
            self.deleted = max(self.deleted, read + 1)


    def finish(self, timeout_s: float = 5.0) -> None:
        """End the other nodes' ranks and wait (a while) until they read it, before the store closes."""
        self.publish(None)
        last, deadline = self.next - 1, time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if min(int(value) for value in self.store.multi_get([f"at/{r}" for r in self.readers])) >= last:
                return
            time.sleep(0.05)


def read_plans(store, rank: int):
    """A worker rank's plans, in order: yields each StepPlan, returns at the leader's end (None).
    Raises when the store is gone (DistNetworkError: the leader died)."""
    from torch.distributed import DistNetworkError, DistStoreError

    from iterserve.engine.distributed.tensor_parallel import StepPlan

    step = 0
    while True:
        key = f"plan/{step}"
        try:
            store.wait([key], timedelta(seconds=PLAN_POLL_S))
        except DistNetworkError:
            raise
        except DistStoreError:  # the wait's timeout: an idle group
            continue
        data = store.get(key)
        store.set(f"at/{rank}", str(step))
        if data == b"null":
            return
        yield StepPlan(**json.loads(data))
        step += 1


class Mailbox:
    """KV transfer messages through the store: `box/N` for N = 0, 1, ... (JSON), each deleted once
    read. One writer and one reader per box, each on a store connection of its own (a reader blocks
    in wait)."""

    def __init__(self, master_ip: str, port: int, timeout_s: float):
        self.address = (master_ip, port, timeout_s)
        self._writer = self._connect()
        self._sent: dict[str, int] = {}
        self._lock = threading.Lock()

    def _connect(self):
        from torch.distributed import TCPStore

        host, port, timeout_s = self.address
        return TCPStore(host, port, None, False, timeout=timedelta(seconds=timeout_s))

    def send(self, box: str, message: tuple) -> None:
        with self._lock:
            n = self._sent.get(box, 0)
            self._writer.set(f"{box}/{n}", json.dumps(message))
            self._sent[box] = n + 1

    def read_forever(self, box: str, handle) -> None:
        """Calls handle(message) for each message of box, in order, until the store is gone."""
        from torch.distributed import DistNetworkError, DistStoreError

        store, n = self._connect(), 0
        while True:
            key = f"{box}/{n}"
            try:
                store.wait([key], timedelta(seconds=PLAN_POLL_S))
            except DistNetworkError:
                return  # the leader is gone: the group is ending
            except DistStoreError:
                continue
            message = tuple(json.loads(store.get(key)))
            store.delete_key(key)
            n += 1
            try:
                handle(message)
            except Exception:  # noqa: BLE001 - a malformed message fails that transfer, not the rank
                logger.exception("KV transfer message %r failed", message[1:2])


# -- a worker rank's process on node R > 0 -----------------------------------------------------------


def rank_main(rank: int, master_ip: str, port: int, deadline_s: float, parent: int, node_host: str) -> int:
    """Rank `rank` of the group, spawned by its node's run_worker_node (pid `parent`, started with
    --host `node_host`)."""
    from iterserve.engine.distributed.group import Group
    from iterserve.engine.distributed.tensor_parallel import ShardRunner, _cpu_threads, _tp_group
    from iterserve.engine.model_runner import pick_device

    _die_with_parent(parent)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s")
    deadline = time.monotonic() + deadline_s
    where = f"{master_ip}:{port}"
    try:
        store = connect_store(master_ip, port, deadline)
    except ConfigError as error:
        logger.error("%s; rank %d exits", error, rank)
        return 1
    try:
        store.wait(["config"], timedelta(seconds=max(1.0, deadline - time.monotonic())))
        config = config_from_json(store.get("config"))
        check_leader_choices(config)
        world = config.tensor_parallel_size * config.pipeline_parallel_size
        device = pick_device(config.device)
        if device.type == "cuda":
            torch.cuda.set_device(rank % local_size(config))
        _cpu_threads(local_size(config))
        group = Group(rank, world, device, address=own_address(master_ip, port))
        group.store = store
        await_ranks(store, rank, config, deadline, where)
        group.connect()
        tp_group = _tp_group(group, config.tensor_parallel_size, config.pipeline_parallel_size, device)
        if tp_group is not None and tp_group is not group:
            tp_group.connect(parent=group)
        runner = ShardRunner(config, group, tp_group, show_progress=False)
    except BaseException as error:  # noqa: BLE001 - reported to the leader, which refuses to start
        message = f"rank {rank} failed to start: {type(error).__name__}: {error}"
        logger.error("%s", message)
        try:
            store.set("failed", message)
        except Exception:  # noqa: BLE001 - the store itself may be what failed
            pass
        return 1
    if config.role != "both":  # KV transfer messages (engine/kv_transfer/sharded.py) through the store
        from iterserve.engine.kv_transfer.sharded import ShardServer

        mailbox = Mailbox(master_ip, port, config.rendezvous_timeout)
        runner.kv_shards = ShardServer(rank, runner.kv_layout(), runner.read_kv,
                                       lambda message: mailbox.send(f"kvr/{rank}", message),
                                       advertise=kv_address(node_host, master_ip, port))
        threading.Thread(target=mailbox.read_forever, args=(f"kv/{rank}", runner.kv_shards.handle),
                         name="iterserve-kv-mailbox", daemon=True).start()
    store.set(f"at/{rank}", "-1")
    store.set(f"ready/{rank}", "1")
    logger.info("rank %d of %d ready (stage %d, tensor rank %d)", rank, world, runner.stage, runner.tp_rank)
    try:
        for plan in read_plans(store, rank):
            runner.replay(plan)
    except BaseException as error:  # noqa: BLE001
        logger.error("rank %d: the group is broken (%s: %s); the leader (rank 0 at %s) or a peer is gone; exiting",
                     rank, type(error).__name__, error, where)
        return 1
    logger.info("rank %d: the leader ended the group", rank)
    return 0


# -- node R > 0: the node's process (iterserve serve --node-rank R) ------------------------------------


class _Health:
    def __init__(self):
        self.ready = False
        self.failure: str | None = None


def _health_server(host: str, port: int, health: _Health) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            if self.path == "/health":
                status, body = (503, health.failure) if health.failure else (200, "ok")
            elif self.path == "/ready":
                status, body = (200, "ready") if health.ready and not health.failure else (503, "not ready")
            else:
                status, body = 404, "a worker node serves GET /health and /ready only; the API is on node 0"
            data = body.encode()
            self.send_response(status)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    class Server(ThreadingHTTPServer):
        address_family = socket.AF_INET6 if ":" in host else socket.AF_INET  # --host :: binds IPv6 too

    server = Server((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="iterserve-worker-health", daemon=True).start()
    return server


def _die_with_parent(parent: int) -> None:
    """A rank dies with its node's process (a killed pod takes its ranks along); set in the child, as
    a preexec_fn is unsafe beside the health server's thread."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # it died before the prctl
        os._exit(1)


def run_worker_node(config: EngineConfig, host: str) -> int:
    """`iterserve serve --node-rank R` (R > 0): this node's ranks, a health endpoint, a heartbeat.
    Returns the exit code: 0 when the leader ended the group, 1 when the group broke."""
    ranks = node_ranks(config, config.node_rank)
    deadline = time.monotonic() + config.rendezvous_timeout
    health = _Health()
    server = _health_server(host, config.worker_health_port, health)
    logger.info("node %d of %d: ranks %d..%d of the group; GET /health and /ready on %s:%d (no API: node 0 serves it)",
                config.node_rank, config.nnodes, ranks[0], ranks[-1], host, config.worker_health_port)
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    processes: dict[int, subprocess.Popen] = {}

    def fail(message: str) -> int:
        health.failure = message
        logger.error("%s; node %d leaves the group (exit 1)", message, config.node_rank)
        _stop(processes)
        server.shutdown()
        return 1

    try:
        master_ip = resolve(config.master_addr, deadline)
    except ConfigError as error:
        return fail(str(error))
    for rank in ranks:
        processes[rank] = subprocess.Popen(
            [sys.executable, "-m", "iterserve.engine.distributed.multinode", str(rank), master_ip,
             str(config.master_port), str(max(1.0, deadline - time.monotonic())), str(os.getpid()), host],
            env={**os.environ, "TORCH_CPP_LOG_LEVEL": os.environ.get("TORCH_CPP_LOG_LEVEL", "ERROR")})  # an idle
        # rank's one-second waits on the next plan would each log a c10d timeout warning

    def check_ranks() -> None:
        for rank, process in processes.items():
            if process.poll() is not None and process.returncode != 0:
                raise _RankExited(f"rank {rank} (pid {process.pid}) exited with code {process.returncode}")

    heartbeat = f"heartbeat/{config.node_rank}"
    store = None
    try:
        store = connect_store(master_ip, config.master_port, deadline, check_ranks)
        while not stopping.is_set():
            check_ranks()
            if all(process.poll() == 0 for process in processes.values()):
                logger.info("node %d: the leader ended the group; exiting", config.node_rank)
                server.shutdown()
                return 0
            store.add(heartbeat, 1)
            if not health.ready and store.check([f"ready/{rank}" for rank in ranks]):
                health.ready = True
                logger.info("node %d: ranks %d..%d joined the group and loaded the model", config.node_rank,
                            ranks[0], ranks[-1])
            stopping.wait(HEARTBEAT_S)
    except _RankExited as error:
        message = f"{error}; the group cannot compute without it"
        try:
            if store is not None:
                store.set("failed", f"node {config.node_rank}: {message}")
        except Exception:  # noqa: BLE001 - best effort: the heartbeat's end tells the leader too
            pass
        return fail(message)
    except ConfigError as error:
        return fail(str(error))
    except Exception as error:  # noqa: BLE001 - the store is gone: so is the leader
        return fail(f"lost the leader's store at {config.master_addr}:{config.master_port} "
                    f"({type(error).__name__}: {error}): the leader is gone")
    logger.info("node %d: SIGTERM; stopping ranks %d..%d", config.node_rank, ranks[0], ranks[-1])
    _stop(processes)
    server.shutdown()
    return 0


class _RankExited(Exception):
    pass


def _stop(processes: dict[int, subprocess.Popen]) -> None:
    for process in processes.values():
        if process.poll() is None:
            process.terminate()
    for process in processes.values():
        try:
            process.wait(5.0)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5.0)


if __name__ == "__main__":
    sys.exit(rank_main(int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5]),
                       sys.argv[6]))
