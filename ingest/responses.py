"""Responses the gateway's routes share: errors in the OpenAI shape and fast JSON bodies."""

from __future__ import annotations

import json
from typing import Any

import orjson
from starlette.responses import JSONResponse

from ingest.shaping import HEADER_REQUEST_ID

_ERROR_TYPES = {
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    413: "BadRequestError",
    429: "RateLimitError",
}


def error(
    status: int, message: str, request_id: str | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    """An error in the OpenAI shape, so OpenAI clients raise it with the message."""
    kind = _ERROR_TYPES.get(status, "BadRequestError" if status < 500 else "UpstreamError")
    headers = dict(headers or {})
    if request_id:
        headers[HEADER_REQUEST_ID] = request_id
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": None, "code": status}},
        status_code=status,
        headers=headers,
    )


class FastJSONResponse(JSONResponse):
    """A JSON response rendered by orjson (a completion's body in about 1/20 of the stdlib's time;
    a NaN becomes null instead of an error)."""

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


def why_not_json(raw: bytes) -> str:
    """Why orjson refused a request body, in words that do not depend on orjson's version: the
    stdlib (on this error path only) tells nesting too deep (orjson stops at 1,024 levels) from
    the rest."""
    try:
        json.loads(raw)
    except RecursionError:
        return "request body is nested too deeply"
    except ValueError:
        pass
    return "request body is not valid JSON"
