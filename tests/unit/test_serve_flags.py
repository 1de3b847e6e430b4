"""Serve's flags come from one definition: EngineConfig's fields (engine/config_flags.py) plus the
server's own. The operator's argument lists, its managed flags and the pod runtime's allow-list are
all checked against serve's own parser."""

from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

import pytest
import yaml

from iterserve.engine.config import EngineConfig
from iterserve.engine.config_flags import flag_fields, flag_name, value_type
from iterserve.engine.server.cli import engine_config, serve_flags, serve_parser, serve_path_flags
from iterserve.operator import resources
from iterserve.operator.disaggregation import build_disaggregation
from iterserve.operator.routing import build_routing
from iterserve.operator.validation import SpecError, parse_spec

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
OWNER = resources.Owner("llm", "team-a", "uid-1")
# What the kubelet would expand the operator's $(VAR) references to.
ENV_VALUES = {resources.MAX_NUM_SEQS_ENV: "8", resources.POD_IP_ENV: "10.0.0.7"}


def _example_specs() -> list[tuple[str, dict]]:
    """Every example, as written and with every builder path switched on: the router, disaggregation
    (prefill and decode pods) and every optional engine field."""
    specs = []
    for path in sorted(EXAMPLES.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == "InferenceService":
                spec = doc["spec"]
                engine = {**spec.get("engine", {}), "maxNumBatchedTokens": 1024, "maxModelLen": 512,
                          "chunkedPrefill": False}
                specs += [(path.name, spec), (f"{path.name} + every path", {
                    **spec, "engine": {**engine, "maxNumBatchedTokens": 2048, "chunkedPrefill": True},
                    "routing": {"mode": "Router"}, "disaggregation": {"enabled": True}}),
                    (f"{path.name} + no chunked prefill", {**spec, "engine": engine})]
    assert len(specs) >= 6, "no InferenceService found under examples/"
    return specs


def _containers(spec) -> list[dict]:
    objects = [*resources.build_owned(OWNER, spec, 8), *build_disaggregation(OWNER, spec),
               *build_routing(OWNER, spec)]
    return [c for o in objects if o["kind"] == "Deployment" for c in o["spec"]["template"]["spec"]["containers"]]


def _expand(arg: str) -> str:
    return re.sub(r"\$\((\w+)\)", lambda m: ENV_VALUES[m.group(1)], arg)


class _ParseError(Exception):
    pass


def _strict(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    def error(message):  # argparse would print and exit; the test wants the message
        raise _ParseError(message)
    parser.error = error
    return parser


@pytest.mark.parametrize("name, raw", _example_specs(), ids=lambda v: v if isinstance(v, str) else "")
def test_every_argument_list_the_operator_builds_parses_with_the_commands_own_parser(name, raw):
    from iterserve.router.cli import configure as configure_router

    spec = parse_spec(raw)
    commands = []
    for container in _containers(spec):
        args = [_expand(a) for a in container["args"]]
        commands.append(container["command"])
        if container["command"] == ["iterserve", "serve"]:
            config = engine_config(_strict(serve_parser()).parse_args(args))
            dataclasses.replace(config).resolve()  # and the values pass the engine's start-up rules
        else:
            assert container["command"] == ["iterserve", "router"], container["command"]
            router = argparse.ArgumentParser(allow_abbrev=False)
            configure_router(router)
            _strict(router).parse_args(args)
    assert ["iterserve", "serve"] in commands


def test_no_flag_parses_to_engine_config_defaults_and_each_flag_sets_its_field():
    assert engine_config(serve_parser().parse_args([])) == EngineConfig()  # serve restates no default
    samples = {int: "3", float: "0.25", str: "x"}
    for f in flag_fields():
        if value_type(f.name) is bool:
            continue  # switches: below
        value = f.metadata["choices"][-1] if f.metadata["choices"] else samples[value_type(f.name)]
        parsed = engine_config(serve_parser().parse_args([flag_name(f.name), value]))
        got = getattr(parsed, f.name)
        assert (got == (value,) if isinstance(f.default, tuple) else str(got) == value), f.name  # a list flag: a tuple
    switches = serve_parser().parse_args(["--no-chunked-prefill", "--compile", "--no-enable-prefix-caching"])
    assert (switches.chunked_prefill, switches.compile, switches.enable_prefix_caching) == (False, True, False)


def test_kv_auth_key_file_is_a_generated_flag_naming_a_file():
    assert "--kv-auth-key-file" in serve_flags() and "--kv-auth-key-file" in serve_path_flags()
    args = serve_parser().parse_args(["--kv-auth-key-file", "/k"])
    assert engine_config(args).kv_auth_key_file == "/k"


def test_managed_flags_are_serve_flags_in_every_form():
    assert set(resources.MANAGED_FLAGS) <= set(serve_flags())
    assert "--no-chunked-prefill" in resources.MANAGED_FLAGS and "--chunked-prefill" not in serve_flags()


def test_the_pod_runtime_allows_only_serve_flags_and_no_file_flag_outside_a_secret_volume():
    from iterserve.devcluster.podrunner.launch import REFUSED_SERVE_FLAGS, SERVE_FLAGS
    from iterserve.devcluster.podrunner.secret_files import FILE_FLAGS

    assert SERVE_FLAGS.items() <= serve_flags().items()
    assert "--step-log" in REFUSED_SERVE_FLAGS and "--step-log" not in SERVE_FLAGS
    assert {f for f in SERVE_FLAGS if f in serve_path_flags()} <= set(FILE_FLAGS)


@pytest.mark.parametrize("field, extra, message", [
    ("spec.engine.extraArgs[0]", {"engine": {"extraArgs": ["--max-num-s", "9"]}}, "not an `iterserve serve` flag"),
    ("spec.engine.extraArgs[0]", {"engine": {"extraArgs": ["--chunked-prefill"]}}, "not an `iterserve serve` flag"),
    ("spec.engine.extraArgs[1]", {"engine": {"extraArgs": ["--seed=1", "--no-chunked-prefill"]}},
     "set by the operator"),
    ("spec.disaggregation.prefill.extraArgs[0]", {"disaggregation": {"prefill": {"extraArgs": ["--role=decode"]}}},
     "set by the operator"),
])
def test_extra_args_must_be_full_serve_flags_the_operator_does_not_manage(field, extra, message):
    with pytest.raises(SpecError) as error:
        parse_spec({"model": {"uri": "m"}, **extra})
    assert error.value.field == field and message in error.value.message
