"""What an engine pod of a spec runs, read back through the pod's own code: the operator's
`engine_args` parsed by `iterserve serve`'s flag parser gives the EngineConfig and server options
the replica model (iterserve.replica_model) runs with, so the simulator and the SLO policy model
exactly the options a pod would start with."""

from __future__ import annotations

import argparse
import shlex

from iterserve.engine.config import EngineConfig
from iterserve.engine.server import cli as server_cli
from iterserve.operator.resources import CONFIGMAP_ENV, configmap_data, engine_args
from iterserve.replica_model import profile as profiles
from iterserve.replica_model.replica import ServerOptions, fake_model_profile


def engine_config_for(spec, max_num_seqs: int) -> tuple[EngineConfig, ServerOptions]:
    """The EngineConfig (and server options) a pod of `spec` starts with at `max_num_seqs`."""
    data = configmap_data(spec, max_num_seqs)
    args = engine_args(spec)
    for var, key in CONFIGMAP_ENV.items():  # as the kubelet expands them from the ConfigMap
        args = [a.replace(f"$({var})", data.get(key, "")) for a in args]
    parser = argparse.ArgumentParser(prog="iterserve serve")
    server_cli.configure(parser)
    try:
        parsed = parser.parse_args(args)
    except SystemExit:
        raise ValueError(f"the spec's engine flags do not parse: {shlex.join(args)}") from None
    return server_cli.engine_config(parsed), ServerOptions(parsed.max_waiting_requests, parsed.drain_timeout)


def profile_for(spec, name: str | None) -> profiles.StepProfile:
    """The step profile a replica of `spec` runs: the fake model's own for a --fake-model spec,
    else the named shipped profile (the default one when `name` is None)."""
    config, _ = engine_config_for(spec, spec.engine.max_num_seqs)
    if name == "fake-model" or (name is None and config.model == "fake"):
        return fake_model_profile(config.fake_step_time_scale)
    return profiles.load_profile(name)
