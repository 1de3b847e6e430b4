"""The `iterserve` command. Each subcommand lives in its own module, imported only when used,
so `iterserve --help` stays fast and a missing optional part never breaks the others.

A subcommand module defines `configure(parser)` and `run(args) -> int`.
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("iterserve.engine.server.cli", "serve a model over an OpenAI-compatible HTTP API"),
    "generate": ("iterserve.engine.cli_generate", "generate text offline from prompts (no server)"),
    "loadgen": ("iterserve.engine.loadgen", "drive a server with Poisson traffic and report latency"),
    "operator": ("iterserve.operator.cli", "run the Kubernetes operator"),
    "crd": ("iterserve.operator.crd", "print the InferenceService CRD generated from the models"),
    "dev-cluster": ("iterserve.devcluster.cli", "start or stop a local Kubernetes control plane"),
    "simulate": ("iterserve.simulate.cli", "replay a trace against an autoscaled fleet on a simulated clock"),
    "router": ("iterserve.router.cli", "route requests to the least-loaded engine replica"),
}


def _load(module_name: str):
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):
            return None
        raise


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="iterserve",
        description="Continuous-batching LLM serving engine and Kubernetes operator.",
    )
    from iterserve import __version__

    parser.add_argument("--version", action="version", version=f"iterserve {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    return parser, subparsers


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser, subparsers = build_parser()
    wanted = argv[0] if argv and not argv[0].startswith("-") else None
    modules = {}
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        if wanted is not None and name != wanted:
            subparsers.add_parser(name, help=help_text, add_help=False)
            continue
        module = _load(module_name)
        if module is None:
            continue
        sub = subparsers.add_parser(name, help=help_text, description=help_text)
        module.configure(sub)
        modules[name] = module
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    return int(modules[args.command].run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
