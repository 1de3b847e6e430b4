"""The folder operator/ must never break the standard library's `operator`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_python_started_in_the_repository_root_still_gets_the_stdlib_operator():
    code = "import operator, collections; assert operator.eq(2, 2) and operator.itemgetter(0)([5]) == 5"
    subprocess.run([sys.executable, "-S", "-c", code], cwd=ROOT, check=True)


def test_engine_and_operator_install_under_the_iterserve_namespace():
    import iterserve.engine
    import iterserve.operator

    assert Path(iterserve.engine.__file__).parent == ROOT / "engine"
    assert Path(iterserve.operator.__file__).parent == ROOT / "operator"
