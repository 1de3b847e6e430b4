"""Admin API: read and change max_num_seqs live, start a drain, and read the newest step records
(what each engine step did and how long it took: engine/step_log.py), which the operator fits its
SLO step profile on.

With a token configured (ITERSERVE_ADMIN_TOKEN or --admin-token-file) every admin call needs
`Authorization: Bearer <token>`. Without one, admin calls are refused unless the server listens
on loopback only, where only local processes can reach it.
"""

from __future__ import annotations

import hmac
import json
from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request, Response

from iterserve.engine.sampling_params import InvalidRequestError
from iterserve.engine.server.errors import APIError, invalid, unavailable
from iterserve.engine.server.protocol import (
    MAX_STEP_RECORDS_BYTES,
    AdminConfig,
    AdminConfigPatch,
    AdminStepsQuery,
    DrainStatus,
    ErrorResponse,
    StepRecordsPage,
)
from iterserve.engine.server.state import ServerState
from iterserve.engine.step_log import as_record

ADMIN_TOKEN_ENV = "ITERSERVE_ADMIN_TOKEN"


def require_admin(request: Request) -> ServerState:
    state: ServerState = request.app.state.server
    token = state.options.admin_token
    if token is None:
        if state.options.loopback_only:
            return state
        raise APIError(403, f"admin API disabled: the server listens beyond loopback and no admin token is set; "
                            f"set {ADMIN_TOKEN_ENV}", "permission_error", None, "admin_disabled")
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token.encode()):
        raise APIError(401, "admin API: send Authorization: Bearer <admin token>", "authentication_error",
                       None, "invalid_admin_token", {"WWW-Authenticate": "Bearer"})
    return state


Admin = Annotated[ServerState, Depends(require_admin)]
ERRORS = {status: {"model": ErrorResponse} for status in (400, 401, 403, 503)}
router = APIRouter(prefix="/admin", responses=ERRORS)


@router.get("/config", response_model=AdminConfig)
async def get_config(state: Admin) -> AdminConfig:
    return _config(state)


@router.patch("/config", response_model=AdminConfig)
async def patch_config(patch: AdminConfigPatch, state: Admin) -> AdminConfig:
    if state.engine is None:
        raise unavailable("the model is still loading; retry shortly", "loading")
    try:
        state.engine.set_max_num_seqs(patch.max_num_seqs)
    except InvalidRequestError as error:
        raise invalid(str(error), error.param) from None
    return _config(state)


@router.post("/drain", response_model=DrainStatus, status_code=202)
async def drain(state: Admin) -> DrainStatus:
    state.begin_drain()
    return DrainStatus(draining=True, in_flight=state.in_flight)


@router.get("/steps", response_model=StepRecordsPage)
async def steps(query: Annotated[AdminStepsQuery, Query()], state: Admin) -> Response:
    """The step records after `after`, oldest first: at most `limit` of them and
    MAX_STEP_RECORDS_BYTES of their JSON, whatever the ring holds."""
    if state.engine is None:
        raise unavailable("the model is still loading; retry shortly", "loading")
    engine = state.engine.engine
    ring = engine.step_records
    stored, first, last = ring.after(query.after, query.limit)
    parts, size = [], 0
    for values in stored:
        text = json.dumps(as_record(values), separators=(",", ":"))
        size += len(text) + 1
        if size > MAX_STEP_RECORDS_BYTES and parts:
            break
        parts.append(text)
    next_after = stored[len(parts) - 1][0] if parts else query.after
    missed = max(0, first - 1 - query.after) if first else 0
    head = json.dumps({"next_after": next_after, "first_seq": first, "last_seq": last, "missed": missed,
                       "now": engine.clock(), "capacity": ring.capacity}, separators=(",", ":"))
    # Built by hand, not through the response model: up to a thousand records a call, each read
    # by the operator's own parser, and validating them again here would cost more than the rest.
    return Response(f'{head[:-1]},"records":[{",".join(parts)}]}}', media_type="application/json")


def _config(state: ServerState) -> AdminConfig:
    config = state.engine_config
    stats = state.engine.stats() if state.engine is not None else None
    return AdminConfig(
        model=state.model_name,
        max_num_seqs=stats.max_num_seqs if stats else config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens or 0,
        max_model_len=config.max_model_len or 0,
        block_size=config.block_size,
        num_kv_blocks=stats.num_kv_blocks if stats else 0,
        max_waiting_requests=state.options.max_waiting_requests,
        draining=state.draining,
    )
