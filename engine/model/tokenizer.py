"""The model's tokenizer and chat template, from a GGUF file's tokenizer.ggml.* metadata or from an
HF directory's tokenizer.json, built with the `tokenizers` library."""

from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as _RustTokenizer

from iterserve.engine.model import generation_config
from iterserve.engine.model.loader import ModelLoadError, open_gguf

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types

# Split rules for tokenizer.ggml.pre values (llama.cpp's names), as tokenizers pre-tokenizers.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _byte_level_pre_tokenizer(pre: str | None):
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("smollm", "starcoder", "refact", "falcon"):  # GPT-2 split, digits one by one
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    split = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT,
             "dbrx": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}.get(pre or "")
    if split is None:
        return byte_level  # "gpt2", "default" and unknown names: the GPT-2 split
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


# tokenizer.ggml.model values from_gguf builds: byte-level BPE and SentencePiece-style BPE.
SUPPORTED_GGUF_TOKENIZERS = ("gpt2", "llama")
# Architectures whose SentencePiece vocabulary spaces with a plain " " -> "▁" normalizer (no
# prefix "▁", no Metaspace) and whose GGUF spells multi-space tokens with real spaces.
_GEMMA_ARCHITECTURES = frozenset({"gemma", "gemma2", "gemma3"})


def _byte_level_backend(tokens: list[str], token_types: list[int], merges: list[str], pre: str | None):
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {}
    for index, token in enumerate(tokens):
        if not set(token) <= alphabet:
            token = "".join(spelling[b] for b in token.encode("utf-8"))
        vocab[token] = index
    backend = _RustTokenizer(models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges],
                                        ignore_merges=False))
    backend.pre_tokenizer = _byte_level_pre_tokenizer(pre)
    backend.decoder = decoders.ByteLevel()
    _add_gguf_special_tokens(backend, tokens, token_types, alphabet)
    return backend


def _sentencepiece_backend(tokens: list[str], token_types: list[int], scores: list[float] | None,
                           merges: list[str] | None, architecture: str | None):
    """The BPE tokenizer transformers builds from a `llama` (SentencePiece) GGUF vocabulary: merges
    from the file or recovered from the vocabulary (best score first; for Gemma, whose scores do not
    follow its merge order, the file's order), byte fallback to the <0xNN> tokens, "▁" for spaces."""
    gemma = architecture in _GEMMA_ARCHITECTURES
    if gemma:  # a token of two or more spaces is stored as spaces; the normalizer spells them "▁"
        tokens = ["▁" * len(t) if " " in t and not t.strip() else t for t in tokens]
    vocab = {}
    for index, token in enumerate(tokens):
        vocab[token] = index  # a repeated spelling keeps its last id, as transformers does
    if merges:
        pairs = [tuple(m.split(" ", 1)) for m in merges]
    elif gemma:
        pairs = _merges_from_vocab(vocab, {t: -i for i, t in enumerate(tokens)})
    else:
        pairs = _merges_from_vocab(vocab, dict(zip(tokens, scores or [0.0] * len(tokens), strict=True)))
    unk = "<unk>" if gemma else None
    backend = _RustTokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=True, byte_fallback=True,
                                        unk_token=unk))
    sequence = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if gemma:
        backend.normalizer = normalizers.Replace(" ", "▁")
        backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    elif architecture == "phi3":
        backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                                   normalizers.Replace(" ", "▁")])
        sequence.append(decoders.Strip(content=" ", left=1))
    else:
        backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first",
                                                         split=False)
        sequence.append(decoders.Strip(content=" ", left=1))
    backend.decoder = decoders.Sequence(sequence)
    _add_gguf_special_tokens(backend, tokens, token_types, None)
    return backend


def _merges_from_vocab(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """Every split of a token into two tokens of the vocabulary, as merges, best score first (ties:
    shorter left piece, then shorter right piece; within one token, by the pieces' ids)."""
    found = []
    for merge, score in scores.items():
        local = [(merge[:i], merge[i:]) for i in range(1, len(merge)) if merge[:i] in vocab and merge[i:] in vocab]
        local.sort(key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))
        found.extend((score, left, right) for left, right in local)
    found.sort(key=lambda m: (m[0], len(m[1]), len(m[2])), reverse=True)
    return [(left, right) for _, left, right in found]


def _add_gguf_special_tokens(backend: _RustTokenizer, tokens: list[str], token_types: list[int],
                             alphabet: set[str] | None) -> None:
    """Control tokens as special tokens (in a byte-level vocabulary only those spelled in its
    alphabet: another is a mislabel), user-defined ones as plain added tokens, so both stay whole."""
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, kind in zip(tokens, token_types, strict=True)
                                if kind == _CONTROL and (alphabet is None or set(t) <= alphabet)])
    backend.add_tokens([AddedToken(t, special=False, normalized=False)
                        for t, kind in zip(tokens, token_types, strict=True) if kind == _USER_DEFINED])


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table that byte-level vocabularies are spelled in."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars), strict=True))


class Tokenizer:
    def __init__(self, backend: _RustTokenizer, bos_token_id: int | None, eos_token_id: int | None,
                 chat_template: str | None, add_bos_token: bool = False):
        self._tok = backend
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.chat_template = chat_template
        self.add_bos_token = add_bos_token
        # the checkpoint's generation_config.json (extra eos ids, sampling defaults); GGUFs have none
        self.generation = generation_config.NONE
        if add_bos_token and bos_token_id is not None:
            bos = backend.id_to_token(bos_token_id)
            backend.post_processor = processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_token_id)])

    @property
    def backend(self) -> _RustTokenizer:
        return self._tok

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token(self, token_id: int | None) -> str | None:
        return None if token_id is None else self._tok.id_to_token(token_id)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch releases the GIL (encode holds it: 0.25 s for a 30k-token prompt, during
        # which the server's event loop and engine thread would stall).
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **extra) -> str:
        if not self.chat_template:
            raise ValueError("this model has no chat template; send a plain prompt instead")
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.token(self.bos_token_id) or "",
            eos_token=self.token(self.eos_token_id) or "",
            **extra,
        )

    @cached_property
    def _template(self):
        return compile_chat_template(self.chat_template)

    # -- construction ----------------------------------------------------------------------------
    @classmethod
    def from_path(cls, path: Path, gguf_reader=None) -> Tokenizer:
        path = Path(path)
        return cls.from_hf_dir(path) if path.is_dir() else cls.from_gguf(path, gguf_reader)

    @classmethod
    def from_gguf(cls, path: Path, reader=None) -> Tokenizer:
        reader = reader or open_gguf(path)

        def field(key: str, default=None):
            value = reader.fields.get(key)
            return default if value is None else value.contents()

        kind = field("tokenizer.ggml.model")
        tokens = field("tokenizer.ggml.tokens")
        token_types = field("tokenizer.ggml.token_type") or [1] * len(tokens)
        add_bos = field("tokenizer.ggml.add_bos_token")
        if kind == "gpt2":
            backend = _byte_level_backend(tokens, token_types, field("tokenizer.ggml.merges", []),
                                          field("tokenizer.ggml.pre"))
        elif kind == "llama":
            backend = _sentencepiece_backend(tokens, token_types, field("tokenizer.ggml.scores"),
                                             field("tokenizer.ggml.merges"), field("general.architecture"))
            if add_bos is None:  # llama.cpp adds BOS to a SentencePiece vocabulary that does not say
                add_bos = True
        else:
            raise ModelLoadError(f"{path}: tokenizer.ggml.model {kind!r} is not supported; supported: "
                                 f"{', '.join(SUPPORTED_GGUF_TOKENIZERS)} (or an HF directory with tokenizer.json)")
        return cls(
            backend,
            bos_token_id=field("tokenizer.ggml.bos_token_id"),
            eos_token_id=field("tokenizer.ggml.eos_token_id"),
            chat_template=field("tokenizer.chat_template"),
            add_bos_token=bool(add_bos),
        )

    @classmethod
    def from_hf_dir(cls, path: Path) -> Tokenizer:
        file = path / "tokenizer.json"
        if not file.is_file():
            raise ModelLoadError(f"{path} has no tokenizer.json")
        try:
            backend = _RustTokenizer.from_file(str(file))
            config = _read_json(path / "tokenizer_config.json")
        except (OSError, ValueError, Exception) as exc:
            raise ModelLoadError(f"cannot read the tokenizer in {path}: {exc}") from exc
        template = config.get("chat_template")
        if (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text()

        def token_id(name: str) -> int | None:
            token = config.get(name)
            if isinstance(token, dict):
                token = token.get("content")
            return backend.token_to_id(token) if token else None

        model_config = _read_json(path / "config.json")
        eos = token_id("eos_token")
        if eos is None:
            eos = model_config.get("eos_token_id")
            eos = eos[0] if isinstance(eos, list) else eos
        bos = token_id("bos_token")
        if bos is None:
            bos = model_config.get("bos_token_id")
        # A tokenizer.json whose post-processor already adds BOS needs no help from us.
        tokenizer = cls(backend, bos, eos, template, add_bos_token=False)
        tokenizer.generation = generation_config.read(path)
        return tokenizer


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def compile_chat_template(source: str):
    """A sandboxed Jinja template, set up the way HF transformers renders chat templates."""
    from datetime import datetime

    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)
