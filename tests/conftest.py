"""Fixtures shared by the whole suite."""

import os

# Triton kernels run on its interpreter in tests (the GPU compile check runs in a subprocess
# without it). triton.jit and triton.language choose at import time, so this must hold before any
# test module imports an engine module that imports triton.
os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.cluster_fixture import k8s_cluster  # noqa: F401  (the local Kubernetes control plane)
from tests.hf_fixture import hf_smollm  # noqa: F401  (transformers on the embedded GGUF, the parity reference)
