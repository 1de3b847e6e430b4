"""LoRA adapters at run time, as vLLM spells it: POST /v1/load_lora_adapter {lora_name, lora_path}
and POST /v1/unload_lora_adapter {lora_name}, behind the admin token (admin.require_admin).

A load reads and checks the adapter (engine/lora/adapter.py) in a worker thread, so streams go on;
from its answer on, requests may name it as their `model`. An unload refuses new requests for it
(404) while requests already running on it finish. Answers are vLLM's plain-text success lines;
errors are the usual error bodies (400: the adapter cannot be served, 404: no such adapter).
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse

from iterserve.engine.lora.adapter import LoraError
from iterserve.engine.server.admin import Admin
from iterserve.engine.server.errors import APIError, invalid, unavailable
from iterserve.engine.server.protocol import (
    ErrorResponse,
    LoadLoraAdapterRequest,
    UnloadLoraAdapterRequest,
)
from iterserve.engine.server.state import ServerState

router = APIRouter(responses={status: {"model": ErrorResponse} for status in (400, 401, 403, 404, 503)})


def _manager(state: ServerState):
    if state.engine is None:
        raise unavailable("the model is still loading; retry shortly", "loading")
    lora = state.engine.engine.lora
    if lora is None:
        raise invalid("LoRA adapters are off on this server; start it with --enable-lora (or --lora-modules)",
                      "lora_name")
    return lora


@router.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
async def load_lora_adapter(body: LoadLoraAdapterRequest, state: Admin) -> str:
    lora = _manager(state)
    if body.lora_name == state.model_name:
        raise invalid(f"lora_name {body.lora_name!r} is the base model's name; choose another", "lora_name")
    try:
        await asyncio.to_thread(lora.register, body.lora_name, body.lora_path)
    except LoraError as error:
        raise invalid(str(error), "lora_path") from None
    return f"Success: LoRA adapter '{body.lora_name}' added successfully."


@router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
async def unload_lora_adapter(body: UnloadLoraAdapterRequest, state: Admin) -> str:
    lora = _manager(state)
    try:
        lora.unregister(body.lora_name)
    except KeyError:
        raise APIError(404, f"LoRA adapter {body.lora_name!r} is not loaded (GET /v1/models lists the loaded ones)",
                       "invalid_request_error", "lora_name", "lora_not_found") from None
    return f"Success: LoRA adapter '{body.lora_name}' removed successfully."
