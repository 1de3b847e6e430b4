"""`iterserve serve`: serve a model over the OpenAI-compatible HTTP API.

With no arguments it serves the embedded SmolLM2-135M on 127.0.0.1:8000. The HTTP server starts
at once (GET /health answers while the model loads; GET /ready turns true once it is loaded).

SIGTERM (or Ctrl-C) drains: readiness goes false at once, new requests get 503, requests in
flight finish within --drain-timeout seconds (the rest are aborted), then the process exits 0.
A second Ctrl-C exits at once.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import os
import signal
import sys
from dataclasses import replace
from pathlib import Path

import uvicorn

from iterserve.engine.config import (
    DEFAULT_MAX_WAITING_REQUESTS,
    DEFAULT_MODEL,
    LORA,
    MODEL,
    PD,
    SCHEDULING,
    ConfigError,
    EngineConfig,
    parse_size,
)
from iterserve.engine.config_flags import add_engine_flags, engine_values
from iterserve.engine.fake_executor import FAKE_MODEL

logger = logging.getLogger("iterserve.server")


def configure(parser: argparse.ArgumentParser) -> None:
    """Serve's flags: the server's own, declared here, and one per EngineConfig field
    (engine/config_flags.py), each in its help group."""
    model = parser.add_argument_group(MODEL)
    model.add_argument("--model", default=DEFAULT_MODEL,
                       help=f"a .gguf file, a HuggingFace directory, or the alias {DEFAULT_MODEL} (default)")
    model.add_argument("--fake-model", action="store_true",
                       help="serve a fake model (deterministic letters, modelled step time, no weights): "
                            "for tests, load generators and simulations")
    model.add_argument("--served-model-name", help="the model id clients send and /v1/models lists")
    model.add_argument("--threads", default="auto",
                       help="CPU: torch compute threads, auto or a count (default auto: every usable CPU on "
                            "steps of >= 32 tokens, one fewer on smaller ones, and big steps of several "
                            "sequences run as two 1-thread halves at once; OMP_NUM_THREADS, when set, "
                            "fixes the count instead)")
    _http_flags(parser.add_argument_group("HTTP"))
    scheduling = parser.add_argument_group(SCHEDULING)
    pd = parser.add_argument_group(
        PD, "A prefill engine runs prompts and leases their KV blocks to decode engines, which pull them over "
            "TCP and generate (requests carry kv_transfer_params; the router's P/D path sends them).")
    lora = parser.add_argument_group(LORA, "Adapters in PEFT's format served beside the model; a request names one "
                                           "as its model (docs/lora.md).")
    add_engine_flags({MODEL: model, SCHEDULING: scheduling, PD: pd, LORA: lora})
    pd.add_argument("--kv-transfer-port", type=int, default=0,
                    help="port of the KV transfer listener, beside HTTP (role prefill; default 0: any "
                         "free port, reported in kv_transfer_params)")
    pd.add_argument("--kv-transfer-host",
                    help="address the KV transfer listener binds (default: --host)")
    pd.add_argument("--kv-advertise-host",
                    help="address written into kv_transfer_params for decode engines to connect to (default: the "
                         "bind address; this host's address when binding 0.0.0.0 or ::)")


def _http_flags(http: argparse._ArgumentGroup) -> None:
    http.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    http.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    http.add_argument("--max-waiting-requests", type=int, default=DEFAULT_MAX_WAITING_REQUESTS,
                      help="bound on the waiting queue; beyond it requests get 429 with Retry-After "
                           f"(default {DEFAULT_MAX_WAITING_REQUESTS})")
    http.add_argument("--max-request-body", default="8MiB",
                      help="largest request body accepted, e.g. 8MiB (default); larger bodies get 413")
    http.add_argument("--drain-timeout", type=float, default=30.0,
                      help="seconds in-flight requests get to finish after SIGTERM (default 30)")
    http.add_argument("--admin-token-file", metavar="PATH",
                      help="file holding the admin bearer token (else the env var ITERSERVE_ADMIN_TOKEN)")
    http.add_argument("--no-vllm-metric-names", dest="vllm_metric_names", action="store_false",
                      help="do not export the vllm:* metric aliases")
    http.add_argument("--max-logprobs", type=int, default=20,
                      help="most top logprobs per token a request may ask for (default 20)")
    http.add_argument("--access-log", action="store_true", help="log every HTTP request")
    http.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def serve_parser() -> argparse.ArgumentParser:
    """Serve's parser alone: what the operator, the pod runtime and tests check argument lists with."""
    parser = argparse.ArgumentParser(prog="iterserve serve", allow_abbrev=False)
    configure(parser)
    return parser


def serve_flags() -> dict[str, bool]:
    """Every serve flag (the long forms), and whether it takes a value."""
    return {o: a.nargs != 0 for a in serve_parser()._actions for o in a.option_strings if o.startswith("--")}


def serve_path_flags() -> tuple[str, ...]:
    """The serve flags whose value names a file of the machine (declared with metavar PATH)."""
    return tuple(o for a in serve_parser()._actions if a.metavar == "PATH" for o in a.option_strings)


def flags_of(*dests: str) -> tuple[str, ...]:
    """Every form of the flags that set these options (--chunked-prefill's is --no-chunked-prefill);
    a name that is no serve option is a KeyError, so a list built here cannot name a missing flag."""
    actions = {a.dest: a for a in serve_parser()._actions}
    return tuple(o for dest in dests for o in actions[dest].option_strings)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(model=FAKE_MODEL if args.fake_model else args.model, **engine_values(args))


def served_model_name(model: str) -> str:
    if model in (FAKE_MODEL, DEFAULT_MODEL):
        return model
    path = Path(model)
    return path.stem if path.suffix == ".gguf" else path.name


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def admin_token(args: argparse.Namespace) -> str | None:
    from iterserve.engine.server.admin import ADMIN_TOKEN_ENV

    if args.admin_token_file:
        token = Path(args.admin_token_file).read_text().strip()
        if not token:
            raise ConfigError(f"--admin-token-file {args.admin_token_file} is empty")
        return token
    return os.environ.get(ADMIN_TOKEN_ENV) or None


def check_server_args(args: argparse.Namespace) -> int:
    """Checks of the server's own flags (EngineConfig checks its fields); returns the body limit in bytes."""
    if args.max_waiting_requests < 1:
        raise ConfigError("--max-waiting-requests must be a positive integer")
    if not 0 <= args.max_logprobs <= 1024:
        raise ConfigError("--max-logprobs must be in [0, 1024]")
    if args.drain_timeout < 0:
        raise ConfigError("--drain-timeout must be >= 0 seconds")
    if not 0 <= args.kv_transfer_port < 65536:
        raise ConfigError("--kv-transfer-port must be in 0..65535 (0: any free port)")
    # rank i (of tensor x pipeline ranks) listens on --kv-transfer-port + i
    ranks = (getattr(args, "tensor_parallel_size", 1) or 1) * (getattr(args, "pipeline_parallel_size", 1) or 1)
    if args.kv_transfer_port and args.kv_transfer_port + ranks - 1 > 65535:
        raise ConfigError(f"--kv-transfer-port {args.kv_transfer_port} + {ranks} ranks - 1 passes 65535 (rank "
                          "i listens on --kv-transfer-port + i); pick a lower port")
    if args.kv_transfer_port and args.kv_transfer_port <= args.port < args.kv_transfer_port + ranks:
        raise ConfigError(f"--kv-transfer-port {args.kv_transfer_port} (one port per rank: up to "
                          f"{args.kv_transfer_port + ranks - 1}) takes the HTTP --port {args.port}; pick another")
    max_body = parse_size(args.max_request_body, "--max-request-body")
    if max_body < 1024:
        raise ConfigError("--max-request-body must be at least 1KiB")
    return max_body


def _configure_cpu_threads(config: EngineConfig, threads: str) -> None:
    """--threads, for a real model on a CPU (per step: engine/model/threads.py); ValueError if unreadable."""
    if config.model == FAKE_MODEL or config.device == "cuda":
        return
    from iterserve.engine.model.threads import configure_serving_threads
    from iterserve.engine.model_runner import pick_device

    if pick_device(config.device).type == "cpu":
        configure_serving_threads(threads)


def run(args: argparse.Namespace) -> int:
    from iterserve.engine.model.threads import prefer_passive_wait

    prefer_passive_wait()  # before torch loads libgomp: idle OpenMP workers sleep (engine/model/threads.py)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = engine_config(args)
        replace(config).resolve()  # fail fast on contradictory options, before binding the port
        token = admin_token(args)
        max_body = check_server_args(args)
    except (ConfigError, OSError) as error:
        print(f"iterserve serve: {error}", file=sys.stderr)
        return 2
    if config.node_rank > 0:  # a worker node: its ranks and a health endpoint, no API
        from iterserve.engine.distributed.multinode import run_worker_node

        return run_worker_node(config, args.host)

    from iterserve.engine.server.app import build_app
    from iterserve.engine.server.state import ServerOptions, ServerState

    try:
        _configure_cpu_threads(config, args.threads)
    except ValueError as error:
        print(f"iterserve serve: {error}", file=sys.stderr)
        return 2
    options = ServerOptions(
        config=config,
        served_model_name=args.served_model_name or served_model_name(config.model),
        max_waiting_requests=args.max_waiting_requests,
        vllm_metric_names=args.vllm_metric_names,
        admin_token=token,
        loopback_only=is_loopback(args.host),
        drain_timeout_s=args.drain_timeout,
        max_request_body_bytes=max_body,
        max_logprobs=args.max_logprobs,
        kv_transfer_host=args.kv_transfer_host or args.host,
        kv_transfer_port=args.kv_transfer_port,
        kv_advertise_host=args.kv_advertise_host,
    )
    state = ServerState(options)
    # loop="asyncio": uvicorn would take uvloop (installed for the router) on its own; the engine's
    # event loop is only measured on asyncio's.
    server = DrainingServer(
        uvicorn.Config(build_app(state), host=args.host, port=args.port, log_config=None, loop="asyncio",
                       log_level=args.log_level, access_log=args.access_log, timeout_graceful_shutdown=5),
        state,
    )
    host = f"[{args.host}]" if ":" in args.host else args.host
    logger.info("serving model %s on http://%s:%d (OpenAI API under /v1, metrics at /metrics)",
                options.served_model_name, host, args.port)
    if token is None and not options.loopback_only:
        logger.warning("no admin token set: the admin API is refused; set ITERSERVE_ADMIN_TOKEN to enable it")
    server.run()
    if state.engine is None and state.load_error is None:
        # Stopped while the model was loading: the loader thread cannot be interrupted, and
        # waiting for it would ignore the SIGTERM for as long as loading takes.
        logger.info("stopped while the model was still loading; exiting now")
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(server.exit_code)
    return server.exit_code


class DrainingServer(uvicorn.Server):
    """uvicorn's server, with SIGTERM turned into a drain instead of an immediate shutdown."""

    def __init__(self, config: uvicorn.Config, state):
        super().__init__(config)
        self.state = state
        self.exit_code = 0
        self._signalled = False
        self._drain_task: asyncio.Task | None = None

    def handle_exit(self, sig: int, frame) -> None:
        # Runs in a signal handler: only set flags; on_tick (every 0.1 s, on the loop) acts on them.
        if self._signalled and sig == signal.SIGINT:
            self.should_exit = self.force_exit = True
        self._signalled = True

    async def on_tick(self, counter: int) -> bool:
        if self._signalled and self._drain_task is None:
            self._drain_task = asyncio.create_task(self._drain_then_exit())
        if self.state.load_error is not None:
            self.exit_code = 1
            self.should_exit = True
        return await super().on_tick(counter)

    async def _drain_then_exit(self) -> None:
        await self.state.drain(self.state.options.drain_timeout_s)
        await asyncio.sleep(0.1)  # let the last responses flush
        self.should_exit = True
