"""The iterserve inference engine: iteration-level scheduling over a paged KV cache."""

from iterserve.engine.config import ConfigError, EngineConfig
from iterserve.engine.lora.request import LoRARequest
from iterserve.engine.outputs import CompletionOutput, RequestOutput
from iterserve.engine.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "EngineConfig", "ConfigError", "RequestOutput", "CompletionOutput", "LoRARequest"]


def __getattr__(name: str):
    # LLM pulls in torch and the model code; import it only when asked for.
    if name == "LLM":
        from iterserve.engine.llm import LLM

        return LLM
    raise AttributeError(name)
