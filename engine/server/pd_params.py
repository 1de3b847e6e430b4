"""The OpenAI routes' P/D disaggregation hook: a request's kv_transfer_params checked against the
request's shape on the way in, and a prefill call's lease put in its answer on the way out. The
object itself is read and written by engine/kv_transfer/params.py, which the engine calls."""

from __future__ import annotations

from iterserve.engine.kv_transfer.params import PARAM
from iterserve.engine.outputs import RequestOutput
from iterserve.engine.server.errors import invalid
from iterserve.engine.server.protocol import _SamplingFields


def request_kv_transfer(body: _SamplingFields, num_prompts: int) -> dict | None:
    kv = body.kv_transfer_params
    if kv is None:
        return None
    if body.n > 1 or num_prompts > 1:
        raise invalid(f"{PARAM}: only with one prompt and n 1", PARAM)
    if kv.get("do_remote_decode") is True and body.stream:
        raise invalid(f"{PARAM}.do_remote_decode: a prefill call is answered whole (its answer carries "
                      f"the {PARAM}); send stream: false", "stream")
    return kv


def answer_kv_transfer(finals: list[RequestOutput]) -> dict:
    """A prefill call's lease on its prompt's KV, for the decode call (empty for other requests)."""
    params = finals[0].kv_transfer_params if len(finals) == 1 else None
    return {PARAM: params} if params is not None else {}
