"""Prebuilt CPU kernels (engine/native.py): what `make install` puts in the environment loads in a
process that has no C compiler and a fresh HOME (an engine pod of the local runtime, or the image,
which ships no compiler), and a kernel that does not compile is an error naming it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from iterserve.engine import native

pytestmark = pytest.mark.skipif(not native.has_avx2(), reason="the kernels are for AVX2 CPUs")

LOADS = """
from iterserve.engine import native
from iterserve.engine.attention import cpu_paged
from iterserve.engine.model import cpu_fused, cpu_gguf, cpu_w8a8
assert native.find_compiler() is None, native.find_compiler()
print([m.load() is not None for m in (cpu_gguf, cpu_w8a8, cpu_fused, cpu_paged)])
"""


def bare_env(home, **extra) -> dict:
    """No compiler on PATH, a HOME with no compiled kernels in its cache."""
    return {"HOME": str(home), "PATH": "/nonexistent", "OMP_NUM_THREADS": "1", **extra}


def test_the_environments_prebuilt_kernels_load_without_a_compiler(tmp_path):
    there = native.prebuilt_dir()
    assert sorted(there.glob("gguf_linear_*.so")), f"no prebuilt kernels in {there}: run `make install`"
    done = subprocess.run([sys.executable, "-c", LOADS], env=bare_env(tmp_path), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[True, True, True, True]", done.stderr[-3000:]
    assert not (tmp_path / ".cache").exists()  # nothing compiled


def test_without_them_and_without_a_compiler_the_kernels_are_unavailable_and_the_log_says_how_to_fix_it(tmp_path):
    done = subprocess.run([sys.executable, "-c", LOADS], capture_output=True, text=True, timeout=300,
                          env=bare_env(tmp_path, **{native.PREBUILT_ENV: str(tmp_path / "empty")}))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[False, False, False, False]"
    assert "python -m iterserve.engine.native prebuild" in done.stderr


def test_prebuild_keeps_what_is_there_and_names_a_kernel_that_does_not_compile(tmp_path):
    again = subprocess.run([sys.executable, "-m", "iterserve.engine.native", "prebuild"], capture_output=True,
                           text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "compiled" not in again.stderr and "is there" in again.stderr  # current: nothing compiled again
    broken = subprocess.run([sys.executable, "-m", "iterserve.engine.native", "prebuild", str(tmp_path)],
                            capture_output=True, text=True, timeout=300, env={**os.environ, "CC": "/bin/false"})
    assert broken.returncode == 1
    assert "error: the " in broken.stderr and "kernel did not compile" in broken.stderr, broken.stderr[-3000:]
    assert not list(tmp_path.glob("*.so")) and not list(tmp_path.glob("*.c"))  # nothing half-written left
