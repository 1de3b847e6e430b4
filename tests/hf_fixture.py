"""The `hf_smollm` fixture: transformers' model and tokenizer on the embedded GGUF (float32), the
reference of the parity tests, loaded once for the whole session (converting the GGUF takes about
half a minute on the CI's cores, and test_hf_parity and test_openai_real_model both compare with it).
generate() and forward() leave the model as they found it, so the modules cannot affect each other."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def hf_smollm():
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from iterserve.engine.model.registry import resolve_model_path

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        path = resolve_model_path(None)[0]
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    finally:
        torch.set_num_threads(previous)
    return model.eval(), tokenizer
