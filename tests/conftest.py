"""Fixtures shared by the whole suite."""

from tests.cluster_fixture import k8s_cluster  # noqa: F401  (the local Kubernetes control plane)
from tests.hf_fixture import hf_smollm  # noqa: F401  (transformers on the embedded GGUF, the parity reference)
