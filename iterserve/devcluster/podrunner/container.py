"""Container mode of the local pod runtime: a pod's one container as `podman run` of the pod's image.

In: the pod (image, command, args, env, securityContext, resources, volumes), its ConfigMaps and
Secrets, and a ServiceAccount token when the pod mounts one. Out: a Launch whose argv is the
`podman run` command line (attached, `--rm`, output to the pod's log), and a PodmanContainer that
runs it, signals it with `podman kill`, stops it with `podman stop` and runs exec probes and an
exec preStop with `podman exec`.

The mapping, as the kubelet would do it:
- image: the local image only (`--pull never`; no registry is reachable); a missing image is the
  waiting reason ErrImageNeverPull, naming `make image`.
- command/args/env: as given (env with the ConfigMap/Secret references launch.py resolves), with
  the address flags of `iterserve serve`, `router` and `operator run` set to the pod IP: every
  container shares the host network (`--network host`), and the pod IP (127.0.0.0/8) is what
  keeps two pods apart. Other commands are refused, since they would bind the host's addresses.
- securityContext (pod, then container): runAsUser/runAsGroup -> --user, fsGroup and
  supplementalGroups -> --group-add, readOnlyRootFilesystem -> --read-only,
  allowPrivilegeEscalation false -> no-new-privileges, capabilities.drop -> --cap-drop. Refused:
  root, privileged, capabilities.add, a seccomp profile other than RuntimeDefault.
- resources.limits: memory -> --memory, cpu -> --cpus where the cgroup controllers are there;
  otherwise a log line says the limit is not enforced. GPUs are not mapped (logged).
- volumes: emptyDir -> a tmpfs (medium Memory, sized by sizeLimit) or a folder of the pod's work
  folder; secret, configMap and projected (ServiceAccount token, ConfigMap, Secret, downward API
  fields) -> their files written to the pod's folder, mounted read-only. The API server's
  kube-api-access-* volume is such a projected one (where no admission plugin adds it and
  automountServiceAccountToken is not false, the runtime mounts token, ca.crt and namespace at
  /var/run/secrets/kubernetes.io/serviceaccount itself); KUBERNETES_SERVICE_HOST/PORT name the
  API server, so `iterserve operator` and `router` use their in-cluster config.
  Other volume types and subPath mounts are refused.
Every container carries the label CONTAINER_LABEL=<runner id>, so a runner removes its own at stop
and the next runner removes those of a runner that died (containers_to_reap).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import signal
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from iterserve.devcluster import podman
from iterserve.devcluster.podrunner.launch import (
    DEFAULT_THREAD_ENV,
    ENGINE_ENTRYPOINT,
    Launch,
    LaunchError,
    Lookup,
    _field_ref,
    _port,
    _with_host,
    container_env,
    expand,
)
from iterserve.devcluster.podrunner.process import ContainerProcess

logger = logging.getLogger("iterserve.podrunner")

CONTAINER_LABEL = "iterserve.dev/podrunner"  # value: "<runner pid>-<random>"
POD_LABEL = "iterserve.dev/pod"  # value: "<namespace>/<name>"
SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
DEFAULT_MEMORY_TMPFS = "256m"  # a memory-backed emptyDir without sizeLimit or memory limit
MAX_VOLUME_FILE_BYTES = 1 << 20  # a Secret or ConfigMap key (the API server caps objects at ~1 MiB)
COMMANDS = ("serve", "router", "operator")


@dataclass(frozen=True)
class ServiceAccountToken:
    """What the kubelet projects into a pod: a token bound to it, the cluster CA, the namespace,
    and the API server the in-cluster config dials (from KUBERNETES_SERVICE_HOST/PORT)."""

    token: str
    ca_pem: bytes
    namespace: str
    server: str  # https://HOST:PORT


# (the pod, its ServiceAccount name) -> the token
TokenSource = Callable[[dict, str], ServiceAccountToken]


@dataclass(frozen=True)
class ContainerOptions:
    runner_id: str
    threads: int = 1
    api_server: str = ""  # https://HOST:PORT, for KUBERNETES_SERVICE_HOST/PORT


def container_name(pod: dict) -> str:
    meta = pod["metadata"]
    return f"iterserve-pod-{meta['namespace']}-{meta['name']}-{meta['uid'][:8]}"


@functools.cache
def cgroup_limits() -> tuple[bool, bool]:
    """(memory, cpu): whether podman can enforce those limits here (its cgroup controllers)."""
    done = subprocess.run(["podman", "info", "--format", "json"], capture_output=True, text=True,
                          env=podman.podman_env(), timeout=60)
    if done.returncode != 0:
        return False, False
    controllers = set(json.loads(done.stdout).get("host", {}).get("cgroupControllers") or [])
    return "memory" in controllers, "cpu" in controllers


def _image_user(image: str) -> str:
    done = subprocess.run(["podman", "image", "inspect", "--format", "{{.Config.User}}", image],
                          capture_output=True, text=True, env=podman.podman_env(), timeout=60)
    return done.stdout.strip()


def image_present(image: str) -> bool:
    done = subprocess.run(["podman", "image", "exists", image], env=podman.podman_env(), timeout=60)
    return done.returncode == 0


# --- command line ---------------------------------------------------------------------------------

def _with_flag(args: list[str], flag: str, value: str) -> list[str]:
    """args with every `flag V` / `flag=V` removed and `flag value` appended."""
    out, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg == flag:
            skip = True
        elif not arg.startswith(flag + "="):
            out.append(arg)
    return out + [flag, value]


def _liveness_on(args: list[str], host: str) -> list[str]:
    for i, arg in enumerate(args):
        url = arg.split("=", 1)[1] if arg.startswith("--liveness=") else (
            args[i + 1] if arg == "--liveness" and i + 1 < len(args) else None)
        if url == "none":
            return args
        if url is None:
            continue
        parts = urlsplit(url)
        moved = urlunsplit(parts._replace(netloc=f"{host}:{parts.port or 80}"))
        return _with_flag(args, "--liveness", moved)
    return args + ["--liveness", f"http://{host}:8080/healthz"]  # the operator's default port


def pod_argv(container: dict, env: dict[str, str], host: str, where: str) -> list[str]:
    """The container's command and args, with its listening addresses set to the pod IP."""
    command = [expand(part, env) for part in container.get("command") or ENGINE_ENTRYPOINT]
    args = [expand(part, env) for part in container.get("args") or []]
    argv = command + args
    sub = argv[1] if len(argv) > 1 else ""
    if not argv or Path(argv[0]).name != "iterserve" or sub not in COMMANDS:
        raise LaunchError(f"{where} command {command!r}: container mode runs `iterserve serve`, `router` or "
                          "`operator` (their listening addresses are set to the pod IP; another program would "
                          "bind the host's addresses); set command to [iterserve, serve]", "RunContainerError")
    if sub in ("serve", "router"):
        return argv[:1] + _with_host(argv[1:], host)
    return _with_flag(_liveness_on(argv, host), "--metrics-host", host)


def _user_args(pod: dict, container: dict, image: str, where: str) -> list[str]:
    pod_sc = (pod.get("spec") or {}).get("securityContext") or {}
    sc = container.get("securityContext") or {}
    merged = {**pod_sc, **{k: v for k, v in sc.items() if k in ("runAsUser", "runAsGroup", "runAsNonRoot")}}
    if sc.get("privileged"):
        raise LaunchError(f"{where}: securityContext.privileged is refused by the local runtime; remove it")
    if (sc.get("capabilities") or {}).get("add"):
        raise LaunchError(f"{where}: securityContext.capabilities.add is refused by the local runtime; remove it")
    for scope, context in (("pod", pod_sc), ("container", sc)):
        kind = (context.get("seccompProfile") or {}).get("type", "RuntimeDefault")
        if kind != "RuntimeDefault":
            raise LaunchError(f"{where}: {scope} securityContext.seccompProfile.type {kind!r}: the local runtime "
                              "runs RuntimeDefault only; set it to RuntimeDefault")
    user = merged.get("runAsUser")
    if user == 0:
        raise LaunchError(f"{where}: securityContext.runAsUser 0: the local runtime runs no container as root; "
                          "set a non-zero runAsUser")
    if user is None and merged.get("runAsNonRoot") and _image_user(image).split(":")[0] in ("", "0", "root"):
        raise LaunchError(f"{where}: runAsNonRoot is set and image {image} runs as root; set runAsUser")
    out = []
    if user is not None:
        group = merged.get("runAsGroup")
        out += ["--user", f"{int(user)}:{int(group)}" if group is not None else str(int(user))]
    groups = [pod_sc.get("fsGroup"), *(pod_sc.get("supplementalGroups") or [])]
    out += [arg for group in groups if group is not None for arg in ("--group-add", str(int(group)))]
    if sc.get("readOnlyRootFilesystem"):
        out += ["--read-only", "--read-only-tmpfs=false"]
    if sc.get("allowPrivilegeEscalation") is False:
        out += ["--security-opt", "no-new-privileges"]
    out += [arg for cap in (sc.get("capabilities") or {}).get("drop") or [] for arg in ("--cap-drop", str(cap))]
    return out


def _quantity(value, where: str) -> float:
    from kubernetes.utils import parse_quantity

    try:
        return float(parse_quantity(str(value)))
    except ValueError as error:
        raise LaunchError(f"{where}: {value!r} is not a Kubernetes quantity") from error


def resource_args(container: dict, where: str, log: Callable[[str], None]) -> list[str]:
    limits = (container.get("resources") or {}).get("limits") or {}
    memory_ok, cpu_ok = cgroup_limits()
    out = []
    if "memory" in limits:
        size = int(_quantity(limits["memory"], f"{where} resources.limits.memory"))
        if memory_ok:
            out += ["--memory", str(size)]
        else:
            log(f"resources.limits.memory {limits['memory']} not enforced: podman has no memory cgroup here")
    if "cpu" in limits:
        cpus = _quantity(limits["cpu"], f"{where} resources.limits.cpu")
        if cpu_ok:
            out += ["--cpus", f"{cpus:g}"]
        else:
            log(f"resources.limits.cpu {limits['cpu']} not enforced: podman has no cpu cgroup here")
    others = sorted(set(limits) - {"memory", "cpu", "ephemeral-storage"})
    if others:
        log(f"resources.limits {', '.join(others)} not mapped (the local runtime has no devices to give)")
    return out


# --- volumes --------------------------------------------------------------------------------------

def _write_files(folder: Path, files: dict[str, str], mode: int, where: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o755)
    for relative, text in files.items():
        data = text.encode("utf-8", "surrogateescape")  # secret_data's lossless decode
        if len(data) > MAX_VOLUME_FILE_BYTES or relative.startswith("/") or ".." in relative.split("/"):
            raise LaunchError(f"{where}: key path {relative!r} is too large or leaves the volume")
        target = folder / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        target.unlink(missing_ok=True)
        target.write_bytes(data)
        target.chmod(mode)


def _source_files(kind: str, source: dict, lookup: Lookup, where: str) -> dict[str, str]:
    name = source.get("secretName") or source.get("name", "")
    data = lookup(name, "secretRef" if kind == "secret" else "configMapRef")
    if data is None:
        if source.get("optional"):
            return {}
        raise LaunchError(f"{where}: {kind} {name!r} not found", "ContainerCreating")
    items = source.get("items")
    if not items:
        return dict(data)
    files = {}
    for item in items:
        if item["key"] not in data:
            raise LaunchError(f"{where}: key {item['key']!r} not in {kind} {name!r} (items[].key)")
        files[item["path"]] = data[item["key"]]
    return files


def _projected_files(pod: dict, sources: list[dict], configmaps: Lookup, secrets: Lookup,
                     tokens: TokenSource | None, where: str) -> dict[str, str]:
    """A projected volume's files: a ServiceAccount token, ConfigMap and Secret keys, downward API
    fields (the API server's kube-api-access-* volume is one of these)."""
    files: dict[str, str] = {}
    for source in sources:
        if "serviceAccountToken" in source:
            if tokens is None:
                raise LaunchError(f"{where}: this runtime gives no API credentials; set "
                                  "automountServiceAccountToken to false", "RunContainerError")
            account = (pod.get("spec") or {}).get("serviceAccountName") or "default"
            files[source["serviceAccountToken"]["path"]] = tokens(pod, account).token
        elif "configMap" in source:
            files.update(_source_files("configMap", source["configMap"], configmaps, where))
        elif "secret" in source:
            files.update(_source_files("secret", source["secret"], secrets, where))
        elif "downwardAPI" in source:
            for item in source["downwardAPI"].get("items") or []:
                if "fieldRef" not in item:
                    raise LaunchError(f"{where}: downwardAPI item {item.get('path')!r}: only fieldRef is supported "
                                      "by the local runtime")
                files[item["path"]] = _field_ref(pod, item["fieldRef"]["fieldPath"])
        else:
            raise LaunchError(f"{where}: projected source {', '.join(source)} is not supported by the local runtime")
    return files


def volume_args(pod: dict, container: dict, configmaps: Lookup, secrets: Lookup, limits_memory: str | None,
                workdir: Path, where: str, tokens: TokenSource | None = None) -> list[str]:
    volumes = {v.get("name"): v for v in (pod.get("spec") or {}).get("volumes") or []}
    out = []
    for mount in container.get("volumeMounts") or []:
        name, path = mount.get("name"), mount.get("mountPath", "")
        here = f"{where}: volumeMounts[{name}]"
        if mount.get("subPath") or mount.get("subPathExpr"):
            raise LaunchError(f"{here}: subPath is not supported by the local runtime; mount the whole volume")
        volume = volumes.get(name)
        if volume is None:
            raise LaunchError(f"{here}: no volume of that name in spec.volumes")
        read_only = ":ro" if mount.get("readOnly") else ""
        if "emptyDir" in volume:
            empty = volume["emptyDir"] or {}
            if empty.get("medium") == "Memory":
                size = empty.get("sizeLimit") or limits_memory
                size_arg = str(int(_quantity(size, f"{here} sizeLimit"))) if size else DEFAULT_MEMORY_TMPFS
                out += ["--tmpfs", f"{path}:rw,nosuid,nodev,size={size_arg},mode=1777"]
            else:
                folder = workdir / "volumes" / name
                folder.mkdir(parents=True, exist_ok=True)
                folder.chmod(0o1777)  # as the kubelet makes an emptyDir: any uid of the pod writes it
                out += ["--volume", f"{folder}:{path}{read_only or ':rw'}"]
        elif "secret" in volume or "configMap" in volume:
            kind = "secret" if "secret" in volume else "configMap"
            source = volume[kind]
            files = _source_files(kind, source, secrets if kind == "secret" else configmaps, here)
            folder = workdir / "volumes" / name
            _write_files(folder, files, int(source.get("defaultMode", 0o444)) | 0o444, here)
            out += ["--volume", f"{folder}:{path}:ro"]
        elif "projected" in volume:
            files = _projected_files(pod, volume["projected"].get("sources") or [], configmaps, secrets, tokens, here)
            folder = workdir / "volumes" / name
            _write_files(folder, files, 0o444, here)
            out += ["--volume", f"{folder}:{path}:ro"]
        else:
            kinds = sorted(set(volume) - {"name"})
            raise LaunchError(f"{here}: volume type {', '.join(kinds)} is not supported by the local runtime "
                              "(emptyDir, secret, configMap and projected are)")
    return out


def service_account_args(pod: dict, container: dict, tokens: TokenSource | None, workdir: Path,
                         where: str) -> list[str]:
    """The token mount for a cluster whose API server does not inject it (its ServiceAccount
    admission plugin adds a projected kube-api-access-* volume, which volume_args mounts)."""
    spec = pod.get("spec") or {}
    mounted = any(m.get("mountPath", "").rstrip("/") == SERVICE_ACCOUNT_DIR for m in container.get("volumeMounts") or [])
    if spec.get("automountServiceAccountToken") is False or mounted:
        return []
    if tokens is None:
        raise LaunchError(f"{where}: this runtime gives no API credentials; set automountServiceAccountToken "
                          "to false", "RunContainerError")
    granted = tokens(pod, spec.get("serviceAccountName") or "default")
    folder = workdir / "serviceaccount"
    _write_files(folder, {"token": granted.token, "ca.crt": granted.ca_pem.decode(),
                          "namespace": granted.namespace}, 0o444, where)
    return ["--volume", f"{folder}:{SERVICE_ACCOUNT_DIR}:ro"]


def env_args(variables: dict[str, str], workdir: Path) -> list[str]:
    """--env-file of the pod's folder (0600), so that no value (a Secret's) shows on a command line;
    a value with a line break, which that format cannot hold, goes as --env."""
    lines, multiline = [], []
    for key, value in variables.items():
        if "\n" in value or "\r" in value:
            multiline += ["--env", f"{key}={value}"]
        else:
            lines.append(f"{key}={value}\n")
    path = workdir / "container.env"
    path.unlink(missing_ok=True)
    with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as out:
        out.writelines(lines)
    return ["--env-file", str(path), *multiline]


def build_container_launch(pod: dict, configmaps: Lookup, secrets: Lookup, workdir: Path,
                           options: ContainerOptions, tokens: TokenSource | None = None,
                           log: Callable[[str], None] = logger.info) -> Launch:
    """The one container of `pod` as `podman run`. Raises LaunchError naming the field."""
    spec = pod.get("spec") or {}
    containers, name = spec.get("containers") or [], pod["metadata"]["name"]
    if len(containers) != 1:
        raise LaunchError(f"pod {name}: the local runtime runs pods with exactly one container "
                          f"(spec.containers has {len(containers)})")
    if spec.get("initContainers"):
        raise LaunchError(f"pod {name}: spec.initContainers are not supported by the local runtime")
    container = containers[0]
    host = (pod.get("status") or {}).get("podIP")
    if not host:
        raise LaunchError(f"pod {name} has no status.podIP yet", "ContainerCreating")
    where = f"pod {name}: container {container['name']}"
    image = container.get("image") or ""
    if not image_present(image):
        raise LaunchError(f"{where}: image {image!r} is not in podman's local storage and the local runtime "
                          "pulls nothing (`make image` builds ghcr.io/iterserve/engine:<version>; or "
                          "`podman load -i ARCHIVE`)", "ErrImageNeverPull")
    env = container_env(pod, container, configmaps, secrets)
    argv = pod_argv(container, env, host, where)
    workdir.mkdir(parents=True, exist_ok=True)
    limits = (container.get("resources") or {}).get("limits") or {}
    user = _user_args(pod, container, image, where)
    volumes = [*volume_args(pod, container, configmaps, secrets, limits.get("memory"), workdir, where, tokens),
               *service_account_args(pod, container, tokens, workdir, where)]
    run = ["podman", "run", "--rm", "--pull", "never", "--network", "host", "--log-driver", "none",
           "--name", container_name(pod), "--label", f"{CONTAINER_LABEL}={options.runner_id}",
           "--label", f"{POD_LABEL}={pod['metadata']['namespace']}/{name}",
           *user, *resource_args(container, where, log), *volumes]  # resources last: they log once per start
    server = urlsplit(options.api_server) if options.api_server else None
    container_vars = dict.fromkeys(DEFAULT_THREAD_ENV, str(options.threads))
    if server is not None:
        container_vars.update(KUBERNETES_SERVICE_HOST=server.hostname or "", KUBERNETES_SERVICE_PORT=str(server.port))
    container_vars.update(env)
    run += env_args(container_vars, workdir)
    run += ["--entrypoint", argv[0], image, *argv[1:]]
    return Launch(run, podman.podman_env(), host, _port(argv, container), container)


# --- running it -----------------------------------------------------------------------------------

class PodmanContainer(ContainerProcess):
    """The attached `podman run` as the container's process: its exit code is the container's.
    Signals and stop go to the container through podman, not to the client process."""

    runs_exec = True

    @property
    def name(self) -> str:
        return self.launch.argv[self.launch.argv.index("--name") + 1]

    def start(self) -> PodmanContainer:
        podman.remove(self.name)  # a container of an earlier start that podman has not removed yet
        super().start()
        return self

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            subprocess.run(["podman", "kill", "--signal", signal.Signals(sig).name, self.name],
                           capture_output=True, env=podman.podman_env(), timeout=30)

    def stop(self, grace: float) -> int | None:
        """podman stop: SIGTERM, `grace` seconds, SIGKILL; --rm then removes the container."""
        if self.proc is not None and self.proc.poll() is None:
            subprocess.run(["podman", "stop", "--time", str(max(0, int(grace))), self.name], capture_output=True,
                           env=podman.podman_env(), timeout=grace + 30)
        if not self.wait(15):
            super().stop(0)  # the client itself hangs: kill it; the runner's reaping removes the rest
        return self.exit_code

    def exec(self, command: list[str], timeout: float) -> bool:
        """An exec probe or preStop hook: True when the command exits 0 within timeout."""
        try:
            done = subprocess.run(["podman", "exec", self.name, *command], capture_output=True,
                                  env=podman.podman_env(), timeout=timeout)
        except subprocess.TimeoutExpired:
            return False
        return done.returncode == 0


def containers_to_reap(listing: list[dict], runner_id: str | None = None) -> list[str]:
    """Names of labelled containers (`podman ps -a --format json`) whose runner is `runner_id`, or,
    without one, whose runner process (the id's pid) no longer runs on this machine."""
    names = []
    for entry in listing:
        owner = (entry.get("Labels") or {}).get(CONTAINER_LABEL)
        if owner is None:
            continue
        if runner_id is not None:
            if owner == runner_id:
                names += entry.get("Names") or []
            continue
        pid = owner.split("-", 1)[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            names += entry.get("Names") or []
    return names


def reap(runner_id: str | None = None) -> list[str]:
    """Remove (force) the containers containers_to_reap picks; returns their names."""
    done = subprocess.run(["podman", "ps", "-a", "--filter", f"label={CONTAINER_LABEL}", "--format", "json"],
                          capture_output=True, text=True, env=podman.podman_env(), timeout=60)
    names = containers_to_reap(json.loads(done.stdout or "[]"), runner_id) if done.returncode == 0 else []
    for name in names:
        podman.remove(name)
    return names


def new_runner_id() -> str:
    return f"{os.getpid()}-{os.urandom(4).hex()}"
