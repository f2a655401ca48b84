"""`OpenEnvEnv`: an unmodified OpenEnv server played as a ReFlow env, over its `/ws` session protocol.

`reflow.make("openenv/echo", url="http://host:8000")`, the same as `reflow.make("reflow/OpenEnv-v0",
url=..., name="echo")` (the `openenv/` id namespace, `reflow.env.registration`). Each `reset` opens one
WebSocket (one server-side env instance: OpenEnv's HTTP `/reset` and `/step` are stateless and never
used) and the episode's end closes it, so a server with `max_concurrent_envs=N` plays N episodes at once;
more wait for a free slot (`CAPACITY_REACHED` is retried for `capacity_wait_s`).

How OpenEnv's shapes map onto ours:

| OpenEnv                                             | ReFlow                                                   |
|-----------------------------------------------------|----------------------------------------------------------|
| `GET /schema` action JSON Schema                    | one tool, `act`, whose parameters are the action fields   |
| MCP env (action `CallToolAction`/`Action`):          | the env's own tools (`{"type": "list_tools"}` at reset); |
|   `list_tools` / `call_tool`                        |   a call is `{"type": "call_tool", tool_name, arguments}`;|
|                                                     |   its text: the error, else `result` (`data`, or content) |
| reset observation                                   | one user message (text, see below); `info["openenv"]`     |
| step observation                                    | a tool message answering the call (a user message when    |
|                                                     |   the turn was plain text)                                |
| observation as text                                 | `observation_field` if set, the only field if there is   |
|                                                     |   one, else the fields (no `metadata`) as JSON            |
| plain-text turn, action with one required str field | the action `{field: content}`                             |
| `reward` (null: 0.0), per step                      | `StepResult.reward`, per step (the episode sums them)     |
| `done`                                              | `terminated`; `success` = metadata `success`, else        |
|                                                     |   the final step's reward > 0                             |
| `metadata` (top level, or in the observation)       | `info["openenv_metadata"]`                                |
| reset `seed`, extra reset kwargs                    | the task: `{"id", "seed", "reset_kwargs"}`; `pick_task`   |
|                                                     |   makes `{"seed": seed}`                                  |

Failures: a refused or dropped connection, a socket that dies mid-episode, a server that stays at
capacity, an unknown frame or an `INVALID_JSON`/`UNKNOWN_TYPE`/`SESSION_ERROR`/`FACTORY_ERROR` error are
`InfraError` (the episode is `infra_error`, masked in training, never scored 0); `EXECUTION_ERROR` (the
env raised) is `EnvError`; `VALIDATION_ERROR` (the model's action did not fit the schema) goes back to
the model as a failed tool result and the episode goes on.

This module needs `websockets` and httpx (the `interop` extra), not openenv.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
import uuid
from dataclasses import asdict
from typing import Any

import httpx
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidURI

from reflow.env import (
    AssistantTurn,
    Env,
    EnvError,
    InfraError,
    Message,
    Observation,
    ResetNeeded,
    SchemaTool,
    StepResult,
    Task,
    ToolCall,
    ToolResult,
)

ACT_TOOL = "act"
MCP_ACTION_TITLES = frozenset({"Action", "CallToolAction", "ListToolsAction"})
INFRA_CODES = frozenset({"INVALID_JSON", "UNKNOWN_TYPE", "SESSION_ERROR", "FACTORY_ERROR"})
_SCHEMAS: dict[str, dict[str, Any]] = {}  # per server URL: a server's schema does not change while it runs


def action_parameters(action_schema: dict[str, Any]) -> dict[str, Any]:
    """The action's JSON Schema as tool parameters: `metadata` (OpenEnv's own) left out, `$defs` kept."""
    params = {k: v for k, v in action_schema.items() if k not in ("title", "description")}
    params["properties"] = {k: v for k, v in action_schema.get("properties", {}).items() if k != "metadata"}
    params["required"] = [k for k in action_schema.get("required", []) if k != "metadata"]
    params.setdefault("type", "object")
    return params


def text_field(action_schema: dict[str, Any]) -> str | None:
    """The action's one required string field, if that is its only required field (plain text maps to it)."""
    required = [k for k in action_schema.get("required", []) if k != "metadata"]
    props = action_schema.get("properties", {})
    if len(required) == 1 and props.get(required[0], {}).get("type") == "string":
        return required[0]
    return None


def observation_text(observation: dict[str, Any], field: str | None = None) -> str:
    """An OpenEnv observation as the text the model reads (see the module's table)."""
    fields = {k: v for k, v in observation.items() if k not in ("metadata", "reward", "done")}
    if field is not None:
        value = fields.get(field, "")
    elif len(fields) == 1:
        (value,) = fields.values()
    else:
        value = fields
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)


def tool_result_text(observation: dict[str, Any]) -> str:
    """An MCP `call_tool` observation as the tool's text: its error, else its result (FastMCP's `data`,
    else the text of its content blocks)."""
    error = observation.get("error")
    if isinstance(error, dict):
        return f"error ({error.get('error_type', 'error')}): {error.get('message', '')}"
    result = observation.get("result")
    if isinstance(result, dict):
        if result.get("data") is not None:
            result = result["data"]
        elif isinstance(result.get("content"), list):
            result = "\n".join(str(c.get("text", "")) for c in result["content"] if isinstance(c, dict))
    return result if isinstance(result, str) else json.dumps(result, sort_keys=True, default=str)


class OpenEnvEnv(Env):
    metadata = {"remote": True}  # noqa: RUF012  (Env's convention)

    def __init__(
        self,
        url: str | None = None,
        name: str | None = None,
        *,
        token: str | None = None,
        reset_kwargs: dict[str, Any] | None = None,
        observation_field: str | None = None,
        connect_timeout_s: float = 10.0,
        message_timeout_s: float = 60.0,
        capacity_wait_s: float = 60.0,
        tasks: list[Task] | str | None = None,
    ) -> None:
        """`url`: the server's HTTP base URL; `name` names the env in records (`openenv/<name>`);
        `token`: a bearer token sent on every request; `reset_kwargs`: extra kwargs of every reset."""
        super().__init__(tasks)
        self.url = (url or "").rstrip("/")
        self.name = name
        self.spec_id = f"openenv/{name}" if name else None  # records name the served env
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.reset_kwargs = dict(reset_kwargs or {})
        self.observation_field = observation_field
        self.connect_timeout_s, self.message_timeout_s = connect_timeout_s, message_timeout_s
        self.capacity_wait_s = capacity_wait_s
        self.mcp = False
        self.text_field: str | None = None
        self.episode_id: str | None = None
        self.done = False
        self._ws: ClientConnection | None = None

    # ---- tasks: a seed and reset kwargs ------------------------------------------------------------
    def pick_task(self, seed: int | None) -> Task:
        if self.tasks:
            return super().pick_task(seed)
        seed = seed if seed is not None else random.randrange(2**31)
        return {"id": f"seed-{seed}", "seed": seed}

    def generate_task(self, rng: random.Random) -> Task:
        seed = rng.randrange(2**31)
        return {"id": f"seed-{seed}", "seed": seed}

    # ---- the API -----------------------------------------------------------------------------------
    async def _reset(self, task: Task) -> Observation:
        if not self.url:
            raise ValueError("OpenEnvEnv needs url= (the OpenEnv server's base URL)")
        await self._disconnect()
        schema = await self._schema()
        action = schema.get("action", {})
        self.mcp = action.get("title") in MCP_ACTION_TITLES
        self.text_field = None if self.mcp else text_field(action)
        self.episode_id = uuid.uuid4().hex
        data: dict[str, Any] = {**self.reset_kwargs, **task.get("reset_kwargs", {})}
        data["episode_id"] = self.episode_id
        if task.get("seed") is not None:
            data["seed"] = task["seed"]
        payload = await self._open({"type": "reset", "data": data})
        self.done = bool(payload.get("done"))
        if self.mcp:
            listed = await self._call({"type": "step", "data": {"type": "list_tools"}})
            self.tools = [
                SchemaTool(t["name"], t.get("description") or "", t.get("input_schema") or {"type": "object"})
                for t in listed.get("observation", {}).get("tools", [])
            ]
        else:
            desc = action.get("description") or f"Take one action in the {self.name or 'OpenEnv'} env."
            self.tools = [SchemaTool(ACT_TOOL, desc, action_parameters(action))]
        info = {"openenv": {"url": self.url, "episode_id": self.episode_id}}
        info["openenv_metadata"] = _metadata(payload)
        text = observation_text(payload.get("observation", {}), self.observation_field)
        return Observation([{"role": "user", "content": text}], info=info)

    async def step(self, turn: AssistantTurn) -> StepResult:
        if self._ws is None or self.done:
            raise ResetNeeded(f"step() on {self!r} needs a live episode; call reset() first")
        calls = turn.tool_calls
        if not calls:
            if self.text_field is None:
                hint = f"Act by calling one of the tools: {', '.join(t.name for t in self.tools)}."
                return StepResult([{"role": "user", "content": hint}])
            return await self._act({self.text_field: turn.content}, None)
        call, extra = calls[0], calls[1:]
        skipped = [_tool_message(c, "error: one action per turn; this call was not run") for c in extra]
        if call.parse_error is not None:
            result = StepResult([_tool_message(call, f"error: {call.parse_error}"), *skipped])
            result.info["tool_results"] = [asdict(ToolResult(call.id, call.name, call.parse_error, ok=False))]
            return result
        if self.mcp:
            action = {"type": "call_tool", "tool_name": call.name, "arguments": call.arguments}
        else:
            action = dict(call.arguments)
        result = await self._act(action, call)
        result.messages += skipped
        return result

    async def close(self) -> None:
        await self._disconnect()

    def __repr__(self) -> str:
        return f"<OpenEnvEnv {self.name or '?'} at {self.url}>"

    # ---- one action ----------------------------------------------------------------------------------
    async def _act(self, action: dict[str, Any], call: ToolCall | None) -> StepResult:
        start = time.monotonic()
        try:
            payload = await self._call({"type": "step", "data": action})
        except _ValidationError as e:  # the model's action does not fit the schema: its turn, its error
            text = f"error: the action was rejected: {e}"
            message = _tool_message(call, text) if call else {"role": "user", "content": text}
            tool_result = ToolResult(call.id if call else "text", call.name if call else None, text, ok=False)
            return StepResult([message], info={"tool_results": [asdict(tool_result)]})
        observation = payload.get("observation", {})
        if self.mcp and self.observation_field is None:
            text = tool_result_text(observation)
        else:
            text = observation_text(observation, self.observation_field)
        reward = float(payload.get("reward") or 0.0)
        metadata = _metadata(payload)
        info: dict[str, Any] = {"openenv_metadata": metadata}
        if call is not None:
            info["tool_results"] = [
                asdict(ToolResult(call.id, call.name, text, latency_s=time.monotonic() - start))
            ]
        message = _tool_message(call, text) if call else {"role": "user", "content": text}
        if not payload.get("done"):
            return StepResult([message], reward=reward, info=info)
        self.done = True
        await self._disconnect()  # frees the server's slot for the next episode
        success = bool(metadata.get("success", reward > 0))
        info.update(success=success, reward_components={"openenv": reward}, termination="env_done")
        return StepResult([message], reward=reward, terminated=True, info=info)

    # ---- the wire ------------------------------------------------------------------------------------
    def _ws_url(self) -> str:
        base = self.url
        for http, ws in (("https://", "wss://"), ("http://", "ws://")):
            if base.startswith(http):
                base = ws + base[len(http) :]
        return base + "/ws"

    async def _schema(self) -> dict[str, Any]:
        if self.url not in _SCHEMAS:
            try:
                async with httpx.AsyncClient(headers=self.headers, timeout=self.connect_timeout_s) as client:
                    response = await client.get(f"{self.url}/schema")
                response.raise_for_status()
                _SCHEMAS[self.url] = response.json()
            except (httpx.HTTPError, ValueError) as e:
                raise InfraError(f"{self!r}: GET /schema failed: {type(e).__name__}: {e}") from e
        return _SCHEMAS[self.url]

    async def _open(self, reset: dict[str, Any]) -> dict[str, Any]:
        """Open a session and reset it; a server at capacity (it accepts the socket, sends
        CAPACITY_REACHED and closes it) is tried again with backoff for `capacity_wait_s`."""
        give_up = time.monotonic() + self.capacity_wait_s
        wait = 0.05
        while True:
            try:
                self._ws = await connect(
                    self._ws_url(),
                    additional_headers=self.headers,
                    open_timeout=self.connect_timeout_s,
                    max_size=100 * 2**20,
                    proxy=None,
                )
            except (OSError, TimeoutError, InvalidHandshake, InvalidURI) as e:
                raise InfraError(f"{self!r}: cannot open {self._ws_url()}: {type(e).__name__}: {e}") from e
            try:
                return await self._call(reset)
            except _AtCapacity as e:
                await self._disconnect()
                if time.monotonic() > give_up:
                    raise InfraError(f"{self!r}: the server stayed at capacity: {e}") from None
            await asyncio.sleep(wait * random.uniform(0.8, 1.2))
            wait = min(wait * 2, 1.0)

    async def _call(self, message: dict[str, Any]) -> dict[str, Any]:
        """Send one message and read its answer (OpenEnv pairs them strictly on one socket)."""
        if self._ws is None:
            raise InfraError(f"{self!r}: no session")
        ws = self._ws
        try:
            with contextlib.suppress(ConnectionClosed):  # a refusal may already be waiting: read it
                await ws.send(json.dumps(message))
            frame = await asyncio.wait_for(ws.recv(), self.message_timeout_s)
        except (ConnectionClosed, OSError) as e:
            self._ws = None
            raise InfraError(
                f"{self!r}: the connection to the server was lost: {type(e).__name__}: {e}"
            ) from e
        except TimeoutError as e:
            await self._disconnect()  # a late answer would pair with the next request
            raise InfraError(f"{self!r}: no answer in {self.message_timeout_s}s to {message['type']}") from e
        reply = _parse(frame)
        data = reply.get("data")
        if reply.get("type") == "error" and isinstance(data, dict):
            code, text = data.get("code"), data.get("message", "")
            if code == "VALIDATION_ERROR":
                raise _ValidationError(text)
            if code == "CAPACITY_REACHED":
                raise _AtCapacity(text)
            if code == "EXECUTION_ERROR":
                raise EnvError(f"{self!r}: the OpenEnv env raised: {text}")
            raise InfraError(f"{self!r}: server error {code}: {text}")
        if reply.get("type") not in ("observation", "state") or not isinstance(data, dict):
            raise InfraError(f"{self!r}: unexpected frame: {str(frame)[:300]}")
        return data

    async def _disconnect(self) -> None:
        ws, self._ws = self._ws, None
        if ws is not None:
            with contextlib.suppress(ConnectionClosed, OSError):
                await ws.send(json.dumps({"type": "close"}))
            await _quiet_close(ws)


class _ValidationError(Exception):
    pass


class _AtCapacity(InfraError):
    pass


def _parse(frame: str | bytes) -> dict[str, Any]:
    try:
        reply = json.loads(frame)
    except ValueError as e:
        raise InfraError(f"the OpenEnv server sent invalid JSON: {str(frame)[:300]}") from e
    if not isinstance(reply, dict):
        raise InfraError(f"the OpenEnv server sent a non-object frame: {str(frame)[:300]}")
    return reply


def _metadata(payload: dict[str, Any]) -> dict[str, Any]:
    """Top-level `metadata` (openenv 0.10) or the observation's own (what 0.3 servers leave)."""
    meta = payload.get("metadata") or payload.get("observation", {}).get("metadata") or {}
    return meta if isinstance(meta, dict) else {}


def _tool_message(call: ToolCall | None, content: str) -> Message:
    return {
        "role": "tool",
        "tool_call_id": call.id if call else "",
        "name": call.name if call else "",
        "content": content,
    }


async def _quiet_close(ws: ClientConnection) -> None:
    with contextlib.suppress(Exception):
        await asyncio.wait_for(ws.close(), timeout=2.0)
