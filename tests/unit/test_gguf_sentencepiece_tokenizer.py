"""The `llama` (SentencePiece-style) GGUF tokenizer on a small vocabulary written here, against the
tokenizer transformers builds from the same metadata (Gemma's real one is in
tests/integration/test_gemma3_real_gguf.py), and the error for a type that is not supported."""

from __future__ import annotations

import gguf
import pytest

from iterserve.engine.model.loader import ModelLoadError
from iterserve.engine.model.tokenizer import Tokenizer

PIECES = ["▁", "e", "h", "l", "o", "w", "r", "d", "t", "▁h", "he", "ll", "llo", "▁he", "▁hello", "▁w", "or",
          "▁wor", "▁world", "▁the", "th", "▁t", "\n", "<tool>"]
TEXTS = ["hello world", " hello  world", "the\nworld", "héllo 🙂", "", "hello<tool>world", "<s>hello"]


def write_vocab(path, kind: str = "llama", add_bos: bool | None = None, architecture: str = "llama"):
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + PIECES
    types = [2, 3, 3] + [6] * 256 + [1] * (len(PIECES) - 1) + [4]
    # longer pieces score higher, so the recovered merges build them
    scores = [0.0] * 259 + [-100.0 + len(p) + i / 100 for i, p in enumerate(PIECES)]
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_tokenizer_model(kind)
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {"tokenizer_type": kind, "tokens": tokens, "scores": scores, "token_type": types}


@pytest.mark.parametrize("architecture", ["llama", "gemma3", "phi3"])
def test_sentencepiece_vocabulary_equals_transformers(tmp_path, architecture):
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer

    metadata = write_vocab(tmp_path / "v.gguf", architecture=architecture)
    ours = Tokenizer.from_gguf(tmp_path / "v.gguf")
    theirs, _ = convert_gguf_tokenizer(architecture, metadata)
    for text in TEXTS:
        ids = ours.encode(text, add_special_tokens=False)
        assert ids == theirs.encode(text, add_special_tokens=False).ids, (architecture, text)
        assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids, skip_special_tokens=False)
    assert ours.encode("hello")[0] == ours.bos_token_id == 1  # no add_bos_token key: on, as llama.cpp
    assert ours.eos_token_id == 2
    # byte fallback: "é" and the emoji are not pieces
    assert [ours.token(i) for i in ours.encode("é", add_special_tokens=False)][-2:] == ["<0xC3>", "<0xA9>"]


def test_add_bos_token_false_is_honoured(tmp_path):
    write_vocab(tmp_path / "v.gguf", add_bos=False)
    assert Tokenizer.from_gguf(tmp_path / "v.gguf").encode("hello") == [PIECES.index("▁hello") + 259]


def test_an_unsupported_tokenizer_type_names_the_supported_ones(tmp_path):
    write_vocab(tmp_path / "v.gguf", kind="bert")
    with pytest.raises(ModelLoadError, match=r"tokenizer.ggml.model 'bert' is not supported; supported: gpt2, llama"):
        Tokenizer.from_gguf(tmp_path / "v.gguf")
