"""The local pod runtime: makes pods on labelled KWOK nodes real `iterserve serve` processes on
their 127.10.x.y pod IPs, with readiness from their real probes, restarts, and graceful
deletion (preStop, SIGTERM, grace period, then the pod object goes).

    runner = PodRunner(api_client, log_dir=..., namespaces=["team-a"]).start()
    # or: python -m iterserve.devcluster.podrunner --kubeconfig K --log-dir D --namespace team-a

A pod opts in by asking for the node label in its nodeSelector and tolerating the node's taint
(`local_runtime_scheduling()`); KWOK's pod stages skip pods carrying that nodeSelector, apart
from the one that assigns the pod IP (iterserve/devcluster/stages/).

What a pod may make it run is narrow (launch.py): `iterserve serve` with allow-listed flags, no
PYTHON*/LD_*-style variables, Python isolated; probes dial only the pod's own IP.

Pods behind a headless Service (spec.hostname and spec.subdomain, as a StatefulSet's pods have)
resolve each other by the names cluster DNS would give them, through their own /etc/hosts in a
private mount namespace (hosts.py; process mode).

Container mode (`PodRunner(..., container_runtime="podman")`, `--container-runtime podman`):
each container is `podman run` of the pod's own image instead, with its securityContext,
resource limits and volumes (container.py; docs/image.md).
"""

from iterserve.devcluster.podrunner.runner import (
    LOCAL_RUNTIME_LABEL,
    PodRunner,
    wants_local_runtime,
)

LOCAL_RUNTIME_TAINT = {"key": LOCAL_RUNTIME_LABEL, "value": "true", "effect": "NoSchedule"}


def local_runtime_scheduling() -> dict:
    """nodeSelector and tolerations for a pod (or an InferenceService's spec.scheduling)."""
    return {"nodeSelector": {LOCAL_RUNTIME_LABEL: "true"},
            "tolerations": [{"key": LOCAL_RUNTIME_LABEL, "operator": "Equal", "value": "true",
                             "effect": "NoSchedule"}]}


def add_local_runtime_node(cluster, name: str, gpus: int = 8, **kwargs) -> dict:
    """A KWOK GPU node whose pods the local runtime runs: labelled, and tainted so that only pods
    that opt in land on it."""
    labels = {LOCAL_RUNTIME_LABEL: "true", **kwargs.pop("labels", {})}
    taints = [LOCAL_RUNTIME_TAINT, *kwargs.pop("taints", [])]
    return cluster.add_gpu_node(name, gpus=gpus, labels=labels, taints=taints, **kwargs)


__all__ = ["LOCAL_RUNTIME_LABEL", "PodRunner", "add_local_runtime_node", "local_runtime_scheduling",
           "wants_local_runtime"]
