"""Every error leaves the server as OpenAI's error body, `{"error": {message, type, param, code}}`,
naming the field at fault. Unexpected exceptions are logged here and answered with a generic
500: no stack trace ever reaches a client."""

from __future__ import annotations

import itertools
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(error_body(exc.message, exc.type, exc.param, exc.code), exc.status, headers=exc.headers)


def invalid(message: str, param: str | None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


def overloaded(message: str, retry_after_s: int) -> APIError:
    return APIError(429, message, "rate_limit_error", None, "queue_full", {"Retry-After": str(retry_after_s)})


def request_error(error) -> APIError:
    """The answer to a request that failed on its own (async_engine.RequestError): a 400 naming the field
    where its own input was at fault, else request_failed."""
    if error.param is not None:
        return invalid(str(error), error.param, "request_input_failed")
    return request_failed(str(error))


def request_failed(reason: str) -> APIError:
    """This request failed inside the engine (the server's fault, not the client's); the engine
    and every other request carried on, so a retry is served normally."""
    return APIError(500, f"the request failed in the engine and was stopped; the server carries on: {reason}",
                    "server_error", None, "request_failed")


def unavailable(message: str, code: str) -> APIError:
    return APIError(503, message, "service_unavailable", None, code, {"Retry-After": "1"})


CUT_CODE = "request_cut"


def request_cut(reason: str) -> APIError:
    """The server stopped this request before it finished (the drain timeout passed): a 503, never a
    200 with truncated text, so the router and the client know the answer is incomplete and may retry."""
    return unavailable(f"{reason}; the answer is incomplete: retry the request (another replica serves it)",
                       CUT_CODE)


def _describe_validation_error(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    # A string that is not valid Unicode fails every alternative of a union; say that, not the union.
    first = next((e for e in errors if "not valid Unicode" in str(e.get("msg", ""))), errors[0])
    loc = [str(part) for part in first.get("loc", ()) if part not in ("body", "query")]
    kind = first.get("type", "")
    if kind == "json_invalid":
        return "the request body is not valid JSON", None
    if kind == "missing" and not loc:
        return "the request needs a JSON body", None
    # A union's alternatives add their type names to the path (prompt.str, prompt.list[int]...):
    # the client wants the field, and what the field accepts.
    field_path = list(itertools.takewhile(lambda part: not _is_type_segment(part), loc))
    param = ".".join(field_path) or None
    if param is None:
        return f"the request body must be a JSON object: {first.get('msg', '')}", None
    if kind == "extra_forbidden":
        return f"unknown field {param!r}: remove it (see the API reference for the accepted fields)", param
    if kind == "missing":
        return f"{param} is required", param
    if "not valid Unicode" in str(first.get("msg", "")):
        return f"{param} {first['msg'].removeprefix('Value error, ')}", param
    if len(field_path) < len(loc) and field_path[-1] in _UNION_HINTS:
        return f"{param} must be {_UNION_HINTS[field_path[-1]]}", param
    return f"{param}: {first.get('msg', 'invalid value').removeprefix('Value error, ')}", param


def _is_type_segment(part: str) -> bool:
    return part in _TYPE_NAMES or any(c in part for c in "[]")


_UNION_HINTS = {
    "prompt": "a string, a list of token ids (integers >= 0), or a list of up to 64 strings or of up to 64 "
              "token-id lists",
    "stop": "a string or a list of up to 16 strings",
    "content": 'a string or a list of {"type": "text", "text": ...} parts',
}
_TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict", "none", "function-after", "literal"}


class BodySizeLimit:
    """ASGI middleware: a request body over max_bytes gets 413 before the app parses any of it
    (by its Content-Length, or as soon as a chunked body passes the limit)."""

    def __init__(self, app, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await self._refuse(send, int(length))
            return
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                await self.app(scope, _replay(message, receive), send)
                return
            body += message.get("body", b"")
            if len(body) > self.max_bytes:
                await self._refuse(send, None)
                return
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay({"type": "http.request", "body": bytes(body), "more_body": False}, receive),
                       send)

    async def _refuse(self, send, length: int | None) -> None:
        size = f"{length} bytes" if length is not None else f"over {self.max_bytes} bytes"
        response = JSONResponse(
            error_body(f"the request body is {size}; this server accepts at most {self.max_bytes} bytes "
                       "(--max-request-body)", "invalid_request_error", None, "request_too_large"),
            413, headers={"Connection": "close"})
        await response({"type": "http"}, _never, send)


def _replay(first: dict, receive):
    sent = False

    async def replayed() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return first
        return await receive()

    return replayed


async def _never() -> dict:
    raise RuntimeError("not reached: the response reads no body")


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _describe_validation_error(exc)
        return JSONResponse(error_body(message, "invalid_request_error", param), 400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(exc.detail), kind), exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error serving %s %s", request.method, request.url.path)
        return JSONResponse(error_body("internal server error; see the server log", "server_error"), 500)
