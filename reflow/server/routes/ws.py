"""`/v1/ws`: the session protocol over one WebSocket, one JSON text frame each way per request.

The HTTP routes stay the reference (the OpenAPI document describes them); this route carries the same
requests and answers without HTTP's per-request cost (headers, routing, middleware), which is most of
a step's CPU on both ends. `RemoteEnv` uses it by default and keeps one socket for all its episodes.

- Handshake: `GET /v1/ws` with `Authorization: Bearer <token>` (when the server has one). A missing or
  wrong token is refused before the socket opens, with the HTTP route's answer (401 / 403 and its JSON
  error body).
- Request frame: `{"id": ID, "op": OP, "session_id": S, "body": B}`, `ID` an integer or string the
  answer echoes. `OP` is one of
  `create` (B: `CreateSession`; answers 201 and `SessionCreated`, as `POST /v1/sessions`),
  `step` (S and B: `StepRequest`; answers `StepResponse`, as `POST /v1/sessions/S/step`),
  `extend` (S and B: `ExtendRequest`; as `POST /v1/sessions/S/extend`),
  `get` (S; as `GET /v1/sessions/S`) and `delete` (S; as `DELETE /v1/sessions/S`).
- Answer frame: `{"id": ID, "status": HTTP_STATUS, "body": BODY}` and, where HTTP sends one, `"headers":
  {"Retry-After": "1"}`. `BODY` is what the HTTP route answers, errors included (`{error_kind, code,
  message}` with the same codes). A frame that is not JSON answers 400 `bad_request` (id null), one
  that does not fit the protocol 422 `invalid_request`, one over the body limit 413 `body_too_large`;
  the socket stays open after any of them. A frame over twice the body limit is not read: the socket
  closes with 1009.
- Limits shared with OpenEnv's protocol (`reflow.server.sockets`): past the server's connection limit a
  handshake is refused (503, Retry-After); a socket that sends no frame for `ws_idle_timeout_s` is
  closed (1000).
- Frames of one socket are answered one at a time, in order. A session is not tied to its socket: a
  client that loses the socket reconnects and retries the step with the same turn index (answered from
  the store), and a session whose socket is gone is closed by the reaper like any idle one.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import APIRouter, WebSocket, WebSocketDisconnect
from pydantic import ValidationError

from reflow.server.auth import check_token
from reflow.server.routes import validation_message
from reflow.server.routes.sessions import create_text, deleted, step_text
from reflow.server.schemas import ApiError, CreateSession, ExtendRequest, StepRequest
from reflow.server.sessions import SessionManager
from reflow.server.sockets import WsGate, deny, frame_data, read_frame

log = logging.getLogger(__name__)
router = APIRouter()
PATH = "/v1/ws"
OPS = ("create", "step", "extend", "get", "delete")


@router.websocket(PATH)
async def session_socket(websocket: WebSocket) -> None:
    settings = websocket.app.state.settings
    if settings.token is not None:
        try:
            check_token(websocket.headers.get("authorization", "").encode(), settings.token.encode())
        except ApiError as e:
            await deny(websocket, e)
            return
    gate: WsGate = websocket.app.state.ws_gate
    if not await gate.enter(websocket):
        return
    try:
        await websocket.accept()
        await _serve(websocket, gate, websocket.app.state.manager, settings.max_body_bytes)
    finally:
        gate.leave()


async def _serve(websocket: WebSocket, gate: WsGate, manager: SessionManager, max_bytes: int) -> None:
    while True:
        message = await gate.receive(websocket)
        if message is None or message["type"] == "websocket.disconnect":
            return
        reply = await answer(manager, frame_data(message), max_bytes)
        try:
            await websocket.send_text(reply)
        except (WebSocketDisconnect, OSError):  # gone mid-step: the step is stored for the retry
            return


async def answer(manager: SessionManager, frame: str | bytes, max_bytes: int) -> str:
    """The answer frame to one request frame (never raises: every failure is an error answer)."""
    try:
        request = read_frame(frame, max_bytes)
    except ApiError as e:  # over the limit, or not JSON
        return _error(None, e)
    request_id = request.get("id") if isinstance(request, dict) else None
    if isinstance(request_id, bool) or not isinstance(request_id, (int, str, type(None))):
        request_id = None
    try:
        status, body = await _run(manager, request)
    except ApiError as e:
        return _error(request_id, e)
    except ValidationError as e:
        message = validation_message(e.errors(include_url=False, include_context=False), "body")
        return _error(request_id, ApiError(422, "agent", "invalid_request", message))
    except Exception as e:
        log.exception("the WebSocket request %r failed", request_id)
        return _error(
            request_id, ApiError(500, "infra", "internal_error", f"the server failed: {type(e).__name__}")
        )
    return _frame(request_id, status, body)


async def _run(manager: SessionManager, request: Any) -> tuple[int, str]:
    """Status and body (JSON text) of one request, as the HTTP route answers it."""
    if not isinstance(request, dict):
        raise _invalid("a frame must be a JSON object: {id, op, session_id?, body?}")
    op = request.get("op")
    if op == "create":
        return 201, await create_text(manager, CreateSession.model_validate(_body(request)))
    if op not in OPS:
        raise _invalid(f"op must be one of {', '.join(OPS)}; got {op!r}")
    session_id = request.get("session_id")
    if not isinstance(session_id, str) or not 1 <= len(session_id) <= 64:
        raise _invalid(f"{op} needs session_id: the id create returned")
    if op == "step":
        return 200, await step_text(manager, session_id, StepRequest.model_validate(_body(request)))
    if op == "extend":
        seconds = ExtendRequest.model_validate(_body(request)).seconds
        return 200, json.dumps(manager.describe(manager.extend(session_id, seconds)))
    if op == "get":
        return 200, json.dumps(manager.describe(manager.lookup(session_id)))
    return 200, json.dumps(deleted(session_id, await manager.delete(session_id)))


def _body(request: dict[str, Any]) -> dict[str, Any]:
    body = request.get("body")
    if not isinstance(body, dict):
        raise _invalid(f"{request['op']} needs body: a JSON object")
    return body


def _invalid(message: str) -> ApiError:
    return ApiError(422, "agent", "invalid_request", message)


def _frame(
    request_id: int | str | None, status: int, body: str, headers: dict[str, str] | None = None
) -> str:
    extra = f', "headers": {json.dumps(headers)}' if headers else ""
    return f'{{"id": {json.dumps(request_id)}, "status": {status}, "body": {body}{extra}}}'


def _error(request_id: int | str | None, e: ApiError) -> str:
    return _frame(request_id, e.status, json.dumps(e.body()), e.headers)
