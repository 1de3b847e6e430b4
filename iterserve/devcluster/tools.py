"""Where the control-plane binaries built by `make cluster-tools` live."""

from __future__ import annotations

import os
from pathlib import Path

BIN_ENV = "ITERSERVE_CLUSTER_BIN"
DEFAULT_BIN = Path(__file__).resolve().parents[2] / "e2e" / "cluster" / "bin"
CONTROL_PLANE = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok")


class MissingToolsError(RuntimeError):
    pass


def bin_dir() -> Path:
    return Path(os.environ.get(BIN_ENV) or DEFAULT_BIN)


def tool(name: str) -> Path:
    path = bin_dir() / name
    if not os.access(path, os.X_OK):
        raise MissingToolsError(
            f"{path} not found: build the local cluster tools with `make cluster-tools` "
            f"(needs Go 1.24+, ~11 min the first time), or set {BIN_ENV} to a folder holding "
            f"{', '.join(CONTROL_PLANE)}, kubectl and helm"
        )
    return path


def check_control_plane() -> None:
    for name in CONTROL_PLANE:
        tool(name)
