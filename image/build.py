"""Build the iterserve image with podman (buildah inside), daemonless, and tag it.

In: the repository (image/Containerfile and the files its ignore file lets through).
Out: the image in podman's local storage under three tags:
  ghcr.io/iterserve/engine:<version>[-gpu]   what the Helm chart pulls (its default tag)
  localhost/iterserve:dev[-gpu]              a short local name
  localhost/iterserve:<content hash>[-gpu]   the Containerfile, lock and sources it was built
                                             from: the image test reuses a build by this tag
podman runs with iterserve/devcluster/podman.py's containers.conf (runc, no default ulimits).
The base rootfs comes from image/base.sh (built once, then reused). A host wheelhouse
(~/.cache/iterserve-image-wheels, or IMAGE_WHEELHOUSE) is mounted during the build, so a rebuild
does not download torch again (pip's own HTTP cache stores nothing behind a proxy that marks
responses uncacheable); the host's CA bundle is mounted too when it exists. Neither is written
into a layer.

    .venv/bin/python image/build.py [--target cpu|gpu] [--if-missing]
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import os
import re
import subprocess
import sys
import time
import tomllib
from pathlib import Path

from iterserve.devcluster.podman import podman_env

ROOT = Path(__file__).resolve().parent.parent
CONTAINERFILE = ROOT / "image" / "Containerfile"
IGNOREFILE = ROOT / "image" / "Containerfile.dockerignore"
BASE_TAG = "localhost/iterserve-base:bookworm"
REPOSITORY = "ghcr.io/iterserve/engine"
LOCAL = "localhost/iterserve"
# What the ignore file lets into the build context (kept in step with it by a test).
CONTEXT_FILES = ("image/requirements.lock", "pyproject.toml", "setup.py", "README.md")
CONTEXT_DIRS = ("iterserve", "engine", "operator")
HOST_CA = Path("/etc/ssl/certs/ca-certificates.crt")
WHEELHOUSE = Path(os.environ.get("IMAGE_WHEELHOUSE",
                               Path.home() / ".cache" / "iterserve-image-wheels"))


def version() -> str:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def content_hash() -> str:
    """A digest of everything the build reads: same hash, same image."""
    digest = hashlib.sha256()
    paths = [CONTAINERFILE, IGNOREFILE, ROOT / "image" / "base.sh"]
    paths += [ROOT / name for name in CONTEXT_FILES]
    for folder in CONTEXT_DIRS:
        paths += sorted(
            p for p in (ROOT / folder).rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
        )
    for path in paths:
        digest.update(str(path.relative_to(ROOT)).encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def tags(target: str) -> list[str]:
    suffix = "" if target == "cpu" else f"-{target}"
    return [
        f"{REPOSITORY}:{version()}{suffix}",
        f"{LOCAL}:dev{suffix}",
        f"{LOCAL}:{content_hash()}{suffix}",
    ]


def image_exists(tag: str) -> bool:
    return subprocess.run(["podman", "image", "exists", tag], env=podman_env()).returncode == 0


def build_command(target: str, tag_list: list[str], no_cache: bool = False) -> list[str]:
    WHEELHOUSE.mkdir(parents=True, exist_ok=True)
    cmd = [
        "podman", "build", "--network", "host", "--layers",
        "-f", str(CONTAINERFILE), "--ignorefile", str(IGNOREFILE),
        "--target", target, "--build-arg", f"BASE={BASE_TAG}",
        "--volume", f"{WHEELHOUSE}:/wheelhouse",
    ]
    if HOST_CA.is_file():
        cmd += ["--volume", f"{HOST_CA}:/etc/iterserve-build/ca.crt:ro"]
    if no_cache:
        cmd.append("--no-cache")
    for tag in tag_list:
        cmd += ["--tag", tag]
    return cmd + [str(ROOT)]


def drop_older_builds(keep: str) -> None:
    """Untag earlier content-hash builds of the same target and prune what no tag holds, so
    repeated builds of a changing tree do not fill the disk (each holds its own source layers)."""
    suffix = keep.rsplit(":", 1)[1][16:]
    listed = subprocess.run(["podman", "images", LOCAL, "--format", "{{.Repository}}:{{.Tag}}"],
                            capture_output=True, text=True, env=podman_env(), timeout=60).stdout
    for tag in listed.split():
        label = tag.rsplit(":", 1)[1]
        if tag != keep and re.fullmatch(rf"[0-9a-f]{{16}}{re.escape(suffix)}", label):
            subprocess.run(["podman", "untag", tag], env=podman_env(), timeout=60)
    subprocess.run(["podman", "image", "prune", "--force"], capture_output=True, env=podman_env(),
                   timeout=600)


def build(target: str = "cpu", if_missing: bool = False, no_cache: bool = False) -> str:
    """Build (or with if_missing, reuse) the image; return its content-hash tag."""
    wanted = tags(target)
    # Callers run at once (the suite's two lanes each start an image test): one builds, the
    # others wait on the lock and then find its image.
    WHEELHOUSE.mkdir(parents=True, exist_ok=True)
    with open(WHEELHOUSE.parent / "iterserve-image-build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if if_missing and image_exists(wanted[-1]):
            return wanted[-1]
        return _build(target, wanted, no_cache)


def _build(target: str, wanted: list[str], no_cache: bool) -> str:
    env = podman_env()
    subprocess.run(["bash", str(ROOT / "image" / "base.sh"), BASE_TAG], check=True, env=env)
    started = time.monotonic()
    subprocess.run(build_command(target, wanted, no_cache), check=True, env=env, cwd=ROOT)
    print(f"built {', '.join(wanted)} in {time.monotonic() - started:.0f} s", file=sys.stderr)
    drop_older_builds(wanted[-1])
    return wanted[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", choices=("cpu", "gpu"), default="cpu")
    parser.add_argument("--if-missing", action="store_true",
                        help="reuse an image already built from the same content")
    parser.add_argument("--no-cache", action="store_true",
                        help="rebuild every layer (the wheelhouse still saves the downloads)")
    parser.add_argument("--print-tag", action="store_true",
                        help="print the content-hash tag and exit without building")
    args = parser.parse_args()
    if args.print_tag:
        print(tags(args.target)[-1])
        return
    print(build(args.target, args.if_missing, args.no_cache))


if __name__ == "__main__":
    main()
