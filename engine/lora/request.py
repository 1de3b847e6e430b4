"""vLLM's LoRARequest for the offline API: `LLM.generate(prompts, params, lora_request=...)`.

    from iterserve.engine import LLM, LoRARequest
    llm = LLM(enable_lora=True)
    llm.generate(["SELECT"], lora_request=LoRARequest("sql", 1, "/adapters/sql"))

The name is what the engine serves the adapter as (a request's `model` on the HTTP API); the
integer id identifies it as in vLLM (one name per id, ids from 1); the path is a PEFT adapter
directory, read the first time the name is used.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"LoRARequest lora_name must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest lora_int_id must be an integer of at least 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str):
            raise ValueError(f"LoRARequest lora_path must be a string (a PEFT adapter directory), "
                             f"got {type(self.lora_path).__name__}")

    # vLLM's shorter names
    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def path(self) -> str:
        return self.lora_path
