"""The adapters one engine serves: names, an LRU of adapters in host memory, slots on the device.

In: register(name, path) / unregister(name) from any thread (start-up flags, the admin API); per
step, the adapter of each row (engine/model_runner.py). Out: a `LoraStep` the decoder calls after
each of its linears (engine/model/decoder.py `lora_step`), which adds the rows' deltas with the
batched op (engine/kernels/lora.py).

Slots: each of the `max_loras` device slots holds one adapter's A and B for every layer, as the
decoder fuses its linears: q/k/v share one shrink of stacked A (3 x rank columns) and one expand
of a block-diagonal B, gate/up likewise, so a fused linear takes one LoRA op. A smaller rank is
zero-padded to --max-lora-rank, a module the adapter does not target is all zeros. A step's
adapters are put in slots before it runs, evicting the least recently used slot no row of the
step needs (the scheduler admits at most max_loras adapters at once). The host keeps up to
`max_cpu_loras` read adapters (LRU); one that fell out is read from its directory again.

An unregistered adapter takes no new requests, but requests already running on it finish: its
weights stay readable until they do.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from iterserve.engine.kernels.lora import Segments, lora_add, segments_of
from iterserve.engine.lora.adapter import (
    FUSED_TARGETS,
    LoraAdapter,
    LoraError,
    load_adapter,
    module_shapes,
)
from iterserve.engine.model.loader import ModelConfig


def check_lora_model(model, quantization: str) -> None:
    """LoRA adds its deltas in DecoderModel's attention_input and mlp; a family that replaces them
    (Gemma's extra norms, Phi-3, mixture-of-experts MLPs) is refused rather than served unadapted."""
    from iterserve.engine.model.decoder import DecoderModel

    cls = type(model)
    if not isinstance(model, DecoderModel) or any(
            getattr(cls, name) is not getattr(DecoderModel, name) for name in ("attention_input", "mlp")):
        raise LoraError(f"the {cls.__name__} family computes its own projections; LoRA adapters are served on the "
                        "Llama-like families (llama, mistral, qwen2, qwen3)")


@dataclass(frozen=True)
class LoraInfo:
    name: str
    path: str
    rank: int


class LoraManager:
    def __init__(self, config: ModelConfig, layers: list, max_loras: int, max_lora_rank: int,
                 max_cpu_loras: int, device: torch.device, dtype: torch.dtype):
        self.config, self.max_loras, self.max_rank, self.max_cpu_loras = config, max_loras, max_lora_rank, max_cpu_loras
        self.device, self.dtype = device, dtype
        self._lock = threading.Lock()
        self._registered: dict[str, LoraInfo] = {}
        self._paths: dict[str, str] = {}  # every adapter ever registered: running requests may outlive unregister
        self._host: OrderedDict[str, LoraAdapter] = OrderedDict()
        self._slot_of: OrderedDict[str, int] = OrderedDict()  # least recently used first
        self.slot_loads = 0  # adapters written into a device slot, over the engine's life
        shapes = module_shapes(config)
        self.layer_index = {id(layer): i for i, layer in enumerate(layers)}
        self.weights: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = []
        for _ in layers:
            per_layer = {}
            for target, modules in FUSED_TARGETS.items():
                fan_in = shapes[modules[0]][0]
                fan_out = sum(shapes[m][1] for m in modules)
                rank = max_lora_rank * len(modules)
                per_layer[target] = (torch.zeros(max_loras, fan_in, rank, device=device, dtype=dtype),
                                     torch.zeros(max_loras, rank, fan_out, device=device, dtype=dtype))
            self.weights.append(per_layer)
        self.scales = torch.zeros(max_loras, device=device, dtype=dtype)

    # -- names (any thread) --------------------------------------------------------------------
    def register(self, name: str, path: str) -> LoraInfo:
        """Read and check the adapter, then serve it under name. Raises LoraError."""
        adapter = load_adapter(name, path, self.config, self.max_rank)
        info = LoraInfo(name=name, path=str(path), rank=adapter.rank)
        with self._lock:
            if name in self._registered:
                raise LoraError(f"adapter {name!r} is already loaded; unload it first to replace it")
            self._registered[name] = info
            self._paths[name] = str(path)
            self._host.pop(name, None)
            self._keep_on_host(adapter)
            self._slot_of.pop(name, None)  # an older adapter of this name: its slot is free again
        return info

    def unregister(self, name: str) -> None:
        with self._lock:
            if self._registered.pop(name, None) is None:
                raise KeyError(name)

    def is_registered(self, name: str) -> bool:
        with self._lock:
            return name in self._registered

    def adapters(self) -> list[LoraInfo]:
        with self._lock:
            return list(self._registered.values())

    def loaded_in_slots(self) -> list[str]:
        with self._lock:
            return list(self._slot_of)

    # -- per step (the engine thread) --------------------------------------------------------------
    def step(self, row_adapters: list[str | None]) -> LoraStep | None:
        """The LoraStep of a batch whose row i runs adapter row_adapters[i] (None: the base model), or
        None when no row has one."""
        names = {n for n in row_adapters if n is not None}
        if not names:
            return None
        if len(names) > self.max_loras:
            raise RuntimeError(f"a step has {len(names)} adapters, more than --max-loras {self.max_loras}")
        slots = {name: self._slot(name, names) for name in names}
        return LoraStep(self, segments_of([-1 if n is None else slots[n] for n in row_adapters]))

    def _slot(self, name: str, needed: set[str]) -> int:
        with self._lock:
            if name in self._slot_of:
                self._slot_of.move_to_end(name)
                return self._slot_of[name]
            used = set(self._slot_of.values())
            free = [s for s in range(self.max_loras) if s not in used]
            if free:
                slot = free[0]
            else:
                victim = next(n for n in self._slot_of if n not in needed)
                slot = self._slot_of.pop(victim)
            adapter = self._host.get(name)
            path = self._paths[name]
        if adapter is None:
            adapter = load_adapter(name, path, self.config, self.max_rank)
            with self._lock:
                self._keep_on_host(adapter)
        self._write(slot, adapter)
        with self._lock:
            self._slot_of[name] = slot
            if name in self._host:
                self._host.move_to_end(name)
        self.slot_loads += 1
        return slot

    def _keep_on_host(self, adapter: LoraAdapter) -> None:
        self._host[adapter.name] = adapter
        while len(self._host) > self.max_cpu_loras:
            self._host.popitem(last=False)

    def _write(self, slot: int, adapter: LoraAdapter) -> None:
        rank = self.max_rank
        for layer, per_layer in enumerate(self.weights):
            for target, modules in FUSED_TARGETS.items():
                a_slot, b_slot = per_layer[target]
                a_slot[slot].zero_()
                b_slot[slot].zero_()
                offset = 0
                for j, module in enumerate(modules):
                    fan_out = module_shapes(self.config)[module][1]
                    pair = adapter.weights.get((layer, module))
                    if pair is not None:
                        a, b = pair
                        a_slot[slot, :, j * rank : j * rank + adapter.rank] = a.t().to(self.device, self.dtype)
                        b_slot[slot, j * rank : j * rank + adapter.rank, offset : offset + fan_out] = (
                            b.t().to(self.device, self.dtype))
                    offset += fan_out
        self.scales[slot] = adapter.scale


class LoraStep:
    """One step's rows -> slots; the decoder calls add() after each adaptable linear."""

    def __init__(self, manager: LoraManager, segments: Segments):
        self.manager, self.segments = manager, segments

    def add(self, layer, target: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        index = self.manager.layer_index.get(id(layer))
        if index is None:
            return out
        a, b = self.manager.weights[index][target]
        return lora_add(out, x, a, b, self.manager.scales, self.segments)
