"""OpenEnv's protocol, served beside ours: an unmodified OpenEnv client plays any served env.

Each served env answers under `/openenv/<env id>` (e.g. `http://host:port/openenv/reflow/Calc-v0`, the
`base_url` of `GenericEnvClient`): the `/ws` session protocol (reset/step/state/close, OpenEnv's error
codes, `CAPACITY_REACHED`), `/health`, `/metadata`, `/schema`, `POST /mcp` (JSON-RPC errors only:
tools run inside a session) and `/openapi.json`, a document of its own for these routes (paths relative
to the prefix). OpenEnv's stateless HTTP `/reset`, `/step` and `/state` are left out (its "production"
mode, as OpenEnv's validator reads it from that document): they cannot play a multi-turn episode. The
routes stay out of our OpenAPI document.

A WebSocket is a thin client of the `SessionManager`: each `reset` is a new session of ours (the previous
one is closed), each `step` one of its turns, so the env pool, sandboxes, deadlines, the reaper and the
capacity limit are the same as over HTTP. Auth: the same bearer token, sent as a header when the socket
opens (`GenericEnvClient(base_url, headers={"Authorization": "Bearer ..."})`); without it the handshake
is refused (HTTP 403), before any session exists.

How our shapes map onto OpenEnv's:

| ReFlow                                   | OpenEnv                                                           |
|------------------------------------------|-------------------------------------------------------------------|
| `reset(task, seed)`                      | reset data `{"seed", "episode_id", "task"?, "deadline_s"?}`        |
| an `AssistantTurn`                       | the action `{"content", "tool_calls": [{"name", "arguments"}]}`,  |
|                                          |   or `{"text"}`: raw model text, parsed here (hermes tool calls)   |
| `Observation` / `StepResult.messages`    | observation `messages` (new ones each step), `tools` (at reset)    |
| `info`                                   | observation `info`                                                |
| `reward`, `terminated or truncated`      | `reward` (null at reset), `done`                                  |
| episode status, termination, success     | `metadata` (top level and in the observation, as openenv 0.10)    |
| our errors (kind, code)                  | `VALIDATION_ERROR` (a bad action or reset), `EXECUTION_ERROR`     |
|                                          |   (everything else), `CAPACITY_REACHED` (then the socket closes)   |

Limits, as over HTTP and `/v1/ws` (`reflow.server.sockets`): a frame over the body limit answers
`VALIDATION_ERROR` (over twice the limit it is not read: the socket closes with 1009), one that is not
JSON (or not UTF-8, or nested too deeply) `INVALID_JSON`; an action has at most 64 tool calls (a raw
`text`, at most 64 opening `<tool_call>` tags); past the connection limit a handshake is refused (503),
and an idle socket is closed.
"""

from __future__ import annotations

import contextlib
import json
import secrets
from dataclasses import asdict
from typing import Any

import pydantic_core
from fastapi import APIRouter, Request, WebSocket, WebSocketDisconnect
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from reflow.env import AssistantTurn, ToolCall, parse_assistant
from reflow.server.auth import check_token
from reflow.server.schemas import MAX_TOOL_CALLS, MIN_DEADLINE_S, ApiError, CreateSession
from reflow.server.sockets import WsGate, frame_data, read_frame

router = APIRouter(prefix="/openenv/{namespace}/{name}", include_in_schema=False)
PARSER = "hermes"
OPEN_TAG = "<tool_call>"
OPENENV_HTTP_VERSION = "1.0.0"
"""The OpenEnv HTTP API these routes follow: their OpenAPI `info.version` (OpenEnv's validator reads its
profile, `openenv-http/1.x`, from it)."""
MAX_TEXT_CHARS = 1 << 20
"""Characters of an action's `content` or `text` (the body limit bounds a frame's bytes first)."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ActionToolCall(_Strict):
    name: str = Field(max_length=256, description="a tool of the env (the observation's `tools`)")
    arguments: dict[str, Any] = Field(default_factory=dict)
    id: str | None = Field(None, max_length=128)


class ReflowAction(_Strict):
    """One assistant turn: `content` and `tool_calls`, or the raw model `text` to parse here."""

    content: str = Field("", max_length=MAX_TEXT_CHARS)
    tool_calls: list[ActionToolCall] = Field(default_factory=list, max_length=MAX_TOOL_CALLS)
    text: str | None = Field(
        None, max_length=MAX_TEXT_CHARS, description="raw model output; tool calls in it are parsed here"
    )
    metadata: dict[str, Any] = Field(default_factory=dict)


class ReflowObservation(_Strict):
    messages: list[dict[str, Any]] = Field(description="the new chat messages (OpenAI form)")
    tools: list[dict[str, Any]] = Field(default_factory=list, description="OpenAI tool schemas (at reset)")
    info: dict[str, Any] = Field(default_factory=dict)
    done: bool = False
    reward: float | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)


class ReflowState(BaseModel):
    model_config = ConfigDict(extra="allow")
    episode_id: str | None = None
    step_count: int = 0


class _ResetData(BaseModel):
    model_config = ConfigDict(extra="ignore")  # OpenEnv passes only the kwargs an env accepts
    seed: int | None = None
    episode_id: str | None = Field(None, max_length=255)
    task: dict[str, Any] | None = None
    deadline_s: float | None = Field(None, ge=MIN_DEADLINE_S)


def _env_id(namespace: str, name: str) -> str:
    return f"{namespace}/{name}"


def _served(request: Request, env_id: str) -> None:
    if env_id not in request.app.state.manager.served:
        raise ApiError(404, "agent", "env_not_found", f"no env {env_id!r} here")


@router.get("/health")
async def health(request: Request, namespace: str, name: str) -> dict[str, str]:
    """`status`: healthy, or degraded while the server drains (it takes no new sessions)."""
    _served(request, _env_id(namespace, name))
    return {"status": "degraded" if request.app.state.manager.draining else "healthy"}


@router.get("/metadata")
async def metadata(request: Request, namespace: str, name: str) -> dict[str, Any]:
    """The env's `name` (its id), a `description` naming its tools and turn limit, and `version`."""
    env_id = _env_id(namespace, name)
    _served(request, env_id)
    entry = next((e for e in request.app.state.catalog if e["env_id"] == env_id), {})
    tools = ", ".join(t["function"]["name"] for t in entry.get("tools", [])) or "none"
    return {
        "name": env_id,
        "description": f"ReFlow env {env_id} (tools: {tools}; max turns: {entry.get('max_turns')})",
        "version": "1.0.0",
        "documentation_url": None,
    }


@router.get("/schema")
async def schema(request: Request, namespace: str, name: str) -> dict[str, Any]:
    """JSON schemas of the `action` a `/ws` step sends, the `observation` and the `state`."""
    _served(request, _env_id(namespace, name))
    return {
        "action": ReflowAction.model_json_schema(),
        "observation": ReflowObservation.model_json_schema(),
        "state": ReflowState.model_json_schema(),
    }


@router.post("/mcp")
async def mcp(request: Request, namespace: str, name: str) -> JSONResponse:
    """A JSON-RPC 2.0 error for every request: the env's tools run inside a `/ws` session."""
    _served(request, _env_id(namespace, name))
    try:
        body = pydantic_core.from_json(await request.body() or b"null")  # ValueError when nested too deeply
    except ValueError:
        return _rpc(None, -32700, "Parse error")
    if not isinstance(body, dict) or body.get("jsonrpc") != "2.0" or not isinstance(body.get("method"), str):
        return _rpc(body.get("id") if isinstance(body, dict) else None, -32600, "Invalid Request")
    if body["method"] in ("tools/list", "tools/call"):
        message = "ReFlow env tools run inside a session: send them as tool_calls in a /ws step"
        return _rpc(body.get("id"), -32603, message)
    return _rpc(body.get("id"), -32601, f"Method not found: {body['method']}")


def _rpc(request_id: Any, code: int, message: str) -> JSONResponse:
    return JSONResponse({"jsonrpc": "2.0", "id": request_id, "error": {"code": code, "message": message}})


@router.get("/openapi.json")
async def openapi(request: Request, namespace: str, name: str) -> dict[str, Any]:
    env_id = _env_id(namespace, name)
    _served(request, env_id)
    return openapi_document(env_id)


def openapi_document(env_id: str) -> dict[str, Any]:
    """The OpenAPI document of the HTTP routes under `/openenv/<env id>` (its server; the paths are
    relative to it), read from this module's routes: each route's docstring describes its answer."""
    schemas: dict[str, Any] = {}
    for model in (ReflowAction, ReflowObservation, ReflowState):
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(schema.pop("$defs", {}), **{model.__name__: schema})
    paths: dict[str, Any] = {}
    for route in router.routes:
        path = route.path.removeprefix(router.prefix)
        if not isinstance(route, APIRoute) or path == "/openapi.json":
            continue
        for method in sorted(route.methods):
            paths.setdefault(path, {})[method.lower()] = {
                "operationId": route.name,
                "responses": {"200": {"description": route.endpoint.__doc__ or route.name}},
            }
    properties = {
        key: {"$ref": f"#/components/schemas/Reflow{key.title()}"}
        for key in ("action", "observation", "state")
    }
    paths["/schema"]["get"]["responses"]["200"]["content"] = {
        "application/json": {"schema": {"type": "object", "properties": properties}}
    }
    return {
        "openapi": "3.1.0",
        "info": {
            "title": f"ReFlow env {env_id} (OpenEnv protocol)",
            "version": OPENENV_HTTP_VERSION,
            "description": "Episodes are played over the `/ws` WebSocket (OpenEnv's session protocol: "
            "reset, step, state, close); OpenEnv's stateless /reset, /step and /state are not served.",
        },
        "servers": [{"url": f"/openenv/{env_id}"}],
        "paths": paths,
        "components": {"schemas": schemas},
    }


@router.websocket("/ws")
async def ws(websocket: WebSocket, namespace: str, name: str) -> None:
    app = websocket.app
    token = app.state.settings.token
    if token is not None:
        try:
            check_token(websocket.headers.get("authorization", "").encode(), token.encode())
        except ApiError:
            await websocket.close(code=1008)  # before accept: the handshake answers 403
            return
    gate: WsGate = app.state.ws_gate
    if not await gate.enter(websocket):
        return
    try:
        await websocket.accept()
        session = WsSession(app.state.manager, _env_id(namespace, name), app.state.settings.max_body_bytes)
        await _serve(websocket, gate, session)
    finally:
        gate.leave()


async def _serve(websocket: WebSocket, gate: WsGate, session: WsSession) -> None:
    try:
        refusal = session.refusal()
        if refusal is not None:
            await websocket.send_json(refusal)
            await websocket.close()
            return
        while True:
            message = await gate.receive(websocket)
            if message is None or message["type"] == "websocket.disconnect":
                return
            reply, keep_open = await session.handle(frame_data(message))
            if reply is not None:
                await websocket.send_json(reply)
            if not keep_open:
                await websocket.close()
                return
    except WebSocketDisconnect:
        pass
    finally:
        await session.end()


def _error(code: str, message: str, **extra: Any) -> dict[str, Any]:
    return {"type": "error", "data": {"message": message, "code": code, **extra}}


class WsSession:
    """One OpenEnv connection: its current ReFlow session, turn index and episode id."""

    def __init__(self, manager: Any, env_id: str, max_bytes: int) -> None:
        self.manager, self.env_id, self.max_bytes = manager, env_id, max_bytes
        self.session_id: str | None = None
        self.episode_id: str | None = None
        self.turns = 0

    def refusal(self) -> dict[str, Any] | None:
        """The session-level error that closes the socket at once, if any."""
        if self.env_id not in self.manager.served:
            served = ", ".join(sorted(self.manager.served))
            return _error(
                "FACTORY_ERROR", f"no env {self.env_id!r} here; served: {served}", factory_name=self.env_id
            )
        cap = self.manager.capacity()
        if cap["available"] < 1:
            return self._capacity(cap)
        return None

    def _capacity(self, cap: dict[str, Any]) -> dict[str, Any]:
        active, most = cap["live_sessions"], cap["max_sessions"]
        message = f"Server at capacity: {active}/{most} sessions active. Cannot accept new connections."
        return _error("CAPACITY_REACHED", message, active_sessions=active, max_sessions=most)

    async def handle(self, frame: str | bytes) -> tuple[dict[str, Any] | None, bool]:
        """The reply to one frame and whether the socket stays open."""
        try:
            message = read_frame(frame, self.max_bytes)
        except ApiError as e:  # too large: the model wrote too much; else not JSON
            return _error("VALIDATION_ERROR" if e.status == 413 else "INVALID_JSON", e.message), True
        kind = message.get("type") if isinstance(message, dict) else None
        data = message.get("data") if isinstance(message, dict) else None
        try:
            if kind == "reset":
                return await self.reset(data if isinstance(data, dict) else {}), True
            if kind == "step":
                if not isinstance(data, dict):
                    return _error("VALIDATION_ERROR", "step data must be the action object", errors=[]), True
                return await self.step(data), True
            if kind == "state":
                return {"type": "state", "data": self.state()}, True
            if kind == "close":
                return None, False
            if kind == "mcp":
                return _error("EXECUTION_ERROR", "MCP is not served: tools run as tool_calls in a step"), True
        except ValidationError as e:
            errors = json.loads(e.json(include_url=False))
            return _error(
                "VALIDATION_ERROR", f"Invalid message: {e.error_count()} error(s)", errors=errors
            ), True
        except ApiError as e:
            if e.status == 429:
                return self._capacity(self.manager.capacity()), False
            code = (
                "VALIDATION_ERROR" if e.kind == "agent" and e.status in (404, 409, 422) else "EXECUTION_ERROR"
            )
            return _error(code, e.message, error_kind=e.kind, reflow_code=e.code), True
        return _error("UNKNOWN_TYPE", f"Unknown message type: {kind!r}"), True

    async def reset(self, data: dict[str, Any]) -> dict[str, Any]:
        args = _ResetData.model_validate(data)
        await self.end()
        req = CreateSession(env_id=self.env_id, task=args.task, seed=args.seed, deadline_s=args.deadline_s)
        session, obs_json = await self.manager.create(req)
        self.session_id, self.turns = session.id, 0
        self.episode_id = args.episode_id or secrets.token_hex(8)
        obs = json.loads(obs_json)
        return _observation(obs["messages"], obs["tools"], obs["info"], None, False, {})

    async def step(self, data: dict[str, Any]) -> dict[str, Any]:
        action = ReflowAction.model_validate(data)
        if self.session_id is None:
            raise ApiError(409, "agent", "reset_needed", "step before reset: send a reset first")
        turn = self._turn(action)
        body, _ = await self.manager.step(self.session_id, self.turns, asdict(turn), turn)
        self.turns += 1
        result = json.loads(body)
        done = bool(result["terminated"] or result["truncated"])
        info = result["info"]
        meta = {"status": info.get("status", "ok"), "termination": info.get("termination")} if done else {}
        if done:
            meta["success"] = bool(info.get("success", False))
            self.session_id = None  # the manager released its env already
        return _observation(result["messages"], [], info, float(result["reward"]), done, meta)

    def _turn(self, action: ReflowAction) -> AssistantTurn:
        if action.text is not None:
            # Every call the parser finds opens with a tag: counting them (linear, in C) bounds the
            # calls before the parse, which costs far more per call.
            if action.text.count(OPEN_TAG) > MAX_TOOL_CALLS:
                raise ApiError(
                    422, "agent", "too_many_tool_calls", f"a turn has at most {MAX_TOOL_CALLS} tool calls"
                )
            s = self.manager.sessions.get(self.session_id)
            tools = s.env.unwrapped.tools if s is not None and s.env is not None else None
            return parse_assistant(action.text, parser=PARSER, tools=tools)
        calls = [
            ToolCall(
                c.name,
                c.arguments,
                json.dumps({"name": c.name, "arguments": c.arguments}),
                c.id or f"call_{i}",
            )
            for i, c in enumerate(action.tool_calls)
        ]
        return AssistantTurn(action.content, calls)

    def state(self) -> dict[str, Any]:
        return {"episode_id": self.episode_id, "step_count": self.turns, "env_id": self.env_id}

    async def end(self) -> None:
        session_id, self.session_id = self.session_id, None
        if session_id is not None:
            with contextlib.suppress(ApiError):
                await self.manager.delete(session_id)


def _observation(
    messages: list[Any],
    tools: list[Any],
    info: dict[str, Any],
    reward: float | None,
    done: bool,
    meta: dict[str, Any],
) -> dict[str, Any]:
    obs = {"messages": messages, "tools": tools, "info": info, "metadata": meta}
    envelope: dict[str, Any] = {"observation": obs, "reward": reward, "done": done}
    if meta:
        envelope["metadata"] = meta
    return {"type": "observation", "data": envelope}
