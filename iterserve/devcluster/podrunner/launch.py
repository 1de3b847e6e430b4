"""A pod's container -> the local command line and environment that stand in for it.

As the kubelet does: `envFrom` first, then `env` (later entries win); `$(VAR)` in env values,
command and args expands to a variable defined earlier, `$$` escapes a dollar, and an unknown
reference stays as written. The container's image is not pulled: the command must be the
project's own `iterserve serve` (an empty command means the engine image's entrypoint), run with
this Python. The process listens on the pod's IP: `--host` is replaced by it.

Whoever may create a pod must not get to run code as the runtime's user, so a pod gets only what
an engine needs: the `serve` flags in SERVE_FLAGS (no flag that names a file of this machine:
`--step-log`, `--admin-token-file`, a `--model` path; the runtime mounts no volumes, so a path
could only name one of this machine's files), no variable that changes what the interpreter or the
dynamic loader runs (REFUSED_ENV), and Python isolated (`-I`: no PYTHON* variables, no user site).
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
# `iterserve serve` flags a pod may pass: name -> takes a value. Every other flag is refused.
SERVE_FLAGS = {
    "--model": True, "--fake-model": False, "--fake-step-time-scale": True, "--served-model-name": True,
    "--device": True, "--dtype": True, "--seed": True,
    "--host": True, "--port": True, "--max-waiting-requests": True, "--drain-timeout": True,
    "--no-vllm-metric-names": False, "--access-log": False, "--log-level": True,
    "--max-num-seqs": True, "--max-num-batched-tokens": True, "--max-model-len": True,
    "--no-chunked-prefill": False, "--long-prefill-token-threshold": True, "--preemption-mode": True,
    "--scheduling": True, "--attention-backend": True, "--kv-cache-memory": True, "--num-kv-blocks": True,
    "--block-size": True, "--swap-space": True, "--enable-prefix-caching": False, "--no-enable-prefix-caching": False,
    "--max-request-body": True, "--quantization": True, "--max-logprobs": True,
}
# `serve` flags a pod may not pass: they name a file of this machine to write or read.
REFUSED_SERVE_FLAGS = ("--step-log", "--admin-token-file", "--help")
# Variables that change which code the interpreter, the dynamic loader, libc or the engine's
# libraries load, or where they read and write; a pod that sets one is refused.
REFUSED_ENV_PREFIXES = ("PYTHON", "LD_", "DYLD_", "GCONV_", "MALLOC_", "GLIBC_", "TORCH", "TRITON_", "CUDA_",
                        "HF_", "TRANSFORMERS_", "XDG_", "SSL_", "OPENSSL_")
REFUSED_ENV = {"PATH", "TMP", "TEMP", "BASH_ENV", "ENV", "IFS", "NLSPATH", "LOCPATH",
               "HOSTALIASES", "RESOLV_HOST_CONF", "RES_OPTIONS", "LOCALDOMAIN", "KUBECONFIG", "VIRTUAL_ENV",
               "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "PERL5LIB", "PERL5OPT", "NODE_OPTIONS", "RUBYOPT"}
# Set by the runtime to the pod's own folder, whatever the pod asks (the operator's pods set HOME=/tmp).
RUNTIME_ENV = ("HOME", "TMPDIR")
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


def refused_env(name: str) -> bool:
    return name.upper() in REFUSED_ENV or name.upper().startswith(REFUSED_ENV_PREFIXES)


def check_serve_args(args: list[str], where: str) -> None:
    """Raises LaunchError unless `args` are `serve` followed by SERVE_FLAGS only."""
    if not args or args[0] != "serve":
        raise LaunchError(f"{where}: the local runtime only runs `iterserve serve` (got `iterserve "
                          f"{' '.join(args[:3])}`); set command to [iterserve, serve]", "RunContainerError")
    i = 1
    while i < len(args):
        arg = args[i]
        flag, inline = arg.split("=", 1) if arg.startswith("--") and "=" in arg else (arg, None)
        if flag not in SERVE_FLAGS:
            raise LaunchError(f"{where}: argument {arg!r} is not one the local runtime passes to `iterserve "
                              f"serve` (allowed: {', '.join(sorted(SERVE_FLAGS))})", "RunContainerError")
        value = inline
        if SERVE_FLAGS[flag] and inline is None:
            if i + 1 >= len(args) or (args[i + 1].startswith("-") and not _number(args[i + 1])):
                raise LaunchError(f"{where}: {flag} needs a value", "RunContainerError")
            value, i = args[i + 1], i + 1
        elif not SERVE_FLAGS[flag] and inline is not None:
            raise LaunchError(f"{where}: {flag} takes no value", "RunContainerError")
        if flag == "--model" and ("/" in value or value.startswith(".") or not value):
            raise LaunchError(f"{where}: --model {value!r}: the local runtime mounts no volumes, so it only "
                              "serves model aliases (e.g. smollm2-135m), never a path", "RunContainerError")
        i += 1


def _number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


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
    where = f"pod {name}: container {container['name']}"
    env = container_env(pod, container, configmaps, secrets)
    refused = sorted(key for key in env if refused_env(key))
    if refused:
        raise LaunchError(f"{where}: env {', '.join(refused)}: the local runtime refuses variables that change "
                          "what the interpreter or the loader runs or where it reads and writes "
                          "(PYTHON*, LD_*, PATH, ...)")
    command = [expand(part, env) for part in container.get("command") or ENGINE_ENTRYPOINT]
    args = [expand(part, env) for part in container.get("args") or []]
    if not command or Path(command[0]).name != "iterserve":
        raise LaunchError(f"{where} command {command!r}: the local runtime "
                          f"only runs the project's own `iterserve` (set command to [iterserve, serve])",
                          "RunContainerError")
    check_serve_args(command[1:] + args, where)
    args = _with_host(command[1:] + args, host)
    process_env = {key: value for key in INHERITED_ENV if (value := os.environ.get(key)) is not None}
    process_env.update(env)
    process_env.update(dict.fromkeys(RUNTIME_ENV, str(workdir)))
    for key in DEFAULT_THREAD_ENV:
        process_env.setdefault(key, str(threads))
    # -I: isolated (no PYTHON* variables, no user site, no current folder on sys.path); -u: unbuffered logs
    return Launch([sys.executable, "-I", "-u", "-m", "iterserve.cli", *args], process_env, host,
                  _port(args, container), container)

