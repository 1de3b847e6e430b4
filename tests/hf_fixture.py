"""transformers on the embedded GGUF (float32): the reference of the parity tests.

transformers converts the GGUF in Python (dequantizing every Q4_1 block, building the BPE from the
GGUF's vocabulary), about 55 s on the CI's cores. `reference_folder()` saves what it builds once, as
an ordinary transformers folder (config.json, model.safetensors, generation and tokenizer files)
under ~/.cache/iterserve/hf-reference, keyed by the GGUF's content (sha256) and the transformers
version (not its path or mtime: a fresh venv reinstalls the same file with a new mtime); later
loads take a few seconds, in this process or in another (lm-evaluation-harness's `pretrained=`).
The files are transformers' own conversion of the GGUF, so the reference is the same; delete the
folder to rebuild it.

The `hf_smollm` fixture loads model and tokenizer once for the whole session (test_hf_parity and
test_openai_real_model both compare with it). generate() and forward() leave the model as they
found it, so the modules cannot affect each other."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

CACHE_DIR = Path(os.environ.get("ITERSERVE_HF_REFERENCE_CACHE", Path.home() / ".cache" / "iterserve" / "hf-reference"))


def reference_folder(gguf: Path) -> Path:
    """The cached transformers folder for this GGUF, converted and saved first when missing.
    Written to a temporary folder, then renamed, so an interrupted save leaves nothing behind."""
    import torch
    import transformers
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    digest = hashlib.sha256()
    with open(gguf, "rb") as file:
        while chunk := file.read(1 << 24):
            digest.update(chunk)
    folder = CACHE_DIR / f"{gguf.stem}-{digest.hexdigest()[:16]}-transformers-{transformers.__version__}"
    if (folder / "DONE").exists():
        return folder
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    finally:
        torch.set_num_threads(previous)
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".staging-"))
    try:
        tokenizer.save_pretrained(staging)
        # save_pretrained refuses a model loaded from a GGUF ("not serializable"): write its config
        # without the GGUF note and its float32 weights (save_model stores the tied embedding once).
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        (staging / "config.json").write_text(json.dumps(config, indent=1))
        model.generation_config.save_pretrained(staging)
        save_model(model, str(staging / "model.safetensors"), metadata={"format": "pt"})
        (staging / "DONE").write_text(f"{gguf}\n")
        shutil.rmtree(folder, ignore_errors=True)
        staging.rename(folder)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def hf_tokenizer(gguf: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(reference_folder(gguf)))


def hf_model(gguf: Path):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(reference_folder(gguf)), dtype=torch.float32)


@pytest.fixture(scope="session")
def hf_smollm():
    import torch

    from iterserve.engine.model.registry import resolve_model_path

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        path = resolve_model_path(None)[0]
        tokenizer = hf_tokenizer(path)
        model = hf_model(path)
    finally:
        torch.set_num_threads(previous)
    return model.eval(), tokenizer
