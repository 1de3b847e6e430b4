"""Structured outputs: grammar-constrained decoding with xgrammar (what vLLM and SGLang use).

In: a request's `StructuredOutput` (a JSON schema, any JSON object, a regex, a choice among strings,
or an EBNF grammar), carried on its SamplingParams. Out: at each sampling step, a token bitmask
that the batched sampler applies to the logits rows of the constrained requests (disallowed tokens
get -inf), and, once a token is chosen, the request's matcher advanced by it. When the grammar is
complete only the end-of-sequence token is allowed, so a constrained request finishes with "stop".

`Grammars` owns xgrammar's view of the vocabulary and compiles each distinct spec once (an LRU cache
shared by every request), after checking it against limits.py. The server compiles on `Grammars.pool`
(compile_pool.py: its own bounded threads, a deadline) before submitting, so an invalid or too costly
schema is a 400, and pins the compiled grammar on the request's spec: the engine thread never
compiles, whatever the cache has evicted since. `GrammarMatchers` keeps one matcher per running
request and is what the sampler calls.

JSON is generated compact (no free whitespace between tokens): a small model offered free
whitespace can spend its whole max_tokens on newlines.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Literal

import torch

from iterserve.engine.sampling_params import InvalidRequestError
from iterserve.engine.structured.compile_pool import CompilePool
from iterserve.engine.structured.limits import check_limits

logger = logging.getLogger(__name__)

Kind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]
KINDS: tuple[str, ...] = ("json_schema", "json_object", "regex", "choice", "grammar")
MAX_SPEC_CHARS = 256 * 1024
CACHE_SIZE = 128


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """What a request's output must match. spec: the JSON schema (as JSON text), the regex, the EBNF
    grammar, or the choices as a JSON list; empty for json_object. `field` is the request field it
    came from, named in errors. `compiled`: the grammar pinned by the server's compile (see `pinned`);
    not part of the spec's identity, so the cache key stays the spec."""

    kind: Kind
    spec: str = ""
    field: str = "response_format"
    compiled: object = dataclasses.field(default=None, compare=False, hash=False, repr=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidRequestError(f"{self.field}: unknown structured output kind {self.kind!r}; "
                                      f"one of {', '.join(KINDS)}", self.field)
        if not isinstance(self.spec, str) or len(self.spec) > MAX_SPEC_CHARS:
            raise InvalidRequestError(f"{self.field}: must be a string of at most {MAX_SPEC_CHARS} characters",
                                      self.field)

    @classmethod
    def json_schema(cls, schema: dict | str, field: str = "response_format") -> StructuredOutput:
        text = schema if isinstance(schema, str) else json.dumps(schema, separators=(",", ":"))  # key order matters
        return cls("json_schema", text, field)

    @classmethod
    def choice(cls, choices: list[str], field: str = "guided_choice") -> StructuredOutput:
        return cls("choice", json.dumps(list(choices)), field)

    def pinned(self, compiled) -> StructuredOutput:
        """This spec carrying its compiled grammar, which the engine thread then uses as is."""
        return dataclasses.replace(self, compiled=compiled)


class Grammars:
    """xgrammar's compiler over one tokenizer's vocabulary, with compiled grammars cached by spec."""

    def __init__(self, tokenizer, vocab_size: int, cache_size: int = CACHE_SIZE):
        self._tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_token_id  # the grammars' stop token
        self.vocab_size = vocab_size
        self._cache_size = cache_size
        self._cache: OrderedDict[StructuredOutput, object] = OrderedDict()
        self._lock = threading.Lock()
        self._compiler = None
        self.hits = 0
        self.misses = 0
        self._pool = None

    @property
    def pool(self):
        """The server's bounded compile pool over this vocabulary (threads start on first use)."""
        with self._lock:
            if self._pool is None:
                self._pool = CompilePool(self)
            return self._pool

    @property
    def compiler(self):
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                started = time.perf_counter()
                info = xgr.TokenizerInfo(self._encoded_vocab(), xgr.VocabType.BYTE_LEVEL, vocab_size=self.vocab_size,
                                         stop_token_ids=[self._tokenizer.eos_token_id])
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
                logger.info("structured outputs: xgrammar's vocabulary index built in %.1f s (once per server)",
                            time.perf_counter() - started)
            return self._compiler

    def _encoded_vocab(self) -> list[str]:
        """Every token's byte-level spelling; special tokens as "" so a grammar never emits them as
        text (EOS stays allowed at the end as the stop token)."""
        backend = self._tokenizer.backend
        special = {i for i, token in backend.get_added_tokens_decoder().items() if token.special}
        size = backend.get_vocab_size(with_added_tokens=True)
        return ["" if i in special else (backend.id_to_token(i) or "") for i in range(size)]

    def cached(self, structured: StructuredOutput):
        """The compiled grammar if the cache holds it (counted as a hit), else None; never compiles."""
        with self._lock:
            compiled = self._cache.get(structured)
            if compiled is not None:
                self._cache.move_to_end(structured)
                self.hits += 1
            return compiled

    def compile(self, structured: StructuredOutput):
        """The compiled grammar (cached); InvalidRequestError naming the field if the spec is invalid
        or over a limit (limits.py)."""
        compiled = self.cached(structured)
        if compiled is not None:
            return compiled
        check_limits(structured.kind, structured.spec, structured.field)
        compiled = self._compile(structured)
        self._check_can_start(compiled, structured)
        with self._lock:
            self.misses += 1
            self._cache[structured] = compiled
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _check_can_start(self, compiled, structured: StructuredOutput) -> None:
        """A grammar no token of this vocabulary can begin (a regex of one control character the
        vocabulary does not spell) would leave every logit at -inf at the first step: refused
        here as the request's error, not failed in the sampler."""
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
        xgr.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask, 0)
        if not bool(bitmask.any()):
            raise InvalidRequestError(f"{structured.field}: no token of the model's vocabulary can begin a "
                                      f"match, so nothing could be generated ({structured.kind})", structured.field)

    def _compile(self, structured: StructuredOutput):
        compiler, kind, spec = self.compiler, structured.kind, structured.spec
        try:
            if kind == "json_object":
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if kind == "json_schema":
                return compiler.compile_json_schema(spec, any_whitespace=False, strict_mode=True)
            if kind == "regex":
                return compiler.compile_regex(spec)
            if kind == "choice":
                choices = json.loads(spec)
                rule = " | ".join(json.dumps(c) for c in choices)
                return compiler.compile_grammar(f"root ::= {rule}")
            return compiler.compile_grammar(spec)
        except Exception as error:  # noqa: BLE001 - xgrammar raises RuntimeError/ValueError on bad specs
            message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise InvalidRequestError(f"{structured.field}: cannot be compiled into a grammar ({kind}): {message}",
                                      structured.field) from None


class NoTokenLeft(Exception):
    """A request's own settings leave no token of the vocabulary to draw at this step: its grammar
    allows none (the text so far matches a prefix no token can extend: a regex of characters the
    tokenizer spells only in byte sequences the grammar cuts), or the grammar, min_tokens and
    logit_bias together exclude every one. The request's input is at fault: field names it."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


class GrammarMatchers:
    """One xgrammar matcher per constrained request: fills the bitmask rows, advances on each token."""

    def __init__(self, grammars: Grammars):
        self.grammars = grammars
        self._matchers: dict[str, object] = {}

    def _matcher(self, request_id: str, structured: StructuredOutput):
        matcher = self._matchers.get(request_id)
        if matcher is None:
            import xgrammar as xgr

            # The server pins the grammar on every request; only a direct LLMEngine caller compiles here.
            compiled = structured.compiled if structured.compiled is not None else self.grammars.compile(structured)
            matcher = xgr.GrammarMatcher(compiled)
            self._matchers[request_id] = matcher
        return matcher

    def mask(self, logits: torch.Tensor, rows: list[int], seqs) -> None:
        """Disallowed tokens of each constrained row set to -inf, in place (rows index logits). Raises
        NoTokenLeft where a row's grammar allows no token (every logit would be -inf and no
        distribution could be drawn from)."""
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(len(rows), self.grammars.vocab_size)
        for j, row in enumerate(rows):
            seq = seqs[row]
            matcher = self._matcher(seq.request_id, seq.params.structured)
            if matcher.is_terminated():
                # the grammar is complete (it accepted the stop token) but the request goes on (ignore_eos,
                # min_tokens): only the stop token keeps the output a match
                self._allow_only(bitmask, j, self.grammars.eos_token_id)
            else:
                matcher.fill_next_token_bitmask(bitmask, j)
        dead = (bitmask == 0).all(dim=1)
        if bool(dead.any()):
            seq = seqs[rows[int(dead.nonzero()[0])]]
            structured = seq.params.structured
            raise NoTokenLeft(f"{structured.field}: after {len(seq.output_token_ids)} generated tokens no token of "
                                 f"the model's vocabulary continues a match ({structured.kind}); the request was "
                                 f"stopped", structured.field)
        if len(rows) == logits.shape[0]:
            target = logits
        else:
            target = logits[torch.tensor(rows, device=logits.device)]
        if logits.shape[1] > self.grammars.vocab_size:  # padded model vocabulary: never sample the padding
            target[:, self.grammars.vocab_size:] = float("-inf")
        xgr.apply_token_bitmask_inplace(target, bitmask.to(logits.device), vocab_size=self.grammars.vocab_size)
        if target is not logits:
            logits[torch.tensor(rows, device=logits.device)] = target

    @staticmethod
    def _allow_only(bitmask: torch.Tensor, row: int, token_id: int) -> None:
        """Row row of an xgrammar bitmask (int32 words, bit t % 32 of word t // 32) allows token_id only."""
        bit = 1 << (token_id % 32)
        bitmask[row].zero_()
        bitmask[row, token_id // 32] = bit - (1 << 32) if bit >= 1 << 31 else bit

    def accept(self, request_id: str, token_id: int) -> bool:
        matcher = self._matchers.get(request_id)
        if matcher is None or matcher.is_terminated():
            return True
        return bool(matcher.accept_token(token_id))

    def release(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._matchers.pop(request_id, None)
