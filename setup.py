"""Maps the top-level folders engine/ and operator/ to iterserve.engine and iterserve.operator.

The folder operator/ must never be importable as `operator` (the standard library's name),
so it is installed only under the iterserve namespace.
"""

from setuptools import find_packages, setup

ROOTS = {"iterserve": "iterserve", "iterserve.engine": "engine", "iterserve.operator": "operator"}


def packages_under(prefix: str, folder: str) -> list[str]:
    return [prefix] + [f"{prefix}.{name}" for name in find_packages(folder)]


setup(
    package_dir=ROOTS,
    packages=[pkg for prefix, folder in ROOTS.items() for pkg in packages_under(prefix, folder)],
    package_data={"iterserve.operator": ["*.yaml"], "iterserve": ["devcluster/stages/*.yaml", "replica_model/profiles/*.json"]},
)
