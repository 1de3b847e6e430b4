"""`iterserve router`: a load-aware proxy in front of engine replicas.

    iterserve router --endpoints http://127.0.0.1:8001,http://127.0.0.1:8002 --port 8000
    iterserve router --infsvc NAME -n NAMESPACE        # the InferenceService's ready pods
    iterserve router --prefill http://127.0.0.1:8001 --decode http://127.0.0.1:8002 --port 8000   # P/D
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import secrets
import signal
import sys

from iterserve.engine.config import ConfigError, parse_size
from iterserve.engine.kv_transfer.auth import load_key
from iterserve.router import disagg
from iterserve.router.activator import ActivatorOptions
from iterserve.router.discovery import ROLE_LABEL, RolePools
from iterserve.router.picking import PickPolicy
from iterserve.router.proxy import RouterOptions


def configure(parser: argparse.ArgumentParser) -> None:
    parser.epilog = ("Each request goes to the replica with the least load = max(waiting + running "
                     "from its /metrics, requests in flight from this router); ties at random. "
                     "With a prefill pool (--prefill, or pods labelled "
                     f"{ROLE_LABEL}=prefill), a completions or chat request whose uncached prompt is longer "
                     "than --pd-threshold-tokens is first prefilled on the least-loaded prefill replica "
                     "(max_tokens 1) while its queue is under --pd-max-prefill-queue; its decode replica "
                     "then pulls the prompt's KV and generates. A prefill that fails or times out falls "
                     "back to the decode replica prefilling the prompt itself.")
    where = parser.add_argument_group("replicas (--endpoints and/or --prefill + --decode, or --infsvc)")
    where.add_argument("--endpoints", help="comma-separated base URLs of the engines (no Kubernetes), role "
                       "both; not with --prefill: role both takes no kv_transfer_params, so it cannot decode "
                       "from a prefill replica's KV")
    where.add_argument("--prefill", metavar="URL[,URL...]",
                       help="P/D: the prefill replicas (engines started with --role prefill)")
    where.add_argument("--decode", metavar="URL[,URL...]",
                       help="P/D: the decode replicas (engines started with --role decode)")
    where.add_argument("--infsvc", metavar="NAME",
                       help="route to the Ready pods of this InferenceService (watched on the API server); "
                            f"pods labelled {ROLE_LABEL}=prefill form the prefill pool, the others take "
                            "requests")
    where.add_argument("-n", "--namespace", default="default", help="the InferenceService's namespace")
    where.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster, else ~/.kube/config)")
    where.add_argument("--port-name", default="http", help="the pods' container port to send to (default http)")

    _add_front_door_flags(parser)
    _add_picking_flags(parser)
    _add_pd_flags(parser)
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def _add_picking_flags(parser: argparse.ArgumentParser) -> None:
    d = RouterOptions()
    p = PickPolicy()
    pick = parser.add_argument_group("picking")
    pick.add_argument("--scrape-interval", type=float, default=d.scrape_interval_s,
                      help=f"seconds between /metrics scrapes of each replica (default {d.scrape_interval_s:g})")
    pick.add_argument("--stale-after", type=float,
                      help="a scrape older than this many seconds is ignored and the replica is picked on "
                           "local in-flight counts (default 5 scrape intervals, at least 1 s)")
    pick.add_argument("--max-queue", type=int, default=p.max_queue,
                      help="requests a replica may queue beyond its max_num_seqs before it counts as "
                           f"saturated (default {p.max_queue})")
    pick.add_argument("--queue-timeout", type=float, default=d.queue_timeout_s,
                      help="seconds a request waits while every replica is saturated, then 429 "
                           f"(default {d.queue_timeout_s:g})")
    pick.add_argument("--hold-timeout", type=float, default=d.activator.hold_timeout_s,
                      help="seconds a request waits while no replica is ready (an InferenceService at zero "
                           "replicas, or one still starting), then 503 with Retry-After; 0: 503 at once "
                           f"(default {d.activator.hold_timeout_s:g})")
    pick.add_argument("--hold-max", type=int, default=d.activator.max_held,
                      help="requests held at once while no replica is ready; one more gets 503 at once "
                           f"(default {d.activator.max_held})")
    pick.add_argument("--eject-backoff", type=float, default=d.eject_backoff_s,
                      help="seconds a replica stays out after a connection error; doubles while it "
                           f"keeps failing, up to --max-eject-backoff (default {d.eject_backoff_s:g})")
    pick.add_argument("--max-eject-backoff", type=float, default=d.max_eject_backoff_s)
    pick.add_argument("--prefix-affinity", action="store_true",
                      help="prefer the replica that recently served the prompt's prefix while its load is "
                           "within --affinity-tolerance of the least (off by default)")
    pick.add_argument("--affinity-tolerance", type=int, default=p.affinity_tolerance)
    pick.add_argument("--prefix-tokens", type=int, default=d.prefix_tokens,
                      help=f"prompt tokens the prefix affinity hashes (default {d.prefix_tokens})")
    pick.add_argument("--block-size", type=int, default=d.block_size,
                      help=f"the engines' KV block size, for block-aligned prefix hashes (default {d.block_size})")
    pick.add_argument("--seed", type=int, help="seed of the random tie-break")
    pick.add_argument("--policy", default="least-load", choices=["least-load", "round-robin"],
                      help="round-robin: ignore loads (a baseline for comparisons; default least-load)")


def _add_pd_flags(parser: argparse.ArgumentParser) -> None:
    d = RouterOptions()
    pdp = disagg.PdPolicy()
    pd = parser.add_argument_group("prefill/decode disaggregation (with a prefill pool)")
    pd.add_argument("--pd-threshold-tokens", type=int, default=pdp.threshold_tokens,
                    help="prefill remotely only prompts with more uncached tokens than this (default "
                         f"{pdp.threshold_tokens}: shorter prompts cost more to move than to compute)")
    pd.add_argument("--pd-max-prefill-queue", type=int, default=pdp.max_prefill_queue,
                    help="prefill remotely only while the least-loaded prefill replica has fewer requests "
                         f"than this (waiting + running); otherwise prefill locally (default {pdp.max_prefill_queue})")
    pd.add_argument("--kv-auth-key-file",
                    help="file holding the InferenceService's KV key, which signs the router's prefill calls "
                         "(the engines' --kv-auth-key-file; required with a prefill pool)")
    pd.add_argument("--pd-prefill-timeout", type=float, default=d.pd_prefill_timeout_s,
                    help="seconds to wait for a prefill replica's answer before the decode replica prefills "
                         f"locally (default {d.pd_prefill_timeout_s:g})")


def _add_front_door_flags(parser: argparse.ArgumentParser) -> None:
    d = RouterOptions()
    http = parser.add_argument_group("HTTP")
    http.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    http.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    http.add_argument("--max-request-body", default="8MiB",
                      help="largest request body accepted, e.g. 8MiB (default: the engines' own default); "
                           "larger bodies get 413")
    http.add_argument("--client-header-timeout", type=float, default=d.head_timeout_s,
                      help="seconds a connection has to send a whole request head, from opening or from its "
                           f"previous answer; then it is closed (default {d.head_timeout_s:g})")
    http.add_argument("--client-body-timeout", type=float, default=d.body_timeout_s,
                      help=f"seconds a request body has to arrive; then 408 (default {d.body_timeout_s:g})")
    http.add_argument("--max-connections", type=int, default=d.max_connections,
                      help="concurrent client connections; one more gets 503 and is closed "
                           f"(default {d.max_connections})")
    http.add_argument("--drain-grace", type=float, default=d.drain_grace_s,
                      help="on SIGTERM, seconds requests in flight get to finish before they are cut (a cut "
                           f"stream ends with an SSE error event, not [DONE]) (default {d.drain_grace_s:g})")
    http.add_argument("--event-loop", choices=("auto", "uvloop", "asyncio"), default="auto",
                      help="the event loop: uvloop (less CPU per request) or asyncio's own; auto: uvloop "
                           "when installed (default auto)")
    http.add_argument("--tenant-salt-header", metavar="NAME",
                      help="the header naming each request's tenant (set by your gateway): the router sets "
                           "cache_salt to a keyed hash of it, replacing the client's, so tenants never share "
                           "prefix-cache KV; a request without it gets 400 (default: off, one shared cache)")
    http.add_argument("--tenant-salt-key-file", metavar="PATH",
                      help="file holding the key of the tenant salt's HMAC; give every router replica the "
                           "same one (default: a random key per process)")


def options_from(args: argparse.Namespace) -> RouterOptions:
    stale = args.stale_after if args.stale_after is not None else max(1.0, 5 * args.scrape_interval)
    return RouterOptions(
        host=args.host, port=args.port, scrape_interval_s=args.scrape_interval, stale_after_s=stale,
        scrape_timeout_s=max(stale, args.scrape_interval), queue_timeout_s=args.queue_timeout,
        eject_backoff_s=args.eject_backoff, max_eject_backoff_s=args.max_eject_backoff,
        policy=PickPolicy(max_queue=args.max_queue, affinity_tolerance=args.affinity_tolerance),
        prefix_affinity=args.prefix_affinity, prefix_tokens=args.prefix_tokens,
        block_size=args.block_size, seed=args.seed, round_robin=args.policy == "round-robin",
        pd=disagg.PdPolicy(threshold_tokens=args.pd_threshold_tokens, max_prefill_queue=args.pd_max_prefill_queue,
                           auth_key=load_key(args.kv_auth_key_file) if args.kv_auth_key_file else None),
        pd_prefill_timeout_s=args.pd_prefill_timeout,
        max_body_bytes=parse_size(args.max_request_body, "--max-request-body"),
        head_timeout_s=args.client_header_timeout, body_timeout_s=args.client_body_timeout,
        max_connections=args.max_connections, drain_grace_s=args.drain_grace,
        tenant_salt_header=args.tenant_salt_header, tenant_salt_key=_salt_key(args.tenant_salt_key_file),
        activator=ActivatorOptions(hold_timeout_s=args.hold_timeout, max_held=args.hold_max),
    )


def _salt_key(path: str | None) -> bytes:
    if path is None:
        return secrets.token_bytes(32)
    with open(path, "rb") as f:
        key = f.read().strip()
    if len(key) < 16:
        raise ConfigError(f"--tenant-salt-key-file {path}: the key must be at least 16 bytes")
    return key


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    static = bool(args.endpoints or args.prefill or args.decode)
    if static == bool(args.infsvc):
        which = "not both" if static else "none was given"
        print("iterserve router: give exactly one of: the replicas as URLs (--endpoints URL,..., and/or --prefill "
              f"URL,... --decode URL,...), or --infsvc NAME ({which})", file=sys.stderr)
        return 2
    if args.prefill and (args.endpoints or not args.decode):
        print("iterserve router: --prefill needs replicas to decode on: --decode URL,... (engines started with "
              "--role decode), and no --endpoints (role both refuses kv_transfer_params)", file=sys.stderr)
        return 2
    if args.prefill and not args.kv_auth_key_file:
        print("iterserve router: --prefill needs --kv-auth-key-file (the engines' KV key): the prefill "
              "replicas refuse unsigned prefill calls", file=sys.stderr)
        return 2
    if args.decode and not args.prefill:
        print("iterserve router: --decode needs --prefill URL,... (the prefill pool); without one, give "
              "the replicas as --endpoints", file=sys.stderr)
        return 2
    if args.pd_threshold_tokens < 0 or args.pd_max_prefill_queue < 1 or args.pd_prefill_timeout <= 0:
        print("iterserve router: --pd-threshold-tokens must be >= 0, --pd-max-prefill-queue >= 1 and "
              "--pd-prefill-timeout > 0", file=sys.stderr)
        return 2
    if args.scrape_interval <= 0 or args.queue_timeout < 0 or args.max_queue < 0:
        print("iterserve router: --scrape-interval must be > 0, --queue-timeout and --max-queue >= 0",
              file=sys.stderr)
        return 2
    if not 0 <= args.hold_timeout <= 3600 or not 1 <= args.hold_max <= 100_000:
        print("iterserve router: --hold-timeout must be within 0..3600 s and --hold-max within 1..100000",
              file=sys.stderr)
        return 2
    if min(args.client_header_timeout, args.client_body_timeout, args.max_connections) <= 0 or args.drain_grace < 0:
        print("iterserve router: --client-header-timeout, --client-body-timeout and --max-connections must be > 0, "
              "--drain-grace >= 0", file=sys.stderr)
        return 2
    try:
        options = options_from(args)
    except (ConfigError, OSError) as error:
        print(f"iterserve router: {error}", file=sys.stderr)
        return 2
    with asyncio.Runner(loop_factory=_loop_factory(args.event_loop)) as runner:
        return runner.run(_main(args, options))


def _loop_factory(name: str):
    """uvloop's loop when installed (libuv transports: about a tenth less CPU per proxied request
    than asyncio's own, which is the router's cost on the request path), else asyncio's."""
    if name in ("auto", "uvloop"):
        try:
            import uvloop
        except ImportError:
            if name == "uvloop":
                raise SystemExit("iterserve router: --event-loop uvloop, but uvloop is not installed "
                                 "(pip install uvloop, or --event-loop asyncio)") from None
        else:
            return uvloop.new_event_loop
    return None  # asyncio's default loop


async def _main(args: argparse.Namespace, options: RouterOptions) -> int:
    from iterserve.router.discovery import (
        PodWatch,
        api_client,
        inference_service_selector,
        parse_endpoints,
    )
    from iterserve.router.proxy import Router

    log = logging.getLogger("iterserve.router")
    router = Router(options)
    try:
        await router.start()
    except OSError as error:
        print(f"iterserve router: cannot listen on {options.host}:{options.port}: {error}", file=sys.stderr)
        return 1
    watch = None
    if not args.infsvc:
        router.set_endpoints([*parse_endpoints(args.endpoints or ""), *parse_endpoints(args.decode or "")])
        router.set_prefill_endpoints(parse_endpoints(args.prefill or ""))
        source = f"{len(router.endpoints)} static endpoint(s)"
        if router.prefills:
            pd = options.pd
            source += (f" and {len(router.prefills)} prefill endpoint(s) (remote prefill above "
                       f"{pd.threshold_tokens} uncached tokens, prefill queue under {pd.max_prefill_queue})")
    else:
        loop = asyncio.get_running_loop()
        selector = inference_service_selector(args.infsvc)

        def on_change(pools: RolePools) -> None:
            router.set_prefill_endpoints(pools.prefill)
            router.set_endpoints(pools.serving)

        watch = PodWatch(api_client(args.kubeconfig), args.namespace, selector,
                         lambda pools: loop.call_soon_threadsafe(on_change, pools), args.port_name,
                         by_role=True, infsvc=args.infsvc).start()
        source = (f"the ready pods of InferenceService {args.namespace}/{args.infsvc} ({selector}; "
                  f"{ROLE_LABEL}=prefill pods prefill)")
    log.info("routing on http://%s:%d to %s (metrics at /metrics)", options.host, router.port, source)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("stopping: no new connections; requests in flight get up to %g s (--drain-grace)",
             options.drain_grace_s)
    await router.drain()
    if watch is not None:
        watch.stop()
    await router.close()
    return 0
