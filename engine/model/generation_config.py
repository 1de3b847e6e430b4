"""A checkpoint's generation_config.json, honoured as vLLM honours it.

In: an HF model directory (a GGUF carries no generation config). Out: GenerationDefaults:
- eos_token_ids: every id generation_config.json's `eos_token_id` lists (Llama 3 Instruct lists
  <|end_of_text|>, <|eom_id|> and <|eot_id|>). Besides the tokenizer's own end-of-sequence token,
  each one ends a request unless it asks ignore_eos (`with_eos`: added to its stop_token_ids, as
  vLLM's SamplingParams.update_from_generation_config does).
- sampling: the model's sampling defaults (temperature, top_p, top_k, min_p, repetition_penalty,
  and max_new_tokens as max_tokens), used for each field a request leaves out (the OpenAI server)
  or when no SamplingParams is given (LLM.generate).

Only those keys are read; a value of the wrong type or out of range is ignored with a warning,
so a malformed file cannot break loading.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

logger = logging.getLogger(__name__)

FILE = "generation_config.json"
MAX_EOS_IDS = 64
# generation_config.json key -> (SamplingParams field, type, low, high)
_SAMPLING_KEYS = {
    "temperature": ("temperature", float, 0.0, 100.0),
    "top_p": ("top_p", float, 1e-9, 1.0),
    "top_k": ("top_k", int, -1, 1 << 30),
    "min_p": ("min_p", float, 0.0, 1.0),
    "repetition_penalty": ("repetition_penalty", float, 1e-3, 100.0),
    "max_new_tokens": ("max_tokens", int, 1, 1 << 30),
}


@dataclass(frozen=True)
class GenerationDefaults:
    eos_token_ids: tuple[int, ...] = ()
    sampling: MappingProxyType = field(default_factory=lambda: MappingProxyType({}))  # SamplingParams field -> value

    def with_eos(self, params, eos_token_id: int | None):
        """params with the model's other end-of-sequence ids among its stop_token_ids (unless ignore_eos)."""
        extra = [t for t in self.eos_token_ids if t != eos_token_id and t not in params.stop_token_set]
        if not extra or params.ignore_eos:
            return params
        return dataclasses.replace(params, stop_token_ids=list(params.stop_token_ids) + extra)

    def default_for(self, name: str, given):
        """The model's default for SamplingParams field `name` when the request did not give one."""
        return self.sampling.get(name, given)


NONE = GenerationDefaults()


def read(directory: Path) -> GenerationDefaults:
    path = Path(directory) / FILE
    if not path.is_file():
        return NONE
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        logger.warning("%s is unreadable (%s): no generation defaults", path, exc)
        return NONE
    if not isinstance(raw, dict):
        return NONE
    eos = raw.get("eos_token_id")
    eos_ids = eos if isinstance(eos, list) else [eos] if eos is not None else []
    eos_ids = tuple(t for t in eos_ids[:MAX_EOS_IDS] if isinstance(t, int) and not isinstance(t, bool) and t >= 0)
    sampling = {}
    for key, (name, kind, low, high) in _SAMPLING_KEYS.items():
        value = raw.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high or (
                kind is int and value != int(value)):
            logger.warning("%s: %s = %r ignored (expected %s in [%s, %s])", path, key, value, kind.__name__, low, high)
            continue
        sampling[name] = kind(value)
    if sampling:
        logger.info("generation defaults from %s: %s", path, sampling)
    return GenerationDefaults(eos_ids, MappingProxyType(sampling))


def defaults_of(tokenizer) -> GenerationDefaults:
    """The checkpoint's defaults carried by its tokenizer (model/tokenizer.py's Tokenizer.generation;
    none for the fake model's tokenizer). Read without importing the tokenizer module, which pulls in
    torch: the fake model's server runs without it."""
    generation = getattr(tokenizer, "generation", None)
    return generation if isinstance(generation, GenerationDefaults) else NONE
