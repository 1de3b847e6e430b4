"""The real third-party clients the OpenAI-compatibility checks run (lm-evaluation-harness, guidellm),
installed from PyPI into their own virtual environment under ~/.cache, never imitated.

Their dependency trees are large (datasets, pandas, sanic...) and not the server's business, so they
live apart from .venv; a .pth file lets that environment import .venv's packages (torch,
transformers, the embedded model wheel), so pip installs only what the clients add and the HF
side of a comparison runs on the same torch and transformers as the tests.

    python tests/client_venv.py        # create or update it, print its python
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

PACKAGES = ("lm-eval[api]==0.4.13", "guidellm==0.8.1")
VENV = Path(os.environ.get("ITERSERVE_CLIENT_VENV", Path.home() / ".cache" / "iterserve-clients"))


def client_python(packages: tuple[str, ...] = PACKAGES) -> Path:
    """The clients' python, after installing whatever of `packages` is missing (minutes the first time)."""
    python = VENV / "bin" / "python"
    stamp = VENV / f".installed-{'-'.join(sorted(packages))}"
    if not python.exists():
        subprocess.run([_base_python(), "-m", "venv", "--without-pip", str(VENV)], check=True)
    # Written on every call: the environment outlives the checkout that made it (a CI clone is
    # deleted after its run), and must import the packages of the .venv running the tests now.
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    (Path(site) / "iterserve-venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    if stamp.exists():
        return python
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q",
                    "--disable-pip-version-check", *packages], check=True)
    stamp.write_text("\n".join(packages) + "\n")
    return python


def _base_python() -> str:
    """The interpreter .venv was made from (a venv cannot be made from inside another's python)."""
    return str(Path(getattr(sys, "_base_executable", sys.executable)))


if __name__ == "__main__":
    print(client_python())


def save_hf_tokenizer(python: Path, folder: Path) -> Path:
    """The embedded GGUF's tokenizer as an HF tokenizer folder (transformers reads the GGUF), for
    clients that count or make tokens with an HF tokenizer."""
    from iterserve.engine.model.registry import resolve_model_path

    path = resolve_model_path(None)[0]
    subprocess.run([str(python), "-c", "import sys; from transformers import AutoTokenizer; "
                    "AutoTokenizer.from_pretrained(sys.argv[1], gguf_file=sys.argv[2]).save_pretrained(sys.argv[3])",
                    str(path.parent), path.name, str(folder)], check=True,
                   env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    return folder
