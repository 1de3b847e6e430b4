"""The `kv_transfer_params` objects of the P/D wire contract, read and written in one place.

In a request:
  {"do_remote_decode": true}  -> run the prompt here, pin its KV blocks under a lease and answer
                                 with the lease's kv_transfer_params (the prefill call).
  {"do_remote_prefill": true, <the prefill answer's kv_transfer_params>}
                              -> pull the prompt's KV from the prefill engine, then generate
                                 (the decode call).
In the prefill answer: transfer_id, engine_id, host, port, block_ids, num_tokens, block_size,
compat_hash, lease_expires_at (unix seconds).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from iterserve.engine.sampling_params import InvalidRequestError

PARAM = "kv_transfer_params"
ANSWER_FIELDS = ("transfer_id", "engine_id", "host", "port", "block_ids", "num_tokens", "block_size",
                 "compat_hash", "lease_expires_at")


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


def parse_request(raw: Any) -> KVTransferState | None:
    """A request's kv_transfer_params; None when it asks for no transfer. Raises
    InvalidRequestError naming the field."""
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
    if not block_ids or any(not isinstance(b, int) or isinstance(b, bool) or b < 0 for b in block_ids):
        raise InvalidRequestError(f"{PARAM}.block_ids must be a non-empty list of non-negative integers",
                                  f"{PARAM}.block_ids")
    port = need("port", int, "an integer port")
    if not 0 < port < 65536:
        raise InvalidRequestError(f"{PARAM}.port must be in 1..65535", f"{PARAM}.port")
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
    )
