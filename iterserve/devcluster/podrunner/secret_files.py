"""Secret volumes, for the few flags that read a key from a file (FILE_FLAGS).

The local runtime mounts no volumes, and a flag naming a file could otherwise read any file of
this machine. So a file flag is accepted only when its path lies under one of the container's
volumeMounts whose volume is a `secret` volume: the runtime writes that Secret's key into the
pod's own folder (mode 0400) and passes the process that copy instead. A pod thereby reads only a
Secret of its own namespace, which it could already read through an env secretKeyRef.

In: the pod, its container, the args, a Secret lookup, the pod's folder. Out: the args, with each
file flag's value replaced by the local copy; LaunchError naming the field otherwise.
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import Callable
from pathlib import Path

FILE_FLAGS = ("--kv-auth-key-file", "--tenant-salt-key-file")
SECRET_VOLUME = "secret volume"  # the lookup's `kind`, shown in messages


def rewrite_file_flags(pod: dict, container: dict, args: list[str],
                       secrets: Callable[[str, str], dict[str, str] | None], workdir: Path) -> list[str]:
    out = list(args)
    for i, arg in enumerate(out):
        flag, inline = arg.split("=", 1) if "=" in arg else (arg, None)
        if flag not in FILE_FLAGS:
            continue
        if inline is not None:
            out[i] = f"{flag}={_materialize(pod, container, flag, inline, secrets, workdir)}"
        elif i + 1 < len(out):
            out[i + 1] = str(_materialize(pod, container, flag, out[i + 1], secrets, workdir))
    return out


def _materialize(pod: dict, container: dict, flag: str, path: str,
                 secrets: Callable[[str, str], dict[str, str] | None], workdir: Path) -> Path:
    from iterserve.devcluster.podrunner.launch import LaunchError

    where = f"pod {pod['metadata']['name']}: {flag} {path!r}"
    path = posixpath.normpath(path)
    volumes = {v.get("name"): v for v in (pod.get("spec") or {}).get("volumes") or []}
    for mount in container.get("volumeMounts") or []:
        base = posixpath.normpath(mount.get("mountPath", ""))
        relative = posixpath.relpath(path, base) if path.startswith(base + "/") else None
        volume = volumes.get(mount.get("name"))
        if relative is None or relative.startswith("..") or volume is None or "secret" not in volume:
            continue
        secret = volume["secret"]
        items = {item.get("path"): item.get("key") for item in secret.get("items") or []}
        key = items.get(relative) if items else relative
        data = secrets(secret.get("secretName", ""), SECRET_VOLUME)
        if data is None or key not in data:
            raise LaunchError(f"{where}: key {key!r} of Secret {secret.get('secretName')!r} not found "
                              "(the secret volume's source)", "ContainerCreating")
        target = workdir / "secrets" / mount["name"] / relative.replace("/", "_")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.unlink(missing_ok=True)
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
        with os.fdopen(fd, "wb") as out:
            out.write(data[key].encode("utf-8", "surrogateescape"))  # secret_data's lossless decode
        return target
    raise LaunchError(f"{where}: the local runtime reads such a file only from a secret volume mounted "
                      "in the container (volumeMounts + volumes[].secret)", "RunContainerError")
