"""What one server process holds: its options, the engine (once loaded), metrics and the drain
state. Readiness = the model is loaded, the engine is healthy and the server is not draining."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from iterserve.engine.config import DEFAULT_MAX_WAITING_REQUESTS, EngineConfig
from iterserve.engine.llm_engine import EngineStats, LLMEngine
from iterserve.engine.server.async_engine import AsyncEngine
from iterserve.engine.server.errors import APIError, unavailable
from iterserve.engine.server.metrics import ServerMetrics

logger = logging.getLogger("iterserve.server")


@dataclass
class ServerOptions:
    config: EngineConfig
    served_model_name: str
    max_waiting_requests: int = DEFAULT_MAX_WAITING_REQUESTS
    vllm_metric_names: bool = True
    admin_token: str | None = None
    loopback_only: bool = True
    drain_timeout_s: float = 30.0
    max_request_body_bytes: int = 8 * 1024**2
    max_logprobs: int = 20  # most top logprobs a request may ask for (per token); vLLM's default
    # KV transfer listener (role prefill): bind address and port (0: any free port), and the
    # address written into kv_transfer_params for decode engines to connect to.
    kv_transfer_host: str = "127.0.0.1"
    kv_transfer_port: int = 0
    kv_advertise_host: str | None = None


class ServerState:
    def __init__(self, options: ServerOptions, engine_factory: Callable[[EngineConfig], LLMEngine] = LLMEngine.from_config):
        self.options = options
        self.model_name = options.served_model_name
        self.engine_factory = engine_factory
        self.engine: AsyncEngine | None = None
        self.load_error: BaseException | None = None
        self.draining = False
        self.created = int(time.time())
        self.metrics = ServerMetrics(self.model_name, self._stats, options.vllm_metric_names)

    def _stats(self) -> EngineStats | None:
        return self.engine.stats() if self.engine is not None else None

    async def load(self) -> None:
        config = self.options.config
        logger.info("loading model %s", config.model)
        started = time.monotonic()
        try:
            engine = await _in_daemon_thread(self.engine_factory, config)
        except Exception as error:  # noqa: BLE001 - reported, and the process exits non-zero
            logger.error("could not start the engine: %s", error)
            self.load_error = error
            return
        if engine.kv_connector is not None:
            engine.kv_connector.on_transfer = self.metrics.observe_kv_transfer
        if config.role == "prefill":  # the only role that serves KV: the others open no port
            options = self.options
            try:
                engine.start_kv_transfer(options.kv_transfer_host, options.kv_transfer_port,
                                         options.kv_advertise_host or advertise_address(options.kv_transfer_host))
            except Exception as error:  # noqa: BLE001 - reported, and the process exits non-zero
                logger.error("could not start the KV transfer listener: %s", error)
                self.load_error = error
                engine.close()
                return
        self.engine = AsyncEngine(engine, self.options.max_waiting_requests, on_step=self.metrics.observe_step,
                                  on_failure=self.metrics.observe_engine_failure)
        self.engine.draining = self.draining
        self.engine.start(asyncio.get_running_loop())
        stats, config = engine.stats(), engine.config
        logger.info(
            "model %s ready in %.1f s: KV pool %d blocks x %d tokens = %d tokens; max_num_seqs %d, "
            "max_num_batched_tokens %d, max_model_len %d",
            self.model_name, time.monotonic() - started, stats.num_kv_blocks, stats.block_size,
            stats.num_kv_blocks * stats.block_size, stats.max_num_seqs, config.max_num_batched_tokens,
            config.max_model_len,
        )

    @property
    def engine_config(self) -> EngineConfig:
        return self.engine.engine.config if self.engine is not None else self.options.config

    @property
    def ready(self) -> bool:
        return self.engine is not None and self.engine.alive and not self.draining

    @property
    def failure(self) -> str | None:
        """Why this server can no longer serve (GET /health answers 503), or None."""
        if self.load_error is not None:
            return f"the model failed to load: {self.load_error}"
        if self.engine is not None and not self.engine.alive:
            error = self.engine.failed
            return f"the engine loop died: {type(error).__name__}: {error}" if error else "the engine loop stopped"
        return None

    def require_engine(self) -> AsyncEngine:
        if self.draining:
            raise unavailable("the server is draining and accepts no new requests; retry on another replica",
                              "draining")
        if self.engine is None:
            if self.load_error is not None:
                raise unavailable("the model failed to load; see the server log", "engine_failed")
            raise unavailable("the model is still loading; retry shortly", "loading")
        if not self.engine.alive:
            raise unavailable("the engine failed; see the server log", "engine_failed")
        return self.engine

    def engine_for(self, requested_model: str | None) -> AsyncEngine:
        """The engine, for a request naming `requested_model`: 503 while it cannot take one, 404 for
        a model (or LoRA adapter) this server does not serve."""
        engine = self.require_engine()
        self.check_model(requested_model)
        return engine

    def lora_of(self, requested: str | None) -> str | None:
        """The LoRA adapter a request's `model` names, None for the base model (engine/lora)."""
        return None if requested is None or requested == self.model_name else requested

    def check_model(self, requested: str | None) -> None:
        if requested is None or requested == self.model_name:
            return
        lora = self.engine.engine.lora if self.engine is not None else None
        if lora is not None and lora.is_registered(requested):
            return
        raise APIError(404, f"model {requested!r} does not exist: this server serves {self.model_name!r}"
                            + (f" and the LoRA adapters {[a.name for a in lora.adapters()]}" if lora else "")
                            + " (GET /v1/models)", "invalid_request_error", "model", "model_not_found")

    @property
    def in_flight(self) -> int:
        return self.engine.num_in_flight if self.engine is not None else 0

    def begin_drain(self) -> None:
        if not self.draining:
            logger.info("draining: readiness is false, new requests get 503; %d in flight", self.in_flight)
        self.draining = True
        if self.engine is not None:
            self.engine.draining = True

    async def drain(self, timeout_s: float) -> bool:
        """Wait until in-flight requests finish; after timeout_s abort the rest. True if none was cut."""
        self.begin_drain()
        deadline = time.monotonic() + timeout_s
        while self.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.in_flight:
            logger.warning("drain timeout (%.0f s): aborting %d requests", timeout_s, self.in_flight)
            self.engine.abort_all()
            return False
        leases = self._kv_leases()
        if leases:  # a prefill engine's leases: let decode engines finish pulling them
            logger.info("draining: waiting for %d KV leases to be pulled (at most until the drain timeout)", leases)
            while self._kv_leases() and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if self._kv_leases():
                logger.warning("drain timeout: %d KV leases were never pulled; decode engines recompute those "
                               "prompts", self._kv_leases())
        logger.info("drained: no request in flight")
        return True

    def _kv_leases(self) -> int:
        connector = self.engine.engine.kv_connector if self.engine is not None else None
        return connector.num_leases if connector is not None else 0

    def close(self) -> None:
        if self.engine is not None:
            self.engine.stop()


def advertise_address(bind_host: str) -> str:
    """The address decode engines reach a listener bound to bind_host at: bind_host itself, or for a
    wildcard bind this host's address by name (a pod's IP in Kubernetes)."""
    if bind_host not in ("0.0.0.0", "::", ""):
        return bind_host
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


async def _in_daemon_thread(function, *args):
    """Run function in a daemon thread: unlike asyncio.to_thread, a SIGTERM during model loading
    does not have to wait for the loading to end before the process can exit."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def run() -> None:
        result, failure = None, None
        try:
            result = function(*args)
        except BaseException as error:  # noqa: BLE001 - handed to the awaiting coroutine
            failure = error
        try:
            loop.call_soon_threadsafe(_settle, future, result, failure)
        except RuntimeError:  # the server stopped while loading: nobody is waiting
            pass

    threading.Thread(target=run, name="model-loader", daemon=True).start()
    return await future


def _settle(future: asyncio.Future, result, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
