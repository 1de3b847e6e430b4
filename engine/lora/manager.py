"""The adapters one engine serves: names, an LRU of adapters in host memory, slots on the device.

In: register(name, path) / unregister(name) from any thread (start-up flags, the admin API); per
step, the adapter of each row (engine/model_runner.py). Out: a `LoraStep` the decoder calls after
each of its linears (engine/model/decoder.py `lora_step`), which adds the rows' deltas with the
batched op (engine/kernels/lora.py).

Slots: each of the `max_loras` device slots holds one adapter's A and B for every layer, as the
decoder fuses its linears: q/k/v share one shrink of stacked A (3 x rank columns) and one expand
of a block-diagonal B, gate/up likewise, so a fused linear takes one LoRA op. An adapter of a
checkpoint's own fused linear (Phi-3's qkv_proj, gate_up_proj) has one A and one B over the whole
fused output: it takes the first rank columns of the shrink and a full row block of the expand. A
smaller rank is zero-padded to --max-lora-rank, a module the adapter does not target is all zeros. A step's
adapters are put in slots before it runs, evicting the least recently used slot no row of the
step needs (the scheduler admits at most max_loras adapters at once). The host keeps up to
`max_cpu_loras` read adapters (LRU); one that fell out is read from its directory again.

An unregistered adapter takes no new requests, but requests already running on it finish: its
weights stay readable until they do.

Tensor parallelism: each rank's manager reads the adapter and keeps its own part (adapter.py
shard_adapter); rank 0's step plan names each step's adapters with their directory and load
number (`sources`), and a worker reads one it has not (`ensure`), so adapters loaded at run time
reach every rank without a message of their own.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from iterserve.engine.kernels.lora import Segments, lora_add, segments_of
from iterserve.engine.lora.adapter import (
    FUSED_MODULES,
    FUSED_TARGETS,
    LoraAdapter,
    LoraError,
    linear_shapes,
    load_adapter,
    shard_adapter,
)
from iterserve.engine.model.loader import ModelConfig


def check_lora_model(model, quantization: str) -> None:
    """LoRA adds its deltas in DecoderModel.adapted_linear, which every family's projections go
    through (a mixture-of-experts layer's experts excepted: adapters of those are refused when read)."""
    from iterserve.engine.model.decoder import DecoderModel

    if not isinstance(model, DecoderModel):
        raise LoraError(f"the {type(model).__name__} model does not run the shared decoder; LoRA adapters are "
                        "served on the decoder families (docs/models.md)")


@dataclass(frozen=True)
class LoraInfo:
    name: str
    path: str
    rank: int


class LoraManager:
    """config: the whole model's; shard: this rank's engine/model/parallel.Shard under tensor
    parallelism (the slots then hold the rank's part), else None."""

    def __init__(self, config: ModelConfig, layers: list, max_loras: int, max_lora_rank: int,
                 max_cpu_loras: int, device: torch.device, dtype: torch.dtype, shard=None):
        self.config, self.max_loras, self.max_rank, self.max_cpu_loras = config, max_loras, max_lora_rank, max_cpu_loras
        self.device, self.dtype, self.shard = device, dtype, shard
        self._lock = threading.Lock()
        self._registered: dict[str, LoraInfo] = {}
        # every adapter ever registered, as (directory, load number): running requests may outlive unregister
        self._paths: dict[str, tuple[str, int]] = {}
        self._loads = 0
        self._host: OrderedDict[str, LoraAdapter] = OrderedDict()
        self._slot_of: OrderedDict[str, int] = OrderedDict()  # least recently used first
        self.slot_loads = 0  # adapters written into a device slot, over the engine's life
        if shard is not None and shard.size > 1:
            from iterserve.engine.model.parallel import local_config

            self.shapes = linear_shapes(local_config(config, shard))
        else:
            self.shard, self.shapes = None, linear_shapes(config)
        shapes = self.shapes
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
        return self._register(name, str(path), None)

    def _register(self, name: str, path: str, load: int | None) -> LoraInfo:
        adapter = self._read(name, path)
        info = LoraInfo(name=name, path=path, rank=adapter.rank)
        with self._lock:
            if load is None and name in self._registered:
                raise LoraError(f"adapter {name!r} is already loaded; unload it first to replace it")
            if load is None:
                self._loads += 1
            self._registered[name] = info
            self._paths[name] = (path, self._loads if load is None else load)
            self._host.pop(name, None)
            self._keep_on_host(adapter)
            self._slot_of.pop(name, None)  # an older adapter of this name: its slot is free again
        return info

    def _read(self, name: str, path: str) -> LoraAdapter:
        adapter = load_adapter(name, path, self.config, self.max_rank)
        return adapter if self.shard is None else shard_adapter(adapter, self.config, self.shard)

    def sources(self, names) -> dict[str, tuple[str, int]]:
        """(directory, load number) of each named adapter: what a tensor-parallel worker reads (ensure)."""
        with self._lock:
            return {name: self._paths[name] for name in names}

    def ensure(self, name: str, source: tuple[str, int]) -> None:
        """A tensor-parallel worker: serve name as rank 0 does, reading it unless this load of it is
        read already (rank 0 registered it, so it reads)."""
        with self._lock:
            if self._paths.get(name) == tuple(source):
                return
        self._register(name, source[0], source[1])

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
            path = self._paths[name][0]
        if adapter is None:
            adapter = self._read(name, path)
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
        fused = {target: module for module, target in FUSED_MODULES.items()}
        for layer, per_layer in enumerate(self.weights):
            for target, modules in FUSED_TARGETS.items():
                a_slot, b_slot = per_layer[target]
                a_slot[slot].zero_()
                b_slot[slot].zero_()
                pair = adapter.weights.get((layer, fused.get(target, "")))
                if pair is not None:  # one A and B over the fused output (load_adapter allows no split ones beside it)
                    a, b = pair
                    a_slot[slot, :, : adapter.rank] = a.t().to(self.device, self.dtype)
                    b_slot[slot, : adapter.rank] = b.t().to(self.device, self.dtype)
                    continue
                offset = 0
                for j, module in enumerate(modules):
                    fan_out = self.shapes[module][1]
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
