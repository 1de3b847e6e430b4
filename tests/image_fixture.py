"""The iterserve image for tests that run it: built once per machine by image/build.py and reused
by its content-hash tag (--if-missing); the first build installs torch (minutes, docs/image.md).
Without podman or runc the caller skips, saying why."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from iterserve.devcluster import podman

REPO = Path(__file__).resolve().parents[1]
FIRST_BUILD_TIMEOUT_S = 3600


def built_image(what: str = "image tests") -> str:
    """The content-hash tag of the image (localhost/iterserve:<hash>), building it when missing."""
    reason = podman.unavailable_reason()
    if reason:
        pytest.skip(f"{what} did not run: {reason}")
    built = subprocess.run([sys.executable, str(REPO / "image" / "build.py"), "--if-missing"],
                           capture_output=True, text=True, timeout=FIRST_BUILD_TIMEOUT_S)
    assert built.returncode == 0, built.stderr[-4000:]
    return built.stdout.strip().splitlines()[-1]
