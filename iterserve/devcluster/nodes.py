"""KWOK fake GPU nodes: Node objects that the kwok controller keeps Ready and whose pods it
marks Running with an IP from its loopback pod CIDR, without any kubelet or container."""

from __future__ import annotations

KWOK_ANNOTATION = "kwok.x-k8s.io/node"
GPU_RESOURCE = "nvidia.com/gpu"


def gpu_node_manifest(
    name: str,
    gpus: int = 8,
    labels: dict[str, str] | None = None,
    taints: list[dict] | None = None,
    cpu: str = "64",
    memory: str = "512Gi",
    gpu_product: str = "NVIDIA-H100-80GB-HBM3",
) -> dict:
    capacity = {"cpu": cpu, "memory": memory, "pods": "110", GPU_RESOURCE: str(gpus)}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": {KWOK_ANNOTATION: "fake", "node.alpha.kubernetes.io/ttl": "0"},
            "labels": {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "type": "kwok",
                "nvidia.com/gpu.present": "true",
                "nvidia.com/gpu.product": gpu_product,
                "nvidia.com/gpu.count": str(gpus),
                **(labels or {}),
            },
        },
        "spec": {"taints": list(taints or [])},
        "status": {"capacity": capacity, "allocatable": dict(capacity)},
    }


def is_schedulable(node) -> bool:
    """Ready, and the node lifecycle controller has lifted its not-ready taint."""
    conditions = {c.type: c.status for c in (node.status.conditions or [])}
    taints = {t.key for t in (node.spec.taints or [])}
    return conditions.get("Ready") == "True" and "node.kubernetes.io/not-ready" not in taints
