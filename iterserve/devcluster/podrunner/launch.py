"""A pod's container -> the local command line and environment that stand in for it.

As the kubelet does: `envFrom` first, then `env` (later entries win); `$(VAR)` in env values,
command and args expands to a variable defined earlier, `$$` escapes a dollar, and an unknown
reference stays as written. The container's image is not pulled: the command must be the
project's own `iterserve` (an empty command means the engine image's entrypoint, `iterserve
serve`), run with this Python. The process listens on the pod's IP: `--host` is replaced by it.
"""

from __future__ import annotations

import base64
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ENGINE_ENTRYPOINT = ["iterserve", "serve"]
DEFAULT_THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
# What a container gets from its image rather than from the pod; nothing else of this process leaks in.
INHERITED_ENV = ("PATH", "LANG", "LC_ALL", "VIRTUAL_ENV")
_REFERENCE = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.\-]*)\)")


class LaunchError(ValueError):
    """The pod cannot run here; the message names the field and what to change.
    `reason` is the kubelet-style waiting reason shown in the container status."""

    def __init__(self, message: str, reason: str = "CreateContainerConfigError"):
        super().__init__(message)
        self.reason = reason


@dataclass
class Launch:
    argv: list[str]
    env: dict[str, str]
    host: str
    port: int | None
    container: dict = field(repr=False)


# name -> the object's data (already decoded), or None when it does not exist
Lookup = Callable[[str, str], dict[str, str] | None]


def expand(text: str, env: dict[str, str]) -> str:
    def one(match: re.Match) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1)
        return env[name] if name in env else match.group(0)

    return _REFERENCE.sub(one, text)


def secret_data(secret: dict) -> dict[str, str]:
    data = {k: base64.b64decode(v).decode() for k, v in (secret.get("data") or {}).items()}
    data.update(secret.get("stringData") or {})
    return data


def _field_ref(pod: dict, path: str) -> str:
    meta, spec, status = pod["metadata"], pod.get("spec") or {}, pod.get("status") or {}
    values = {
        "metadata.name": meta.get("name"), "metadata.namespace": meta.get("namespace"),
        "metadata.uid": meta.get("uid"), "spec.nodeName": spec.get("nodeName"),
        "spec.serviceAccountName": spec.get("serviceAccountName"),
        "status.podIP": status.get("podIP"), "status.hostIP": status.get("hostIP"),
    }
    match = re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path)
    if match:
        return (meta.get(match.group(1)) or {}).get(match.group(2), "")
    if path not in values:
        raise LaunchError(f"env fieldRef.fieldPath {path!r} is not supported by the local runtime; "
                          f"use one of {', '.join(sorted(values))}")
    return values[path] or ""


def _key_ref(kind: str, ref: dict, configmaps: Lookup, secrets: Lookup, var: str) -> str | None:
    lookup = configmaps if kind == "configMapKeyRef" else secrets
    data = lookup(ref["name"], kind)
    optional = ref.get("optional", False)
    if data is None:
        if optional:
            return None
        what = "ConfigMap" if kind == "configMapKeyRef" else "Secret"
        raise LaunchError(f"env {var}: {what} {ref['name']!r} ({kind}) not found")
    if ref["key"] not in data:
        if optional:
            return None
        raise LaunchError(f"env {var}: key {ref['key']!r} not in {ref['name']!r} ({kind}.key)")
    return data[ref["key"]]


def container_env(pod: dict, container: dict, configmaps: Lookup, secrets: Lookup) -> dict[str, str]:
    env: dict[str, str] = {}
    for source in container.get("envFrom") or []:
        prefix = source.get("prefix", "")
        kind, ref = (("configMapRef", source["configMapRef"]) if "configMapRef" in source
                     else ("secretRef", source["secretRef"]))
        data = (configmaps if kind == "configMapRef" else secrets)(ref["name"], kind)
        if data is None:
            if ref.get("optional", False):
                continue
            raise LaunchError(f"envFrom: {kind} {ref['name']!r} not found")
        env.update({prefix + k: v for k, v in data.items()})
    for var in container.get("env") or []:
        name, source = var["name"], var.get("valueFrom")
        if source is None:
            env[name] = expand(var.get("value", ""), env)
        elif "configMapKeyRef" in source or "secretKeyRef" in source:
            kind = "configMapKeyRef" if "configMapKeyRef" in source else "secretKeyRef"
            value = _key_ref(kind, source[kind], configmaps, secrets, name)
            if value is not None:
                env[name] = value
        elif "fieldRef" in source:
            env[name] = _field_ref(pod, source["fieldRef"]["fieldPath"])
        else:
            raise LaunchError(f"env {name}: valueFrom {', '.join(source)} is not supported by the local runtime")
    return env


def _with_host(args: list[str], host: str) -> list[str]:
    out, skip = [], False
    for arg in args:
        if skip:
            skip = False
            continue
        if arg == "--host":
            skip = True
            continue
        if arg.startswith("--host="):
            continue
        out.append(arg)
    return out + ["--host", host]


def _port(args: list[str], container: dict) -> int | None:
    for i, arg in enumerate(args):
        if arg == "--port" and i + 1 < len(args):
            return int(args[i + 1])
        if arg.startswith("--port="):
            return int(arg.split("=", 1)[1])
    ports = container.get("ports") or []
    return ports[0]["containerPort"] if ports else None


def build_launch(pod: dict, configmaps: Lookup, secrets: Lookup, workdir: Path,
                 threads: int = 1) -> Launch:
    """The one container of `pod` as a local process. Raises LaunchError naming the field."""
    containers = (pod.get("spec") or {}).get("containers") or []
    name = pod["metadata"]["name"]
    if len(containers) != 1:
        raise LaunchError(f"pod {name}: the local runtime runs pods with exactly one container "
                          f"(spec.containers has {len(containers)})")
    if (pod.get("spec") or {}).get("initContainers"):
        raise LaunchError(f"pod {name}: spec.initContainers are not supported by the local runtime")
    container = containers[0]
    host = (pod.get("status") or {}).get("podIP")
    if not host:
        raise LaunchError(f"pod {name} has no status.podIP yet", "ContainerCreating")
    env = container_env(pod, container, configmaps, secrets)
    command = [expand(part, env) for part in container.get("command") or ENGINE_ENTRYPOINT]
    args = [expand(part, env) for part in container.get("args") or []]
    if not command or Path(command[0]).name != "iterserve":
        raise LaunchError(f"pod {name}: container {container['name']} command {command!r}: the local runtime "
                          f"only runs the project's own `iterserve` (set command to [iterserve, serve])",
                          "RunContainerError")
    args = _with_host(command[1:] + args, host)
    process_env = {key: value for key in INHERITED_ENV if (value := os.environ.get(key)) is not None}
    process_env.update({"HOME": str(workdir), "TMPDIR": str(workdir), "PYTHONUNBUFFERED": "1"})
    process_env.update(env)
    for key in DEFAULT_THREAD_ENV:
        process_env.setdefault(key, str(threads))
    return Launch([sys.executable, "-m", "iterserve.cli", *args], process_env, host, _port(args, container),
                  container)

