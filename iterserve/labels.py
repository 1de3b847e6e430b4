"""The labels that tie an InferenceService to its engine pods, owned here because two layers read
them: the operator sets them on every pod it builds (operator/resources.py), and the router and
the autoscaler select pods by them (router/discovery.py, operator/autoscaling/hook.py). A module
with no imports, so neither side imports the other to agree on a name.
"""

from __future__ import annotations

# The engine's --role on the pod: prefill | decode | both (absent: both). The router's P/D path
# and the autoscaler's per-pool readings split pods by it.
ROLE_LABEL = "iterserve.dev/role"
PREFILL, DECODE = "prefill", "decode"


def selector_labels(name: str) -> dict[str, str]:
    """The labels every engine pod of InferenceService `name` carries, whatever its role."""
    return {"app.kubernetes.io/name": "iterserve-engine", "app.kubernetes.io/instance": name}


def selector_string(name: str) -> str:
    """`selector_labels` as a label selector (the scale subresource's status.selector, pod lists)."""
    return ",".join(f"{k}={v}" for k, v in selector_labels(name).items())
