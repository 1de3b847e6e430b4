"""Reading a spec from the API server into the models, with errors that name the field.

The CRD's schema catches most mistakes at `kubectl apply`; what still gets through (objects
stored before a rule existed, rules a schema cannot say) ends here as a SpecError, which the
operator reports as the InvalidSpec condition instead of crashing or creating half the objects.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from iterserve.engine.server.cli import serve_flags, served_model_name
from iterserve.operator import groups
from iterserve.operator.models import InferenceServiceSpec
from iterserve.operator.podsecurity import violations
from iterserve.operator.resources import ENGINE_PORT, MANAGED_FLAGS, RESERVED_ENV, kv_port_range


class SpecError(ValueError):
    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def _field_path(loc: tuple) -> str:
    path = "spec"
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else f".{part}"
    return path


def _from_validation_error(exc: ValidationError) -> SpecError:
    error = exc.errors()[0]
    message = error["msg"].removeprefix("Value error, ")
    if message.startswith("spec."):  # a cross-field rule: it names its fields itself
        field, _, rest = message.partition(" ")
        return SpecError(field.rstrip(":"), rest)
    return SpecError(_field_path(error["loc"]), message)


def parse_spec(raw: dict[str, Any] | None, allowed_pod_security: frozenset[str] = frozenset()) -> InferenceServiceSpec:
    """`allowed_pod_security`: names of operator/podsecurity.py rules the cluster admin allows."""
    try:
        spec = InferenceServiceSpec.model_validate(dict(raw or {}))
    except ValidationError as exc:
        raise _from_validation_error(exc) from None
    check_semantics(spec)
    found = violations(dict(raw or {}), allowed_pod_security)
    if found:
        raise SpecError(found[0].field, found[0].message.removeprefix(f"{found[0].field}: "))
    return spec


def check_semantics(spec: InferenceServiceSpec) -> None:
    _check_extra_args(spec.engine.extra_args, "spec.engine.extraArgs")
    _check_extra_args(spec.disaggregation.prefill.extra_args, "spec.disaggregation.prefill.extraArgs")
    _check_extra_args(spec.disaggregation.decode.extra_args, "spec.disaggregation.decode.extraArgs")
    for i, var in enumerate(spec.engine.env):
        if var.name in RESERVED_ENV:
            raise SpecError(f"spec.engine.env[{i}].name", f"{var.name} is reserved for the operator")
        if var.value is not None and var.value_from is not None:
            raise SpecError(f"spec.engine.env[{i}]", "set value or valueFrom, not both")
    _check_adapter_names(spec)
    # Both pools run spec.engine.parallelism (extraArgs cannot set it), so prefill and decode have one
    # tensor size, one pipeline size and one number of nodes per group, which KV transfer of a sharded
    # cache needs (rank r's shard, its heads of its stage's layers, goes to rank r): the spec cannot
    # express pools that differ.
    _check_kv_ports(spec)
    patch = spec.pod_template_patch or {}
    unknown = sorted(set(patch) - {"metadata", "spec"})
    if unknown:
        raise SpecError("spec.podTemplatePatch", f"only metadata and spec may be patched, not {', '.join(unknown)}")


def _check_kv_ports(spec: InferenceServiceSpec) -> None:
    """Rank r of a disaggregated group (of tensor x pipeline ranks) listens for KV transfers on
    kvTransferPort + r, on whichever node runs it."""
    if not spec.disaggregation.enabled:
        return
    first, last = kv_port_range(spec)
    ranks = last - first + 1
    field = "spec.disaggregation.kvTransferPort"
    if last > 65535:
        raise SpecError(field, f"{first} + {ranks} ranks (tensor x pipeline) - 1 passes 65535 (rank r listens on "
                               "kvTransferPort + r): pick a lower port")
    if first <= ENGINE_PORT <= last:
        raise SpecError(field, f"the KV ports {first}..{last} (one per rank of tensor x pipeline) hold the engine's "
                               f"HTTP port {ENGINE_PORT}: pick another")
    if spec.engine.parallelism.nodes > 1:
        # A prefill group's leader binds its rendezvous port beside its KV ports: StatefulSet group i's
        # own port (operator/groups.py), or RENDEZVOUS_PORT for every LeaderWorkerSet group (which
        # shape runs depends on the cluster, so both are kept clear).
        prefill = groups.group_pools("", spec)[-1]
        statefulsets = [prefill.rendezvous_port(i) for i in range(spec.disaggregation.prefill.max_replicas)]
        taken = [port for port in [groups.RENDEZVOUS_PORT, *statefulsets] if first <= port <= last]
        if taken:
            raise SpecError(field, f"the KV ports {first}..{last} (one per rank of tensor x pipeline) hold prefill "
                                   f"group rendezvous port {taken[0]} (StatefulSet groups: {statefulsets[0]}, "
                                   f"{statefulsets[0] + 2}, ... one per group; LeaderWorkerSet groups: "
                                   f"{groups.RENDEZVOUS_PORT}): pick another")


def _check_adapter_names(spec: InferenceServiceSpec) -> None:
    """An adapter may not take the base model's name: requests naming it get the base model."""
    args = spec.engine.extra_args
    given = [args[i + 1] for i, a in enumerate(args[:-1]) if a == "--served-model-name"]
    given += [a.split("=", 1)[1] for a in args if a.startswith("--served-model-name=")]
    base = given[-1] if given else served_model_name(spec.model.engine_path)
    for i, adapter in enumerate(spec.adapters):
        if adapter.name == base:
            raise SpecError(f"spec.adapters[{i}].name", f"{adapter.name!r} is the base model's served name (requests "
                                                        "naming it get the base model); choose another name")


def _check_extra_args(args: list[str], field: str) -> None:
    """Each flag must be one of serve's (checked here, not by a pod that crash-loops on it), written in
    full (argparse would expand an abbreviation past the managed-flag check), and not managed."""
    known = serve_flags()
    for i, arg in enumerate(args):
        if not arg.startswith("--"):
            continue  # a flag's value
        flag = arg.split("=", 1)[0]
        if flag in MANAGED_FLAGS:
            raise SpecError(f"{field}[{i}]",
                            f"{flag} is set by the operator from the spec; use the matching spec.engine field instead")
        if flag not in known:
            raise SpecError(f"{field}[{i}]", f"{flag} is not an `iterserve serve` flag (flags are written in full; "
                                             "see `iterserve serve --help`)")

