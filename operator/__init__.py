"""The iterserve Kubernetes operator: the InferenceService CRD and its kopf reconciliation.

Installed as iterserve.operator; never import the folder as `operator` (the standard library's name).
"""

if __name__ == "operator":
    # Python was started in the repository root (python -m/-c puts it first on sys.path), so this
    # folder shadows the standard library's `operator`, which collections, pip and most programs
    # need. Stand in for it with the real module.
    import os as _os

    _path = _os.path.join(_os.path.dirname(_os.__file__), "operator.py")
    with open(_path, encoding="utf-8") as _file:
        exec(compile(_file.read(), _path, "exec"))  # noqa: S102
    del _os, _path, _file
