"""Import rules anyone can check: the engine depends on nothing of the project above it, and no two
packages import each other.

Every import statement counts, at module level or inside a function (a deferred import still ties the
two packages together). A package is iterserve.<name>: engine, operator, router, simulate, devcluster,
or one of the root modules (cli, labels, machine, ...).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Folder -> the package it installs as (setup.py's ROOTS).
FOLDERS = {"engine": "iterserve.engine", "operator": "iterserve.operator", "iterserve": "iterserve"}
# Pairs allowed to import each other for now, each with the reason; remove a pair once it is fixed.
ALLOWED_CYCLES: set[frozenset[str]] = set()


def _module_name(path: Path, root: Path = ROOT) -> str:
    folder, *rest = path.relative_to(root).with_suffix("").parts
    parts = [FOLDERS[folder], *rest]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, root: Path = ROOT) -> set[str]:
    """The iterserve modules a file imports, relative imports resolved."""
    module = _module_name(path, root)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
    return {name for name in found if name == "iterserve" or name.startswith("iterserve.")}


def _unit(module: str) -> str:
    """iterserve.router.proxy -> iterserve.router; iterserve.engine.server.cli -> iterserve.engine."""
    return ".".join(module.split(".")[:2])


def _graph() -> dict[str, dict[str, set[str]]]:
    """package -> imported package -> the files that import it."""
    edges: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            source = _unit(_module_name(path))
            for target in map(_unit, _imports(path)):
                if target != source:
                    edges[source][target].add(str(path.relative_to(ROOT)))
    return edges


def test_the_engine_imports_nothing_of_the_operator_the_router_or_the_cli_package():
    # The bare `iterserve` package is the namespace root every iterserve.engine import loads anyway.
    wrong = {target: files for target, files in _graph()["iterserve.engine"].items() if target != "iterserve"}
    assert not wrong, f"the engine imports packages above it: {wrong}"


def test_no_two_packages_import_each_other():
    edges = _graph()
    cycles = {frozenset((a, b)) for a in edges for b in edges[a] if a in edges.get(b, {})}
    unexpected = {tuple(sorted(pair)): (edges[min(pair)][max(pair)], edges[max(pair)][min(pair)])
                  for pair in cycles - ALLOWED_CYCLES}
    assert not unexpected, f"packages that import each other (files each way): {unexpected}"
    fixed = ALLOWED_CYCLES - cycles
    assert not fixed, f"these pairs no longer import each other: remove them from ALLOWED_CYCLES: {fixed}"


def test_the_walk_sees_function_level_and_relative_imports(tmp_path):
    """The checker itself: a deferred import inside a function and relative imports all count."""
    package = tmp_path / "engine" / "sub"
    package.mkdir(parents=True)
    mod = package / "mod.py"
    mod.write_text("def f():\n    from iterserve.router import proxy\n\nfrom ..config import X\nfrom . import other\n")
    assert _imports(mod, tmp_path) == {"iterserve.router", "iterserve.engine.config", "iterserve.engine.sub"}
    assert _unit("iterserve.engine.server.cli") == "iterserve.engine"
