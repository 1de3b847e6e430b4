"""A pod's container -> the local command line and environment that stand in for it.

As the kubelet does: `envFrom` first, then `env` (later entries win); `$(VAR)` in env values,
command and args expands to a variable defined earlier, `$$` escapes a dollar, and an unknown
reference stays as written. The container's image is not pulled: the command must be the
project's own `iterserve serve` or `iterserve router` (an empty command means the engine image's
entrypoint, `serve`), run with this Python. The process listens on the pod's IP: `--host` is
replaced by it.

Whoever may create a pod must not get to run code as the runtime's user, so a pod gets only what
an engine or a router needs: the `serve` flags in SERVE_FLAGS and the `router` flags in
ROUTER_FLAGS (no flag that names a file of this machine: `--step-log`, `--admin-token-file`,
`--kubeconfig`, a `--model` path; the runtime mounts no volumes, so a path could only name one of
this machine's files; and no router flag naming addresses to dial, such as `--endpoints`: a router
pod finds its engines through the API server, as its ServiceAccount allows), no variable that
changes what the interpreter or the dynamic loader runs (REFUSED_ENV), and Python isolated (`-I`:
no PYTHON* variables, no user site).

A router pod reaches the API server as its ServiceAccount, as the kubelet's projected token would
let it: the runtime asks the TokenRequest API for a token bound to the pod and passes the router a
kubeconfig holding it (`--kubeconfig`, written in the pod's own folder), so the router gets exactly
the RBAC its Role grants.
"""

from __future__ import annotations

import base64
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from iterserve.devcluster.podrunner.secret_files import FILE_FLAGS, rewrite_file_flags
from iterserve.engine.server.cli import serve_flags, serve_path_flags

ENGINE_ENTRYPOINT = ["iterserve", "serve"]
# `serve` flags a pod may not pass: they name a file of this machine to write or read.
REFUSED_SERVE_FLAGS = ("--step-log", "--admin-token-file", "--help")
# `iterserve serve` flags a pod may pass (serve's own list): name -> takes a value. A flag that names
# a file (metavar PATH) passes only when it is read from a secret volume (FILE_FLAGS), so a new file
# flag is refused until someone decides otherwise.
SERVE_FLAGS = {flag: takes_value for flag, takes_value in serve_flags().items()
               if flag not in REFUSED_SERVE_FLAGS and (flag not in serve_path_flags() or flag in FILE_FLAGS)}
# `iterserve router` flags a pod may pass: name -> takes a value. Every other flag is refused.
ROUTER_FLAGS = {
    "--infsvc": True, "-n": True, "--namespace": True, "--port-name": True, "--host": True, "--port": True,
    "--scrape-interval": True, "--stale-after": True, "--max-queue": True, "--queue-timeout": True,
    "--hold-timeout": True, "--hold-max": True,
    "--eject-backoff": True, "--max-eject-backoff": True, "--prefix-affinity": False,
    "--affinity-tolerance": True, "--prefix-tokens": True, "--block-size": True, "--seed": True,
    "--policy": True, "--log-level": True,
    "--pd-threshold-tokens": True, "--pd-max-prefill-queue": True, "--pd-prefill-timeout": True,
    "--kv-auth-key-file": True, "--tenant-salt-key-file": True,  # only from a secret volume (secret_files.py)
    "--drain-grace": True, "--max-connections": True, "--client-header-timeout": True,
    "--client-body-timeout": True, "--max-request-body": True, "--tenant-salt-header": True,
    "--event-loop": True,
}
# `router` flags a pod may not pass: a file of this machine (--kubeconfig: the runtime gives its
# own), or addresses to dial that no API server vouches for (--endpoints).
REFUSED_ROUTER_FLAGS = ("--endpoints", "--prefill", "--decode", "--kubeconfig", "-h", "--help")
# What each command a pod may run accepts.
COMMAND_FLAGS = {"serve": SERVE_FLAGS, "router": ROUTER_FLAGS}
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
    hosts_file: str | None = None  # seen as /etc/hosts by the process (hosts.py: the pod's DNS names)


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
    # surrogateescape: binary data (a random key) survives the round trip back to bytes
    data = {k: base64.b64decode(v).decode("utf-8", "surrogateescape") for k, v in (secret.get("data") or {}).items()}
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


def check_args(args: list[str], where: str, namespace: str | None = None) -> str:
    """Raises LaunchError unless `args` are `serve` or `router` followed by that command's allowed
    flags only (a router only for the pod's own `namespace`). Returns the command."""
    command = args[0] if args else ""
    if command not in COMMAND_FLAGS:
        raise LaunchError(f"{where}: the local runtime only runs `iterserve serve` and `iterserve router` (got "
                          f"`iterserve {' '.join(args[:3])}`); set command to [iterserve, serve] or "
                          "[iterserve, router]", "RunContainerError")
    allowed = COMMAND_FLAGS[command]
    i = 1
    while i < len(args):
        arg = args[i]
        flag, inline = arg.split("=", 1) if arg.startswith("--") and "=" in arg else (arg, None)
        if flag not in allowed:
            raise LaunchError(f"{where}: argument {arg!r} is not one the local runtime passes to `iterserve "
                              f"{command}` (allowed: {', '.join(sorted(allowed))})", "RunContainerError")
        value = inline
        if allowed[flag] and inline is None:
            if i + 1 >= len(args) or (args[i + 1].startswith("-") and not _number(args[i + 1])):
                raise LaunchError(f"{where}: {flag} needs a value", "RunContainerError")
            value, i = args[i + 1], i + 1
        elif not allowed[flag] and inline is not None:
            raise LaunchError(f"{where}: {flag} takes no value", "RunContainerError")
        if flag == "--model" and ("/" in value or value.startswith(".") or not value):
            raise LaunchError(f"{where}: --model {value!r}: the local runtime mounts no volumes, so it only "
                              "serves model aliases (e.g. smollm2-135m), never a path", "RunContainerError")
        if flag in ("-n", "--namespace") and namespace is not None and value != namespace:
            raise LaunchError(f"{where}: {flag} {value!r}: a router pod routes only to its own namespace "
                              f"({namespace!r}); drop the flag or set it to the pod's namespace",
                              "RunContainerError")
        i += 1
    if command == "router" and "--infsvc" not in [a.split("=", 1)[0] for a in args]:
        raise LaunchError(f"{where}: `iterserve router` needs --infsvc NAME here (a router pod finds its engines "
                          "through the API server)", "RunContainerError")
    return command


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


# A router pod's API credentials: (the pod, its ServiceAccount name, the folder) -> a kubeconfig path.
TokenKubeconfig = Callable[[dict, str, Path], Path]


def service_account(pod: dict) -> str:
    """The ServiceAccount whose token a router pod gets; refused when the pod opts out of one."""
    spec = pod.get("spec") or {}
    if spec.get("automountServiceAccountToken") is False:
        raise LaunchError(f"pod {pod['metadata']['name']}: a router needs API credentials, but "
                          "spec.automountServiceAccountToken is false; set it to true")
    return spec.get("serviceAccountName") or "default"


def build_launch(pod: dict, configmaps: Lookup, secrets: Lookup, workdir: Path,
                 threads: int = 1, token_kubeconfig: TokenKubeconfig | None = None) -> Launch:
    """The one container of `pod` as a local process. Raises LaunchError naming the field.
    `token_kubeconfig` writes a router pod's kubeconfig (no router pods without it)."""
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
    kind = check_args(command[1:] + args, where, pod["metadata"].get("namespace"))
    args = rewrite_file_flags(pod, container, _with_host(command[1:] + args, host), secrets, workdir)
    if kind == "router":
        if token_kubeconfig is None:
            raise LaunchError(f"{where}: this runtime gives no API credentials, so it runs no router pods",
                              "RunContainerError")
        args += ["--kubeconfig", str(token_kubeconfig(pod, service_account(pod), workdir))]
    process_env = {key: value for key in INHERITED_ENV if (value := os.environ.get(key)) is not None}
    process_env.update(env)
    process_env.update(dict.fromkeys(RUNTIME_ENV, str(workdir)))
    for key in DEFAULT_THREAD_ENV:
        process_env.setdefault(key, str(threads))
    # -I: isolated (no PYTHON* variables, no user site, no current folder on sys.path); -u: unbuffered logs
    return Launch([sys.executable, "-I", "-u", "-m", "iterserve.cli", *args], process_env, host,
                  _port(args, container), container)
