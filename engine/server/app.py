"""The FastAPI application: the OpenAI routes, health, readiness, metrics and admin."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from iterserve import __version__
from iterserve.engine.server import admin, openai_api, tokenize_api
from iterserve.engine.server.errors import BodySizeLimit, install_error_handlers
from iterserve.engine.server.state import ServerState


def build_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loading = asyncio.create_task(state.load())
        try:
            yield
        finally:
            loading.cancel()
            state.close()

    app = FastAPI(title="iterserve", version=__version__, lifespan=lifespan,
                  description="OpenAI-compatible LLM serving with continuous batching.")
    app.state.server = state
    install_error_handlers(app)
    app.add_middleware(BodySizeLimit, max_bytes=state.options.max_request_body_bytes)
    app.include_router(openai_api.router)
    app.include_router(tokenize_api.router)
    app.include_router(admin.router)

    @app.get("/health")
    async def health() -> JSONResponse:
        """Alive: the process answers and the engine loop runs (the model may still be loading).
        503 once the engine loop has died or the model failed to load: the liveness probe then
        restarts the server."""
        failure = state.failure
        if failure is not None:
            return JSONResponse({"status": "failed", "reason": failure}, 503)
        return JSONResponse({"status": "ok"})

    @app.get("/ready")
    async def ready(request: Request) -> JSONResponse:
        """Ready: the model is loaded, the engine is healthy and the server is not draining."""
        if state.ready:
            return JSONResponse({"status": "ready"})
        reason = "draining" if state.draining else "failed" if state.load_error or state.engine else "loading"
        return JSONResponse({"status": reason}, 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    return app
