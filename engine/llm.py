"""Offline generation in the spirit of vLLM's LLM class:

    llm = LLM()  # the embedded SmolLM2-135M
    outputs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))
    print(outputs[0].outputs[0].text)

With LoRA on (`LLM(enable_lora=True)` or `lora_modules=`), `lora_request` picks an adapter, as in
vLLM: a LoRARequest(name, int id, path) (read on first use) or a served adapter's name, one for
all prompts or one per prompt (None: the base model).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from pathlib import Path

from tqdm import tqdm

from iterserve.engine.config import DEFAULT_MODEL, ConfigError, EngineConfig
from iterserve.engine.llm_engine import LLMEngine
from iterserve.engine.lora.request import LoRARequest
from iterserve.engine.model.generation_config import defaults_of
from iterserve.engine.outputs import RequestOutput
from iterserve.engine.sampling_params import SamplingParams

PromptInput = str | list[int] | dict
LoraInput = LoRARequest | str | None


class LLM:
    def __init__(self, model: str | None = None, **engine_options):
        known = {f.name for f in dataclasses.fields(EngineConfig)}
        unknown = sorted(set(engine_options) - known)
        if unknown:
            raise ConfigError(f"unknown engine option {unknown[0]!r}; known options: {', '.join(sorted(known))}")
        self.engine = LLMEngine.from_config(EngineConfig(model=model or DEFAULT_MODEL, **engine_options))
        self.config = self.engine.config  # resolved against the model
        self._ids = itertools.count()
        self._lora_ids: dict[int, str] = {}  # LoRARequest.lora_int_id -> its name

    def get_tokenizer(self):
        return self.engine.tokenizer

    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation_config.json defaults (temperature, top_p, ...)."""
        return SamplingParams(**defaults_of(self.engine.tokenizer).sampling)

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoraInput | Sequence[LoraInput] = None,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in input order. A prompt is a string, a list of token ids,
        or {"prompt_token_ids": [...]}; sampling_params is one for all or one per prompt;
        lora_request likewise (a LoRARequest, an adapter's name, or None for the base model)."""
        if isinstance(prompts, str | dict) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or self.default_sampling_params()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling_params; "
                                 "pass one SamplingParams or one per prompt")
        if lora_request is None or isinstance(lora_request, LoRARequest | str):
            adapters = [self._adapter(lora_request)] * len(prompts)
        else:
            requests = list(lora_request)
            if len(requests) != len(prompts):
                raise ValueError(f"got {len(prompts)} prompts but {len(requests)} lora_request entries; "
                                 "pass one LoRARequest (or name) or one per prompt")
            adapters = [self._adapter(request) for request in requests]
        request_ids = []
        try:
            for prompt, param, adapter in zip(prompts, params, adapters, strict=True):
                request_ids.append(self._add(prompt, param, adapter))
        except Exception:
            for request_id in request_ids:
                self.engine.abort_request(request_id)
            self.engine.step()  # applies the aborts, so nothing stays queued
            raise
        return self._run(request_ids, use_tqdm)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        lora_request: LoraInput | Sequence[LoraInput] = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of {"role", "content"} messages) or many."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tokenizer = self.get_tokenizer()
        prompts = [tokenizer.apply_chat_template(c, add_generation_prompt=add_generation_prompt)
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)

    def _adapter(self, request: LoraInput) -> str | None:
        """The served adapter name a lora_request entry runs, reading a LoRARequest's adapter the
        first time its name is used."""
        if request is None:
            return None
        if not isinstance(request, LoRARequest | str):
            raise TypeError(f"lora_request entries are LoRARequest, an adapter name or None; got {type(request).__name__}")
        lora = self.engine.lora
        if lora is None:
            raise ConfigError("lora_request needs LoRA adapters on: LLM(..., enable_lora=True) or lora_modules=...")
        if isinstance(request, str):
            return request  # unknown names are refused by add_request (UnknownAdapterError)
        name = request.lora_name
        known = self._lora_ids.setdefault(request.lora_int_id, name)
        if known != name:
            raise ValueError(f"lora_request: lora_int_id {request.lora_int_id} is adapter {known!r}, not {name!r}; "
                             "give each adapter its own id")
        served = {info.name: info.path for info in lora.adapters()}
        if name not in served and request.lora_path:
            lora.register(name, request.lora_path)  # LoraError (a ValueError) names the field and the fix
        elif name in served and request.lora_path and Path(served[name]) != Path(request.lora_path):
            raise ValueError(f"lora_request: adapter {name!r} is served from {served[name]}, not lora_path "
                             f"{request.lora_path}; give another name (and id) to another adapter")
        return name

    def _add(self, prompt: PromptInput, params: SamplingParams, lora_name: str | None = None) -> str:
        request_id = f"llm-{next(self._ids)}"
        if isinstance(prompt, str):
            return self.engine.add_request(prompt, params, request_id=request_id, lora_name=lora_name)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return self.engine.add_request(prompt.get("prompt"), params, list(prompt["prompt_token_ids"]),
                                               request_id=request_id, lora_name=lora_name)
            return self.engine.add_request(prompt.get("prompt"), params, request_id=request_id, lora_name=lora_name)
        return self.engine.add_request(None, params, list(prompt), request_id=request_id, lora_name=lora_name)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        pending = set(request_ids)
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(request_ids), desc="generating", unit="req", disable=not use_tqdm) as bar:
            while pending:
                for output in self.engine.step():
                    if output.finished and output.request_id in pending:
                        pending.discard(output.request_id)
                        finished[output.request_id] = output
                        bar.update(1)
        return [finished[request_id] for request_id in request_ids]
