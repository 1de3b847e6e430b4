"""`--speculative-config`: vLLM's JSON spelling of the speculative decoding options.

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    {"method": "draft_model", "model": "/path/to/draft.gguf", "num_speculative_tokens": 3}

Keys: method (ngram | draft_model), num_speculative_tokens (k, 1..16), prompt_lookup_min/max (the
n-gram sizes matched, largest first; ngram only), model (the draft: a path or a registry name with
the target's tokenizer; draft_model only), disable_by_batch_size (speculate only while at most
this many sequences run; unset: DISABLE_BY_BATCH_SIZE for the device type the model runs on),
min_acceptance_rate (a sequence whose measured acceptance falls below it stops speculating,
probing again now and then). Unknown keys are refused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16
MAX_JSON_BYTES = 4096
FLAG = "--speculative-config"
# The off-switch's default per device type: no speculation in a step with more running sequences.
# CPU: measured where speculation stops paying (bench.engine.spec_decode --mode crossover, docs/spec_decode.md):
# a CPU step of a small model is compute-bound from a few rows on, so 1 + k verified rows per
# sequence cost nearly as much as real ones. Accelerators: a decode step stays bandwidth-bound far
# longer (vLLM's speculative_disable_by_batch_size is in this range); not measured here.
DISABLE_BY_BATCH_SIZE = {"cpu": 2, "cuda": 8}


class SpeculativeConfigError(ValueError):
    pass


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    model: str | None = None
    disable_by_batch_size: int | None = None
    min_acceptance_rate: float = 0.2

    @classmethod
    def parse(cls, raw: str | dict | None) -> SpeculativeConfig | None:
        """The options of a --speculative-config value (JSON text or a dict), checked; None when off."""
        if raw is None or raw == "":
            return None
        if isinstance(raw, str):
            if len(raw.encode()) > MAX_JSON_BYTES:
                raise SpeculativeConfigError(f"{FLAG}: longer than {MAX_JSON_BYTES} bytes")
            try:
                raw = json.loads(raw)
            except json.JSONDecodeError as error:
                raise SpeculativeConfigError(f"{FLAG}: not JSON ({error}); write e.g. "
                                             '\'{"method": "ngram", "num_speculative_tokens": 4}\'') from None
        if not isinstance(raw, dict):
            raise SpeculativeConfigError(f"{FLAG}: must be a JSON object, got {type(raw).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise SpeculativeConfigError(f"{FLAG}: unknown key {unknown[0]!r}; known keys: {', '.join(sorted(known))}")
        config = cls(**raw)
        config.validate()
        return config

    def validate(self) -> None:
        if self.method not in METHODS:
            raise SpeculativeConfigError(f"{FLAG}: method must be one of {', '.join(METHODS)}; got {self.method!r}")
        _int_in("num_speculative_tokens", self.num_speculative_tokens, 1, MAX_SPECULATIVE_TOKENS)
        if self.disable_by_batch_size is not None:
            _int_in("disable_by_batch_size", self.disable_by_batch_size, 1, 1 << 20)
        if not isinstance(self.min_acceptance_rate, int | float) or not 0 <= self.min_acceptance_rate <= 1:
            raise SpeculativeConfigError(f"{FLAG}: min_acceptance_rate must be in [0, 1], got "
                                         f"{self.min_acceptance_rate!r}")
        if self.method == "ngram":
            _int_in("prompt_lookup_min", self.prompt_lookup_min, 1, 64)
            _int_in("prompt_lookup_max", self.prompt_lookup_max, 1, 64)
            if self.prompt_lookup_min > self.prompt_lookup_max:
                raise SpeculativeConfigError(
                    f"{FLAG}: prompt_lookup_min ({self.prompt_lookup_min}) exceeds prompt_lookup_max "
                    f"({self.prompt_lookup_max}); lower the first or raise the second")
            if self.model is not None:
                raise SpeculativeConfigError(f"{FLAG}: model names a draft model, which method ngram does not use; "
                                             'drop it or set "method": "draft_model"')
        elif not isinstance(self.model, str) or not self.model:
            raise SpeculativeConfigError(f"{FLAG}: method draft_model needs \"model\": the draft model's path or name "
                                         "(same tokenizer as the target)")

    def batch_limit(self, device_type: str) -> int:
        """disable_by_batch_size, or the default for this device type ("cpu", "cuda"; others as cuda)."""
        if self.disable_by_batch_size is not None:
            return self.disable_by_batch_size
        return DISABLE_BY_BATCH_SIZE.get(device_type, DISABLE_BY_BATCH_SIZE["cuda"])


def _int_in(name: str, value, low: int, high: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise SpeculativeConfigError(f"{FLAG}: {name} must be an integer in [{low}, {high}], got {value!r}")
