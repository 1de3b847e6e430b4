"""The one server-sent-events writer of the OpenAI routes.

In: an async iterator of event objects (completion or chat chunks). Out: a streaming response of
`data: {json}` events ending with `data: [DONE]`, shaped exactly like OpenAI's. An error after the
stream began (the engine failed, the request failed, a later choice was refused) becomes one error
event before [DONE]; a request cut by the drain timeout ends with an error event and no [DONE];
a client that went away gets nothing more. Closing the events at once, not
at garbage collection, aborts the unfinished choices in the engine.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse

from iterserve.engine.server.async_engine import EngineFailed, RequestCut, RequestError
from iterserve.engine.server.errors import APIError, error_body, request_cut, request_error
from iterserve.engine.server.fan_out import ClientDisconnected

HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse_response(events: AsyncIterator[dict], headers: dict[str, str] | None = None) -> StreamingResponse:
    return StreamingResponse(_frames(events), media_type="text/event-stream", headers={**HEADERS, **(headers or {})})


def _frame(event: dict) -> str:
    return f"data: {json.dumps(event, separators=(',', ':'))}\n\n"


async def _frames(events: AsyncIterator[dict]) -> AsyncIterator[str]:
    try:
        async for event in events:
            yield _frame(event)
    except ClientDisconnected:
        return
    except RequestCut as error:  # cut by the drain: no [DONE], which clients read as a whole answer
        cut = request_cut(str(error))
        yield _frame(error_body(cut.message, cut.type, None, cut.code))
        return
    except EngineFailed as error:
        yield _frame(error_body(str(error), "server_error", None, "engine_failed"))
    except RequestError as error:
        failed = request_error(error)
        yield _frame(error_body(failed.message, failed.type, failed.param, failed.code))
    except APIError as error:  # a later choice refused (429 or 503) after the stream began
        yield _frame(error_body(error.message, error.type, error.param, error.code))
    finally:
        await events.aclose()  # at once, not at garbage collection: it aborts an unfinished request
    yield "data: [DONE]\n\n"
