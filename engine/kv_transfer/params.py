"""The `kv_transfer_params` objects of the P/D wire contract, read and written in one place.

In a request:
  {"do_remote_decode": true}  -> run the prompt here, pin its KV blocks under a lease and answer
                                 with the lease's kv_transfer_params (the prefill call).
  {"do_remote_prefill": true, <the prefill answer's kv_transfer_params>}
                              -> pull the prompt's KV from the prefill engine, then generate
                                 (the decode call).
In the prefill answer: transfer_id, engine_id, host, port, block_ids, num_tokens, block_size,
compat_hash, lease_expires_at (unix seconds), lease_secret (presented on the KV connection's PULL
and RELEASE), expires_at and mac; from a prefill engine of several ranks also tensor_parallel_size
T, pipeline_parallel_size P and shards, the [host, port] of the KV listeners of its ranks
1..T x P - 1 (host, port: rank 0's; rank r is pipeline stage r // T, tensor rank r % T). A missing
tensor_parallel_size or pipeline_parallel_size means 1.

Trust (auth.py): engines of role both take no kv_transfer_params at all. Roles prefill and decode
take them only signed with the InferenceService's KV key: do_remote_decode as the router signs
it, do_remote_prefill as the prefill engine signed its answer (the router adds only
"do_remote_prefill", which the MAC leaves out). So a client can neither lease KV nor make a decode
engine dial an address it chose; `accept` is the one call the server makes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from iterserve.engine.kv_transfer import auth
from iterserve.engine.sampling_params import InvalidRequestError

PARAM = "kv_transfer_params"
MAX_BLOCK_IDS = 1 << 16  # far above any prompt's blocks; bounds the work a request makes here
MAX_TENSOR_PARALLEL = 64  # far above any tensor-parallel group; bounds the shard addresses a request names
MAX_PIPELINE_PARALLEL = 64  # far above any model's useful stage count; the same bound
MAX_HOST_CHARS = 253


@dataclass(frozen=True)
class RemotePrefill:
    """Where a decode request's prompt KV waits: a prefill engine's lease."""

    transfer_id: str
    engine_id: str
    host: str
    port: int
    block_ids: list[int]
    num_tokens: int
    block_size: int
    compat_hash: str
    lease_expires_at: float
    lease_secret: str
    # A prefill engine of several ranks: its sizes, and where its ranks 1..T x P - 1 serve their KV shards.
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    shards: tuple[tuple[str, int], ...] = ()
    # The params carried a valid MAC: the KV comes from a peer of this InferenceService. Only such
    # KV may enter the shared prefix cache (BlockManager.cache_computed_blocks).
    authenticated: bool = False


@dataclass
class KVTransferState:
    """A sequence's part in a transfer (Sequence.kv_transfer)."""

    remote_decode: bool = False  # prefill side: pin the prompt's blocks when it finishes
    remote_prefill: RemotePrefill | None = None  # decode side: pull these blocks before generating
    params_out: dict | None = None  # prefill side: the lease, returned to the client
    failure: str | None = None  # decode side: why the pull failed (then the prompt is recomputed)
    loaded: bool = False  # decode side: the pulled KV is in the sequence's blocks
    first_block: int = 0  # decode side: the first prompt block pulled (earlier ones: the local prefix cache)

    @property
    def wants_pull(self) -> bool:
        return self.remote_prefill is not None and not self.loaded and self.failure is None


def accept(raw: Any, role: str, key: bytes | None, now: float) -> KVTransferState | None:
    """A request's kv_transfer_params, checked for this engine's role and authenticated with its KV
    key (now: unix seconds); None when the request asks for no transfer. Raises
    InvalidRequestError naming the field."""
    if raw is None:
        return None
    if role == "both" or key is None:
        raise InvalidRequestError(f"{PARAM} is not accepted here: this engine runs --role {role}; only the "
                                  "router sends it, to --role prefill and decode engines. Remove the field.", PARAM)
    state = parse_request(raw)
    if state is None:
        return None
    purpose = auth.REMOTE_DECODE if state.remote_decode else auth.REMOTE_PREFILL
    signed = {k: v for k, v in raw.items() if k != "do_remote_prefill"}
    try:
        auth.verify(signed, key, purpose, now)
    except auth.KVAuthError as error:
        raise InvalidRequestError(f"{PARAM}.{auth.MAC_FIELD}: {error}", f"{PARAM}.{auth.MAC_FIELD}") from None
    if state.remote_prefill is not None:
        state.remote_prefill = dataclasses.replace(state.remote_prefill, authenticated=True)
    return state


def parse_request(raw: Any) -> KVTransferState | None:
    """The shape of a request's kv_transfer_params, unauthenticated (see `accept`); None when it asks
    for no transfer. Raises InvalidRequestError naming the field."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise InvalidRequestError(f"{PARAM} must be an object", PARAM)
    decode, prefill = raw.get("do_remote_decode", False), raw.get("do_remote_prefill", False)
    for name, value in (("do_remote_decode", decode), ("do_remote_prefill", prefill)):
        if not isinstance(value, bool):
            raise InvalidRequestError(f"{PARAM}.{name} must be true or false", f"{PARAM}.{name}")
    if decode and prefill:
        raise InvalidRequestError(f"{PARAM}: do_remote_decode and do_remote_prefill exclude each other "
                                  "(send the first to a prefill engine, the second to a decode engine)", PARAM)
    if decode:
        return KVTransferState(remote_decode=True)
    if not prefill:
        return None
    return KVTransferState(remote_prefill=_remote_prefill(raw))


def _remote_prefill(raw: dict) -> RemotePrefill:
    def need(name: str, kind: type | tuple[type, ...], what: str):
        value = raw.get(name)
        if value is None:
            raise InvalidRequestError(f"{PARAM}.{name} is missing: with do_remote_prefill, send the prefill "
                                      f"answer's {PARAM} unchanged", f"{PARAM}.{name}")
        if not isinstance(value, kind) or isinstance(value, bool):
            raise InvalidRequestError(f"{PARAM}.{name} must be {what}", f"{PARAM}.{name}")
        return value

    block_ids = need("block_ids", list, "a list of block ids")
    if len(block_ids) > MAX_BLOCK_IDS:
        raise InvalidRequestError(f"{PARAM}.block_ids has more than {MAX_BLOCK_IDS} entries", f"{PARAM}.block_ids")
    if not block_ids or any(not isinstance(b, int) or isinstance(b, bool) or b < 0 for b in block_ids):
        raise InvalidRequestError(f"{PARAM}.block_ids must be a non-empty list of non-negative integers",
                                  f"{PARAM}.block_ids")
    port = need("port", int, "an integer port")
    if not 0 < port < 65536:
        raise InvalidRequestError(f"{PARAM}.port must be in 1..65535", f"{PARAM}.port")
    tensor_parallel_size = _size(raw, "tensor_parallel_size", MAX_TENSOR_PARALLEL)
    pipeline_parallel_size = _size(raw, "pipeline_parallel_size", MAX_PIPELINE_PARALLEL)
    shards = _shards(raw.get("shards", []), tensor_parallel_size, pipeline_parallel_size)
    num_tokens = need("num_tokens", int, "a positive integer")
    block_size = need("block_size", int, "a positive integer")
    if num_tokens < 1 or block_size < 1:
        raise InvalidRequestError(f"{PARAM}.num_tokens and block_size must be positive", PARAM)
    return RemotePrefill(
        transfer_id=need("transfer_id", str, "a string"),
        engine_id=need("engine_id", str, "a string"),
        host=need("host", str, "a host name or address"),
        port=port,
        block_ids=list(block_ids),
        num_tokens=num_tokens,
        block_size=block_size,
        compat_hash=need("compat_hash", str, "a string"),
        lease_expires_at=float(need("lease_expires_at", (int, float), "unix seconds")),
        lease_secret=need("lease_secret", str, "a string"),
        tensor_parallel_size=tensor_parallel_size,
        pipeline_parallel_size=pipeline_parallel_size,
        shards=shards,
    )


def _size(raw: dict, name: str, limit: int) -> int:
    value = raw.get(name, 1)
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= limit:
        raise InvalidRequestError(f"{PARAM}.{name} must be an integer in 1..{limit}", f"{PARAM}.{name}")
    return value


def _shards(raw: Any, tensor_parallel_size: int, pipeline_parallel_size: int) -> tuple[tuple[str, int], ...]:
    """The [host, port] of each rank 1..T x P - 1's KV listener, checked as the leader's are."""
    field = f"{PARAM}.shards"
    others = tensor_parallel_size * pipeline_parallel_size - 1
    if not isinstance(raw, list) or len(raw) != others:
        raise InvalidRequestError(f"{field} must list {others} [host, port] pairs (one per rank after the first, for "
                                  f"tensor_parallel_size {tensor_parallel_size} x pipeline_parallel_size "
                                  f"{pipeline_parallel_size})", field)
    shards = []
    for entry in raw:
        if (not isinstance(entry, list) or len(entry) != 2 or not isinstance(entry[0], str)
                or not 0 < len(entry[0]) <= MAX_HOST_CHARS or not isinstance(entry[1], int)
                or isinstance(entry[1], bool) or not 0 < entry[1] < 65536):
            raise InvalidRequestError(f"{field}: each entry must be [host, port] with a host of at most "
                                      f"{MAX_HOST_CHARS} characters and a port in 1..65535", field)
        shards.append((entry[0], entry[1]))
    return tuple(shards)
