"""LoRA adapters served beside the base model.

In: PEFT-format adapter directories (adapter_config.json + adapter_model.safetensors), named at
start (`--lora-modules name=path`) or at run time (the admin API); requests naming an adapter as
their `model`. Out: per step, the adapters' low-rank deltas added to the base model's linears
(q/k/v/o, gate/up/down) for exactly the rows of the requests that chose them, through the batched
op in engine/kernels/lora.py. adapter.py reads and checks an adapter (and cuts a tensor-parallel
rank's part of it); manager.py keeps the names known to the engine, an LRU of adapters in host
memory and the slot pool on the device; request.py is the offline API's LoRARequest.
"""
