"""`iterserve generate` as a real process, on a tiny GGUF model."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.unit import tiny_llama as tiny


def run_generate(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "iterserve.cli", "generate", *args],
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_generate_prints_prompt_and_continuation(tmp_path):
    model = tiny.write_gguf(tmp_path / "tiny.gguf", tiny.hf_weights())
    result = run_generate("first", "second", "--model", str(model), "--max-tokens", "3", "--ignore-eos")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("first") and "\n\nsecond" in result.stdout
    assert len(result.stdout) > len("first\n\nsecond\n")  # the model's bytes were printed too


def test_missing_model_is_one_clear_line(tmp_path):
    missing = tmp_path / "nope.gguf"
    result = run_generate("hi", "--model", str(missing))
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        f"iterserve generate: model {str(missing)!r} not found: {missing} does not exist. Give a .gguf "
        "file, a HuggingFace directory (config.json + *.safetensors), or the alias 'smollm2-135m'"
    ]
