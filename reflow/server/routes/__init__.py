"""Routes of the env server, one module per resource (sessions, envs, capacity, health), and `ws`: the
session protocol over one WebSocket per client."""

from __future__ import annotations

import json
from typing import Any

from fastapi import Response
from fastapi.responses import JSONResponse

from reflow.server.schemas import ErrorBody

_DESCRIPTIONS = {
    400: "an invalid Content-Length header",
    401: "missing or malformed bearer token",
    403: "wrong token (on create also: a client env kwarg the server does not allow)",
    404: "unknown session or env",
    409: "the step does not fit the session's state or turn index",
    410: "the session was closed (deleted, idle, past its deadline, shut down)",
    413: "request body too large",
    422: "invalid request: a body or path that does not match this document (on create also: a task the "
    "env rejects, or a client env kwarg outside the values the server allows)",
    429: "at capacity: retry after the Retry-After header's seconds",
    500: "the env failed to start",
    503: "the server is shutting down (retry after Retry-After seconds), or the env's infrastructure failed",
    504: "the env did not start within the session deadline",
}
_RETRY_AFTER = {"description": "seconds to wait before retrying", "schema": {"type": "integer"}}
_HEADERS = {
    401: {"WWW-Authenticate": {"required": True, "schema": {"type": "string"}}},
    403: {"WWW-Authenticate": {"description": "set when the token is wrong", "schema": {"type": "string"}}},
    429: {"Retry-After": {**_RETRY_AFTER, "required": True}},
    503: {"Retry-After": _RETRY_AFTER},
}
BODY_ERRORS = (400, 413)
"""What any route can answer before it runs (BodyLimit reads the body's length first)."""
AUTH_ERRORS = (401, 403)
"""What any route behind TokenGate can answer."""


def errors(*codes: int, auth: bool = True) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` for the error statuses a route can answer: `codes`, the body limit's and,
    with `auth`, the token gate's; each with the error body (and the headers it carries)."""
    every = sorted({*BODY_ERRORS, *(AUTH_ERRORS if auth else ()), *codes})
    return {
        code: {"model": ErrorBody, "description": _DESCRIPTIONS[code]}
        | ({"headers": _HEADERS[code]} if code in _HEADERS else {})
        for code in every
    }


def json_response(data: Any, status_code: int = 200) -> Response:
    """A JSON response without a second validation pass (the hot path of a step)."""
    return raw_json(json.dumps(data, default=str), status_code)


def raw_json(text: str, status_code: int = 200) -> Response:
    """JSON text already encoded (stored step results are spliced in as they are)."""
    return Response(text, status_code=status_code, media_type="application/json")


def validation_message(problems: list[Any], prefix: str = "") -> str:
    """Pydantic's errors as one line: `where: what; ...` (the first five)."""
    parts = []
    for err in problems[:5]:
        where = ".".join(str(p) for p in (prefix, *err.get("loc", ())) if p != "") or "body"
        parts.append(f"{where}: {err.get('msg', '')}")
    return "; ".join(parts) or "invalid request"


def error_response(
    status: int, kind: str, code: str, message: str, headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse({"error_kind": kind, "code": code, "message": message}, status, headers=headers)
