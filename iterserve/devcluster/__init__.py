"""A development tool, not part of serving: a local Kubernetes control plane (etcd, API server,
controller manager, scheduler, KWOK fake GPU nodes) for tests and for trying the operator without a
cluster of one's own.

It ships in the wheel so `iterserve dev-cluster` works from an install; the engine, the router and
the operator never import it, and production deployments never run it.
"""

from iterserve.devcluster.cluster import ClusterStartError, LocalCluster, stop_in
from iterserve.devcluster.handle import ClusterHandle
from iterserve.devcluster.tools import MissingToolsError

__all__ = ["ClusterHandle", "ClusterStartError", "LocalCluster", "MissingToolsError", "stop_in"]
