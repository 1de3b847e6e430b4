"""Run the iterserve image with podman the way a pod runs it: podman in, container ids out.

The flags mirror the chart's and the operator's pod security context: a read-only root
filesystem with only an emptyDir-like tmpfs at /tmp, uid 10001, every capability dropped and
no new privileges. Containers join the host network (loopback addresses stand in for pod IPs),
so tests and benchmarks reach them on 127.0.0.0/8 only.

runc is asked for by name (crun refuses hybrid cgroup hierarchies), and the open-files limit is
the caller's own (podman's default can exceed a VM's hard limit and the start fails).
"""

from __future__ import annotations

import json
import resource
import shutil
import subprocess
from collections.abc import Sequence

POD_USER = "10001:10001"
TMP_SIZE = "512m"  # the emptyDir at /tmp holds caches only; the model is in the image


def unavailable_reason() -> str | None:
    """None when podman with runc can run containers here; otherwise why not."""
    for tool in ("podman", "runc"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (sudo bash .ci/system-packages.sh installs it)"
    probe = subprocess.run(["podman", "info", "--format", "json"], capture_output=True,
                           text=True, timeout=60)
    if probe.returncode != 0:
        return f"`podman info` failed: {probe.stderr.strip()[-300:]}"
    return None


def runtime_args() -> list[str]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return ["--runtime", "runc", "--ulimit", f"nofile={soft}:{hard}"]


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
                 env: dict[str, str] | None = None) -> str:
    """Start `command` in a pod-like container on the host network; return its id."""
    env_args = [arg for key, value in (env or {}).items() for arg in ("--env", f"{key}={value}")]
    cmd = ["podman", "run", "--detach", "--name", name, "--network", "host",
           *runtime_args(), *pod_security_args(), *env_args, image, *command]
    return subprocess.run(cmd, check=True, capture_output=True, text=True,
                          timeout=120).stdout.strip()


def terminate(name: str, grace_s: float) -> int | None:
    """SIGTERM, as the kubelet sends it; the exit code, or None if still running after grace_s."""
    subprocess.run(["podman", "kill", "--signal", "TERM", name], check=True,
                   capture_output=True, timeout=30)
    try:
        waited = subprocess.run(["podman", "wait", name], capture_output=True, text=True,
                                timeout=grace_s)
    except subprocess.TimeoutExpired:
        return None
    return int(waited.stdout.strip().splitlines()[-1])


def changed_paths(name: str) -> list[str]:
    """Paths the container added or changed in its image's filesystem (`podman diff`)."""
    out = subprocess.run(["podman", "diff", "--format", "json", name], check=True,
                         capture_output=True, text=True, timeout=60).stdout
    changes = json.loads(out or "{}")
    return sorted(path for kind in ("added", "changed", "deleted") for path in changes.get(kind) or [])


def logs(name: str) -> str:
    out = subprocess.run(["podman", "logs", name], capture_output=True, text=True, timeout=30)
    return (out.stdout + out.stderr)[-4000:]


def remove(name: str) -> None:
    subprocess.run(["podman", "rm", "--force", "--time", "0", name], capture_output=True,
                   timeout=60)


def image_facts(tag: str) -> dict:
    """Size, id and digest of a local image, as podman records them."""
    out = subprocess.run(["podman", "image", "inspect", tag], check=True, capture_output=True,
                         text=True, timeout=60).stdout
    info = json.loads(out)[0]
    return {
        "tag": tag,
        "id": info["Id"],
        "digest": info.get("Digest"),
        "size_bytes": info["Size"],
        "layers": len(info.get("RootFS", {}).get("Layers") or []),
    }
