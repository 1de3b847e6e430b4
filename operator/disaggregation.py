"""Pure builders for prefill/decode disaggregation (spec.disaggregation):

- the decode pool is the engine Deployment NAME (resources.py), its pods run `--role decode` and
  carry the label iterserve.dev/role=decode; it is scaled by spec.replicas / spec.autoscaling as
  without disaggregation;
- the prefill pool is Deployment NAME-prefill (built here): the same pod template with `--role
  prefill` and iterserve.dev/role=prefill, spec.disaggregation.prefill.replicas kept within its
  bounds; its selector adds the role, so the engine Deployment never counts prefill pods as its own
  (the engine Deployment's selector is immutable and predates the pools; its ReplicaSets select by
  pod-template-hash, so the prefill pods are never adopted);
- both pools listen for KV transfers on spec.disaggregation.kvTransferPort, advertised at the pod IP;
- the router (Router mode, required) finds both pools among the InferenceService's pods and splits
  them by the role label; routing.py passes it the P/D threshold and prefill queue bound.

In: the owner and its parsed spec. Out: manifests (dicts), and the pure rule of the
DisaggregationIneffective condition. No API calls here.
"""

from __future__ import annotations

from typing import Any

from iterserve.operator.models import DISAGGREGATION_INEFFECTIVE, InferenceServiceSpec
from iterserve.operator.resources import (
    PREFILL,
    ROLE_LABEL,
    Owner,
    _metadata,
    pod_template,
    selector_labels,
)

__all__ = ["DISAGGREGATION_INEFFECTIVE", "build_disaggregation", "ineffective_condition", "prefill_name"]


PREFILL_COMPONENT = "engine-prefill"  # the prefill pods' app.kubernetes.io/component


def prefill_name(name: str) -> str:
    return f"{name}-prefill"


def prefill_selector(name: str) -> dict[str, str]:
    return {**selector_labels(name), ROLE_LABEL: PREFILL}


def build_prefill_deployment(owner: Owner, spec: InferenceServiceSpec) -> dict[str, Any]:
    template = pod_template(spec, owner.name, PREFILL)
    template["metadata"]["labels"]["app.kubernetes.io/component"] = PREFILL_COMPONENT
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(owner, prefill_name(owner.name)),
        "spec": {
            "replicas": spec.disaggregation.prefill.wanted_replicas,
            "selector": {"matchLabels": prefill_selector(owner.name)},
            "revisionHistoryLimit": 3,
            "progressDeadlineSeconds": spec.engine.startup_seconds + 120,
            "template": template,
        },
    }


def build_disaggregation(owner: Owner, spec: InferenceServiceSpec) -> list[dict[str, Any]]:
    """The objects disaggregation adds (the prefill pool), in write order; none when off, and none
    with multi-node groups (operator/groups.py builds the prefill pool's groups)."""
    one_node = spec.engine.parallelism.nodes == 1
    return [build_prefill_deployment(owner, spec)] if spec.disaggregation.enabled and one_node else []


def disaggregation_object_keys(name: str) -> list[tuple[str, str]]:
    """(kind, name) of what build_disaggregation may create: what turning it off leaves behind."""
    return [("Deployment", prefill_name(name))]


def ineffective_condition(spec: InferenceServiceSpec, average_prompt_tokens: float | None,
                          requests: int) -> tuple[str, str, str]:
    """(status, reason, message) of DisaggregationIneffective: True when disaggregation is on and the
    prompts seen (`requests` of them, averaging `average_prompt_tokens`) are shorter on average than
    the threshold, so most requests never use the prefill pool it pays for."""
    d = spec.disaggregation
    if not d.enabled:
        return "False", "Disabled", "spec.disaggregation.enabled is false."
    if average_prompt_tokens is None or requests == 0:
        return "Unknown", "NoTraffic", "No finished request seen yet: the average prompt is unknown."
    if average_prompt_tokens < d.threshold_tokens:
        return ("True", "ShortPrompts",
                f"The average prompt over {requests} requests is {average_prompt_tokens:.0f} tokens, under "
                f"spec.disaggregation.thresholdTokens ({d.threshold_tokens}): most requests are prefilled on the "
                "decode pool and the prefill pool mostly idles. Set spec.disaggregation.enabled to false, or "
                "lower the threshold if transfers pay for shorter prompts here (bench/cluster/disaggregation.py).")
    return ("False", "LongPrompts", f"The average prompt over {requests} requests is {average_prompt_tokens:.0f} "
                                    f"tokens, above the threshold ({d.threshold_tokens}).")
