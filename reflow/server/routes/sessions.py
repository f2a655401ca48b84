"""`/v1/sessions`: create (reset), step (idempotent by turn index), extend (a client's pause), get,
delete (idempotent)."""

from __future__ import annotations

import json
from typing import Any, TypeVar

from fastapi import APIRouter, Path, Request, Response
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from reflow.server.routes import errors, json_response, raw_json
from reflow.server.schemas import (
    CreateSession,
    Deleted,
    ExtendRequest,
    SessionBody,
    SessionCreated,
    StepRequest,
    StepResponse,
)
from reflow.server.sessions import SessionManager

router = APIRouter(prefix="/v1/sessions", tags=["sessions"])

SessionId = Path(min_length=1, max_length=64, description="the id POST /v1/sessions returned")
SESSION_LINKS = {
    name: {"operationId": name, "parameters": {"session_id": "$response.body#/session_id"}}
    for name in ("step_session", "extend_session", "get_session", "delete_session")
}
"""OpenAPI links: the session a create returns is what step, get and delete take."""


M = TypeVar("M", bound=BaseModel)


def _manager(request: Request) -> SessionManager:
    return request.app.state.manager


async def read_body(request: Request, model: type[M]) -> M:
    """The body as `model`, validated in one pass from the raw bytes: the step is the hot path, and
    this skips FastAPI's parse-then-validate (the app adds the model to the OpenAPI document)."""
    try:
        return model.model_validate_json(await request.body())
    except ValidationError as e:
        raise RequestValidationError(e.errors(include_url=False, include_context=False)) from None


async def create_text(manager: SessionManager, body: CreateSession) -> str:
    """Create a session; its `SessionCreated` body as JSON text (the observation spliced in as it is)."""
    session, observation = await manager.create(body)
    described = json.dumps(manager.describe(session))
    return f'{described[:-1]}, "observation": {observation}}}'


async def step_text(manager: SessionManager, session_id: str, body: StepRequest) -> str:
    """Play one step; its `StepResponse` body as JSON text. Shared with the WebSocket route (`ws`)."""
    result, replayed = await manager.step(
        session_id, body.turn_index, body.turn.model_dump(), body.turn.to_turn()
    )
    state = manager.sessions[session_id].state if session_id in manager.sessions else "closed"
    head = json.dumps(
        {"session_id": session_id, "turn_index": body.turn_index, "state": state, "replayed": replayed}
    )
    return f'{head[:-1]}, "result": {result}}}'


def deleted(session_id: str, reason: str) -> dict[str, str]:
    return {"session_id": session_id, "state": "closed", "reason": reason}


def body_schema(model: type[BaseModel]) -> dict[str, Any]:
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


@router.post(
    "",
    status_code=201,
    response_model=SessionCreated,
    responses={**errors(404, 410, 422, 429, 500, 503, 504), 201: {"links": SESSION_LINKS}},
    summary="Create a session: make the env and reset it",
    operation_id="create_session",
)
async def create_session(body: CreateSession, request: Request) -> Response:
    return raw_json(await create_text(_manager(request), body), 201)


@router.post(
    "/{session_id}/step",
    response_model=StepResponse,
    openapi_extra=body_schema(StepRequest),
    responses=errors(404, 409, 410, 422),
    summary="Play one assistant turn; a retry with the same turn_index returns the stored result",
    operation_id="step_session",
)
async def step_session(request: Request, session_id: str = SessionId) -> Response:
    return raw_json(await step_text(_manager(request), session_id, await read_body(request, StepRequest)))


@router.post(
    "/{session_id}/extend",
    response_model=SessionBody,
    responses=errors(404, 410, 422),
    summary="Say the client's episode waited this long without using the env: the deadline moves later",
    operation_id="extend_session",
)
async def extend_session(body: ExtendRequest, request: Request, session_id: str = SessionId) -> Response:
    manager = _manager(request)
    return json_response(manager.describe(manager.extend(session_id, body.seconds)))


@router.get(
    "/{session_id}",
    response_model=SessionBody,
    responses=errors(404, 410, 422),
    summary="A session's state",
    operation_id="get_session",
)
async def get_session(request: Request, session_id: str = SessionId) -> Response:
    manager = _manager(request)
    return json_response(manager.describe(manager.lookup(session_id)))


@router.delete(
    "/{session_id}",
    response_model=Deleted,
    responses=errors(404, 422),
    summary="Close a session and release its env (idempotent)",
    operation_id="delete_session",
)
async def delete_session(request: Request, session_id: str = SessionId) -> Response:
    return json_response(deleted(session_id, await _manager(request).delete(session_id)))
