"""Fixtures shared by the whole suite."""

from tests.cluster_fixture import k8s_cluster  # noqa: F401  (the local Kubernetes control plane)
