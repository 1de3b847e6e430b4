"""Run the iterserve image with podman the way a pod runs it: podman in, container ids out.

The flags mirror the chart's and the operator's pod security context: a read-only root
filesystem with only an emptyDir-like tmpfs at /tmp, uid 10001, every capability dropped and
no new privileges. Containers join the host network (loopback addresses stand in for pod IPs),
so tests and benchmarks reach them on 127.0.0.0/8 only.

Every podman call here (and image/build.py's build) runs with CONTAINERS_CONF below: runc,
since crun refuses hybrid cgroup hierarchies, and no default ulimits, since podman's defaults
(open files, processes) can exceed a VM's hard limits and runc then fails to start the container;
the container inherits the caller's limits instead.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

POD_USER = "10001:10001"
TMP_SIZE = "512m"  # the emptyDir at /tmp holds caches only; the model is in the image
CONTAINERS_CONF = """\
[containers]
default_ulimits = []

[engine]
runtime = "runc"
"""


@functools.cache
def _conf_file() -> Path:
    """One file per user (in their cache folder), rewritten only when its text differs."""
    folder = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "iterserve"
    path = folder / "containers.conf"
    try:
        if path.is_file() and path.read_text() == CONTAINERS_CONF:
            return path
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:  # no writable home (a locked-down CI user): the temporary folder, per uid
        folder = Path(tempfile.gettempdir()) / f"iterserve-{os.getuid()}"
        folder.mkdir(mode=0o700, exist_ok=True)
        path = folder / "containers.conf"
        if path.is_file() and path.read_text() == CONTAINERS_CONF:
            return path
    fd, staged = tempfile.mkstemp(prefix=".containers-", suffix=".conf", dir=folder)
    with os.fdopen(fd, "w") as conf:
        conf.write(CONTAINERS_CONF)
    os.replace(staged, path)  # atomic: a concurrent podman call reads the old or the new text
    return path


def podman_env() -> dict[str, str]:
    """The environment for podman and buildah: this module's containers.conf."""
    return {**os.environ, "CONTAINERS_CONF": str(_conf_file())}


def _podman(*args: str, timeout: float, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout,
                          env=podman_env())
    if check and done.returncode != 0:
        raise RuntimeError(f"podman {args[0]} failed ({done.returncode}): {done.stderr.strip()[-800:]}")
    return done


def unavailable_reason() -> str | None:
    """None when podman with runc can run containers here; otherwise why not."""
    for tool in ("podman", "runc"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (sudo bash .ci/system-packages.sh installs it)"
    probe = _podman("info", "--format", "json", timeout=60, check=False)
    if probe.returncode != 0:
        return f"`podman info` failed: {probe.stderr.strip()[-300:]}"
    return None


def pod_security_args() -> list[str]:
    """What a pod with the chart's securityContext and an emptyDir at /tmp looks like."""
    return [
        "--read-only", "--read-only-tmpfs=false",
        "--tmpfs", f"/tmp:rw,nosuid,nodev,size={TMP_SIZE},mode=1777",
        "--user", POD_USER,
        "--cap-drop", "ALL",
        "--security-opt", "no-new-privileges",
    ]


def run_detached(image: str, name: str, command: Sequence[str],
                 env: dict[str, str] | None = None,
                 read_only_files: dict[Path, str] | None = None) -> str:
    """Start `command` in a pod-like container on the host network; return its id.
    read_only_files: host file -> path in the container, mounted read-only (like a Secret)."""
    env_args = [arg for key, value in (env or {}).items() for arg in ("--env", f"{key}={value}")]
    mounts = [arg for host, inside in (read_only_files or {}).items()
              for arg in ("--volume", f"{host}:{inside}:ro")]
    return _podman("run", "--detach", "--name", name, "--network", "host", *pod_security_args(),
                   *env_args, *mounts, image, *command, timeout=120).stdout.strip()


def terminate(name: str, grace_s: float) -> int | None:
    """SIGTERM, as the kubelet sends it; the exit code, or None if still running after grace_s."""
    _podman("kill", "--signal", "TERM", name, timeout=30)
    return wait_exit(name, grace_s)


def wait_exit(name: str, timeout_s: float) -> int | None:
    """The container's exit code, or None if it still runs after timeout_s."""
    try:
        waited = _podman("wait", name, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return None
    return int(waited.stdout.strip().splitlines()[-1])


def changed_paths(name: str) -> list[str]:
    """Paths the container added or changed in its image's filesystem (`podman diff`)."""
    out = _podman("diff", "--format", "json", name, timeout=60).stdout
    changes = json.loads(out or "{}")
    return sorted(path for kind in ("added", "changed", "deleted") for path in changes.get(kind) or [])


def logs(name: str) -> str:
    out = _podman("logs", name, timeout=30, check=False)
    return (out.stdout + out.stderr)[-4000:]


def remove(name: str) -> None:
    _podman("rm", "--force", "--time", "0", name, timeout=60, check=False)


def image_facts(tag: str) -> dict:
    """Size, id and digest of a local image, as podman records them."""
    out = _podman("image", "inspect", tag, timeout=60).stdout
    info = json.loads(out)[0]
    return {
        "tag": tag,
        "id": info["Id"],
        "digest": info.get("Digest"),
        "size_bytes": info["Size"],
        "layers": len(info.get("RootFS", {}).get("Layers") or []),
    }
