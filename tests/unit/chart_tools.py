"""Runs helm and promtool on charts/iterserve for the chart tests."""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "iterserve"
VALUES_DIR = Path(__file__).resolve().parent / "chart_values"
HELM_ENV = "ITERSERVE_HELM"


def find_tool(name: str, *candidates: Path) -> str:
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which(name)
    if found is None:
        hint = {"helm": "run `make cluster-tools` (builds e2e/cluster/bin/helm) or set ITERSERVE_HELM",
                "promtool": "run `make system-packages` (Debian package prometheus)"}[name]
        pytest.fail(f"{name} not found: {hint}")
    return found


def helm_path() -> str:
    explicit = os.environ.get(HELM_ENV)
    return find_tool("helm", *([Path(explicit)] if explicit else []), ROOT / "e2e/cluster/bin/helm")


def promtool_path() -> str:
    return find_tool("promtool")


@dataclass
class HelmResult:
    returncode: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


def helm(*args: str, check: bool = True, cwd: Path | None = None) -> HelmResult:
    env = {**os.environ, "HELM_CACHE_HOME": "/tmp/iterserve-helm/cache",
           "HELM_CONFIG_HOME": "/tmp/iterserve-helm/config", "HELM_DATA_HOME": "/tmp/iterserve-helm/data"}
    proc = subprocess.run([helm_path(), *args], capture_output=True, text=True, timeout=120, env=env, cwd=cwd)
    result = HelmResult(proc.returncode, proc.stdout, proc.stderr)
    if check and proc.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed ({proc.returncode}):\n{result.output}")
    return result


def values_args(values_files: tuple[str, ...] = (), sets: tuple[str, ...] = ()) -> list[str]:
    args = []
    for name in values_files:
        args += ["-f", str(VALUES_DIR / name)]
    for item in sets:
        args += ["--set", item]
    return args


def render(values_files: tuple[str, ...] = (), sets: tuple[str, ...] = (), include_crds: bool = False) -> list[dict]:
    """`helm template` of the chart; the rendered objects, parsed."""
    args = ["template", "iterserve", str(CHART), "--namespace", "iterserve-system",
            *values_args(values_files, sets)]
    if include_crds:
        args.append("--include-crds")
    out = helm(*args).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc is not None]


def of_kind(objects: list[dict], kind: str) -> list[dict]:
    return [obj for obj in objects if obj["kind"] == kind]
