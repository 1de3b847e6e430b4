"""The OpenAI-compatible routes: GET /v1/models here, POST /v1/completions (completions.py) and
POST /v1/chat/completions (chat.py).

The endpoints share one path to the engine: request fields become SamplingParams
(request_params.py), a request's choices are submitted, watched and aborted by fan_out.py, logprobs
are formatted by logprobs_format.py, and streams are written by sse.py, shaped exactly like
OpenAI's and ending with `data: [DONE]`. Tokenizing and rendering the chat template run in a worker
thread, so a huge prompt never stalls other requests' streams. A request that fails on its own (its
sampling, say) gets a 500 error body, or an error event on its stream; the other requests go on.
Whether streaming or not, a client that disconnects has its request aborted at the engine's next
step, which frees the request's KV blocks.
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from iterserve.engine.server import chat, completions, lora_api
from iterserve.engine.server.protocol import ModelCard, ModelList
from iterserve.engine.server.state import ServerState

router = APIRouter()


@router.get("/v1/models", response_model=ModelList)
async def list_models(request: Request) -> ModelList:
    state: ServerState = request.app.state.server
    max_model_len = state.engine_config.max_model_len
    card = ModelCard(id=state.model_name, created=state.created, max_model_len=max_model_len, root=state.model_name)
    lora = state.engine.engine.lora if state.engine is not None else None
    adapters = [ModelCard(id=a.name, created=state.created, max_model_len=max_model_len, root=a.path,
                          parent=state.model_name) for a in (lora.adapters() if lora is not None else ())]
    return ModelList(data=[card, *adapters])


router.include_router(completions.router)
router.include_router(chat.router)
router.include_router(lora_api.router)
