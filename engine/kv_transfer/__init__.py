"""Prefill/decode disaggregation: moving a prompt's KV blocks from a prefill engine to a decode
engine.

Split as vLLM v1 splits its KV connector, written afresh for this engine:

- `connector.KVConnector` is the scheduler side. On a prefill engine it pins a finished
  prompt's blocks under a lease (an extra reference in the block pool, so no sequence's
  preemption can take them) and frees them when the decode engine releases them, when the lease
  expires or when the engine stops. On a decode engine it starts a pull for a sequence the
  scheduler has given blocks to ("waiting for KV"), and hands the pulled bytes back to the
  scheduler, which loads them into the sequence's blocks at the start of a step.
- `transport.KVTransport` moves bytes between engines; `transport.TcpTransport` is the TCP
  implementation (framed messages, `wire.py`; a handshake refusing an engine whose KV layout
  differs, `layout.py`). An RDMA/NCCL/NIXL transport would implement the same interface.
- Against vLLM's KVConnectorBase_V1: `pin` is its scheduler-side request_finished (keep the blocks,
  return kv_transfer_params), admitting a "waiting for KV" sequence with blocks and `start_pull`
  its get_num_new_matched_tokens + update_state_after_alloc, `poll` its get_finished; the
  executor's `read_kv` / KVLoad at the step's start play the worker side (save_kv_layer /
  start_load_kv), whole prompts at a time rather than layer by layer.
- `params.py` reads and writes the `kv_transfer_params` objects of the wire contract
  (docs/disaggregation.md); `auth.py` signs and checks them with the InferenceService's KV key, so
  only the router and peer engines can drive a transfer (docs/security.md).

Threads: the block pool belongs to the engine thread. The transport's server threads only read
pinned blocks (under a read count that keeps the lease alive) and queue releases; the decode
side's pull threads write into their own staging buffers, never into the KV pool, so freeing a
sequence's blocks while its pull is in flight (an abort) cannot corrupt anything.
"""
