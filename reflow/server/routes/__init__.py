"""HTTP routes of the env server, one module per resource (sessions, envs, capacity, health)."""

from __future__ import annotations

import json
from typing import Any

from fastapi import Response
from fastapi.responses import JSONResponse

from reflow.server.schemas import ErrorBody

_DESCRIPTIONS = {
    400: "a body that cannot be read as JSON text",
    401: "missing or malformed bearer token",
    403: "wrong token, or a client env kwarg the server does not allow",
    404: "unknown session or env",
    409: "the step does not fit the session's state or turn index",
    410: "the session was closed (deleted, idle, past its deadline, shut down)",
    413: "request body too large",
    422: "invalid request, or a task the env rejects",
    429: "at capacity: retry after the Retry-After header's seconds",
    500: "the env failed to start",
    503: "the server is shutting down, or the env's infrastructure failed",
    504: "the env did not start within the session deadline",
}


def errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` for these error statuses, each with the error body."""
    return {
        code: {"model": ErrorBody, "description": _DESCRIPTIONS[code]}
        for code in (400, 401, 403, 413, 422, *codes)
    }


def json_response(data: Any, status_code: int = 200) -> Response:
    """A JSON response without a second validation pass (the hot path of a step)."""
    return raw_json(json.dumps(data, default=str), status_code)


def raw_json(text: str, status_code: int = 200) -> Response:
    """JSON text already encoded (stored step results are spliced in as they are)."""
    return Response(text, status_code=status_code, media_type="application/json")


def error_response(
    status: int, kind: str, code: str, message: str, headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse({"error_kind": kind, "code": code, "message": message}, status, headers=headers)
