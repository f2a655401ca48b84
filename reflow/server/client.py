"""`RemoteEnv`: an env served by `reflow serve-envs`, used like any local env.

`reflow.make("reflow/Remote-v0", url=..., env_id="reflow/Calc-v0")` gives it the standard wrappers, so
it plays in `play_episode` and the episode runner unchanged. Each `reset` is a new server session.

- Transport (`transports`): one WebSocket (`/v1/ws`) for all the env's requests by default, falling
  back to HTTP when the server has no such route or `websockets` is not installed; `transport="http"`
  asks for HTTP. The requests and answers are the same either way.
- Tool calls are parsed here (`parse_assistant` with this env's `tools`, which carry the server's
  schemas and check names and required arguments) and the parsed turn is sent; the server checks
  every call again against its own tools and never re-parses `raw_text`.
- Retries: a step is retried when its request did not arrive or its answer was lost, and on 429 and
  503, with the same turn index, which the server answers from its store if the step already ran, so
  nothing runs twice. A session create is retried only when the request surely did not arrive
  (connect errors) or was refused (429, 503).
- Pauses: an episode whose generation waits out a train step (sync mode's partial rollouts, a lent
  engine) does not use its env meanwhile. The episode runner reports those seconds (`extend_session`:
  the server moves the session's deadline, as `EpisodeDeadline` moves the local one) and, while a
  generation runs, keeps the session from the idle reaper every `keepalive_s`.
- When the server stays unreachable, `InfraError` (ContainErrors and the episode runner mark the
  episode infra_error); a session closed for its deadline ends the episode as "timeout".
- A token that would travel over plain `http://` to a host off loopback gets a warning, once per host.
- The scripted policy (`demo`), `pick_task` and `generate_task` use a local copy of the env when the
  same id is registered here; a seeded task the local copy picks is used only if its hash matches.

This module needs httpx (and websockets for the WebSocket), not FastAPI or uvicorn.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import warnings
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from reflow.env import (
    AssistantTurn,
    Env,
    InfraError,
    Message,
    Observation,
    ResetNeeded,
    SchemaTool,
    StepResult,
    Task,
    task_hash,
)
from reflow.server.settings import is_loopback
from reflow.server.transports import (
    Answer,
    HttpTransport,
    Lost,
    NoWsRoute,
    ServerError,
    Unsent,
    WsTransport,
    route,
    websockets_installed,
)

__all__ = ["TOKEN_ENV_VAR", "TRANSPORTS", "URL_ENV_VAR", "RemoteEnv", "ServerError"]
log = logging.getLogger(__name__)

URL_ENV_VAR = "REFLOW_ENV_SERVER_URL"
TOKEN_ENV_VAR = "REFLOW_SERVER_TOKEN"
TRANSPORTS = ("auto", "ws", "http")
KEEPALIVE_S = 30.0
"""How often a running generation reports to the server by default (well inside its deadline grace,
`reflow.server.sessions.DEADLINE_GRACE_S`, and its idle timeouts)."""
_warned_hosts: set[str] = set()


def warn_cleartext_token(url: str) -> None:
    """Warn (once per host) that a token sent to `url` would cross the network unencrypted."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if parts.scheme != "http" or is_loopback(host) or host in _warned_hosts:
        return
    _warned_hosts.add(host)
    warnings.warn(
        f"RemoteEnv sends its token to {host} over plain http://, readable on the way; use https:// "
        "(a TLS proxy in front of the server, or serve-envs --ssl-certfile)",
        stacklevel=3,
    )


class RemoteEnv(Env):
    metadata = {"remote": True}  # noqa: RUF012  (Env's convention)

    def __init__(
        self,
        url: str | None = None,
        env_id: str | None = None,
        *,
        token: str | None = None,
        token_file: str | None = None,
        env_kwargs: dict[str, Any] | None = None,
        session_deadline_s: float | None = None,
        request_timeout_s: float = 120.0,
        keepalive_s: float | None = KEEPALIVE_S,
        retries: int = 5,
        backoff_s: float = 0.1,
        transport: str = "auto",
        tasks: Any = None,
    ) -> None:
        """`url` (else $REFLOW_ENV_SERVER_URL) and `env_id` say what to play; the token comes from
        `token`, `token_file` or $REFLOW_SERVER_TOKEN. `session_deadline_s` asks the server for a
        session deadline (sandbox start included); `keepalive_s`: while one generation runs, tell the
        server this often (at most; a third of its idle timeout when that is less) that the session is
        in use and how long it was paused (None: never); `retries` bounds the retries of one request;
        `transport` is "auto" (the WebSocket where the server has it, else HTTP), "ws" or "http"."""
        super().__init__(None)
        if tasks is not None:
            raise ValueError("a remote env takes tasks on reset(task=...), not a tasks file")
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}; got {transport!r}")
        if transport == "ws" and not websockets_installed():
            raise ImportError("RemoteEnv(transport='ws') needs websockets (pip install websockets)")
        self.url = (url or os.environ.get(URL_ENV_VAR, "")).rstrip("/")
        self.remote_id = env_id
        self.spec_id = env_id  # records name the served env (reflow/Calc-v0), not the proxy
        if token is None and token_file is not None:
            token = Path(token_file).read_text(encoding="utf-8").strip()
        self.token = token if token is not None else os.environ.get(TOKEN_ENV_VAR) or None
        if self.token:
            warn_cleartext_token(self.url)
        self.env_kwargs = dict(env_kwargs or {})
        self.session_deadline_s = session_deadline_s
        self.request_timeout_s, self.retries, self.backoff_s = request_timeout_s, retries, backoff_s
        if keepalive_s is not None and keepalive_s <= 0:
            raise ValueError(f"keepalive_s must be > 0 or None, got {keepalive_s}")
        self.keepalive_limit_s = keepalive_s
        self.keepalive_s = keepalive_s
        """This session's: `keepalive_s`, or a third of the server's idle timeout when that is less."""
        self.transport_kind = transport
        self.transport: HttpTransport | WsTransport | None = None
        self.session_id: str | None = None
        self.turn_index = 0
        self.done = False
        self._local_env: Env | None = None

    # ---- the API -------------------------------------------------------------------------------------
    async def reset(self, *, task: Task | None = None, seed: int | None = None) -> Observation:
        if not self.url or not self.remote_id:
            raise ValueError("RemoteEnv needs url= (or $REFLOW_ENV_SERVER_URL) and env_id=")
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"RemoteEnv's url must start with http:// or https://; got {self.url!r}")
        await self._delete_session()
        self.rng = random.Random(seed)
        body: dict[str, Any] = {"env_id": self.remote_id, "task": task, "seed": seed}
        if self.session_deadline_s is not None:
            body["deadline_s"] = self.session_deadline_s
        if self.env_kwargs:
            body["env_kwargs"] = self.env_kwargs
        data = await self._request("create", None, body, idempotent=False)
        self.session_id, self.turn_index, self.done = data["session_id"], 0, False
        idle = data.get("idle_timeout_s")
        if self.keepalive_limit_s is not None and isinstance(idle, int | float) and idle > 0:
            self.keepalive_s = min(self.keepalive_limit_s, idle / 3)
        obs = data["observation"]
        self.tools = [SchemaTool.from_openai(s, forbid_extra=True) for s in obs["tools"]]
        self.task = task if task is not None else self._local_task(seed, obs["info"].get("task_hash"))
        return Observation(obs["messages"], obs["tools"], obs["info"])

    async def step(self, turn: AssistantTurn) -> StepResult:
        if self.session_id is None or self.done:
            raise ResetNeeded(f"step() on {self!r} needs a live session; call reset() first")
        try:
            data = await self._request(
                "step", self.session_id, {"turn_index": self.turn_index, "turn": wire_turn(turn)}
            )
        except ServerError as e:
            if e.code == "session_expired":  # the server's deadline for this session passed
                self.done = True
                info = {"status": "timeout", "termination": "deadline", "error": e.message}
                return StepResult([], truncated=True, info=info)
            if e.code in ("session_not_found", "session_closed"):  # restarted, reaped or shut down
                raise InfraError(f"{self!r}: the server lost the session: {e.message}") from e
            raise
        self.turn_index += 1
        result = StepResult(**data["result"])
        self.done = result.done
        return result

    async def extend_session(self, seconds: float) -> None:
        """Tell the server the episode waited `seconds` without using the env (its generation paused):
        the session's deadline moves that much later; 0 only marks it in use. Never raises: a session
        the server lost shows at the next step."""
        if self.session_id is None or self.done or self.keepalive_s is None:
            return
        try:  # once, briefly: the runner waits for it while a generation may have finished
            answer = await self._send("extend", self.session_id, {"seconds": seconds}, timeout_s=5.0)
        except (Unsent, Lost, InfraError) as e:
            log.info("%r: extend failed: %s", self, e)
            return
        code = answer.body.get("code") if isinstance(answer.body, dict) else None
        if answer.status in (404, 405, 422) and code in (
            "not_found",
            "method_not_allowed",
            "invalid_request",
        ):
            log.warning("%r: the server cannot extend sessions; its deadlines count the pauses", self)
            self.keepalive_s = self.keepalive_limit_s = None  # an older server: no route, or no such op
        elif answer.status >= 400:
            log.info("%r: extend answered %s %s", self, answer.status, code)

    async def close(self) -> None:
        try:
            await self._delete_session()
        finally:
            transport, self.transport = self.transport, None
            if transport is not None:
                await transport.aclose()

    # ---- scripted policy and tasks through a local copy ----------------------------------------------
    def _local(self) -> Env | None:
        if self._local_env is None and self.remote_id:
            from reflow.env import make
            from reflow.env.registration import env_ids

            if self.remote_id in env_ids():
                self._local_env = make(self.remote_id)
        return self._local_env

    def _local_task(self, seed: int | None, remote_hash: str | None) -> Task | None:
        local = self._local() if seed is not None else None
        if local is None:
            return None
        try:
            task = local.pick_task(seed)
        except Exception:
            return None
        return task if task_hash(task) == remote_hash else None

    def demo(self, task: Task, messages: list[Message], rng: random.Random, error_rate: float = 0.0) -> str:
        local = self._local()
        if local is None:
            raise NotImplementedError(f"{self.remote_id!r} is not registered here; no scripted policy")
        return local.demo(task, messages, rng, error_rate)

    def pick_task(self, seed: int | None) -> Task:
        local = self._local()
        if local is None:
            raise NotImplementedError(f"{self.remote_id!r} is not registered here: pass tasks or seeds")
        return local.pick_task(seed)

    def generate_task(self, rng: random.Random) -> Task:
        local = self._local()
        if local is None:
            raise NotImplementedError(f"{self.remote_id!r} is not registered here: pass tasks or seeds")
        return local.generate_task(rng)

    def validate_task(self, task: Task) -> None:
        if not isinstance(task, dict):
            raise ValueError(f"a task must be a dict, got {type(task).__name__}")

    def __repr__(self) -> str:
        return f"<RemoteEnv {self.remote_id or '?'} at {self.url or '?'}>"

    # ---- the wire ----------------------------------------------------------------------------------
    def _transport(self) -> HttpTransport | WsTransport:
        if self.transport is None:
            use_ws = self.transport_kind == "ws" or (self.transport_kind == "auto" and websockets_installed())
            kind = WsTransport if use_ws else HttpTransport
            self.transport = kind(self.url, self.token, self.request_timeout_s)
        return self.transport

    async def _send(
        self, op: str, session_id: str | None, body: dict[str, Any] | None, timeout_s: float | None = None
    ) -> Answer:
        try:
            return await self._transport().send(op, session_id, body, timeout_s)
        except NoWsRoute as e:
            if self.transport_kind == "ws":
                raise InfraError(f"{self!r}: the server does not serve the WebSocket protocol: {e}") from e
            log.info("%r: %s; using HTTP", self, e)
            self.transport = HttpTransport(self.url, self.token, self.request_timeout_s)
            return await self.transport.send(op, session_id, body, timeout_s)

    async def _request(
        self, op: str, session_id: str | None, body: dict[str, Any] | None, *, idempotent: bool = True
    ) -> dict[str, Any]:
        """Send one request with retries; errors become InfraError, EnvError or ServerError."""
        last: Exception | None = None
        for attempt in range(self.retries + 1):
            if attempt:
                await asyncio.sleep(self._backoff(attempt, last))
            try:
                answer = await self._send(op, session_id, body)
            except Unsent as e:
                last = e
                continue
            except Lost as e:
                if idempotent:
                    last = e
                    continue
                method, path = route(op, session_id)
                raise InfraError(f"{self!r}: {method} {path} failed: {type(e).__name__}: {e}") from e
            if answer.status in (429, 503):
                last = answer.error()
                continue
            if answer.status >= 400 or not isinstance(answer.body, dict):
                raise answer.error()
            return answer.body
        method, path = route(op, session_id)
        raise InfraError(
            f"{self!r}: the env server did not answer {method} {path} after {self.retries + 1} tries: "
            f"{type(last).__name__}: {last}"
        ) from last

    def _backoff(self, attempt: int, last: Exception | None) -> float:
        after = getattr(last, "retry_after", None)
        wait = after if after is not None else self.backoff_s * 2 ** (attempt - 1)
        return min(wait, 10.0) * random.uniform(0.8, 1.2)

    async def _delete_session(self) -> None:
        session_id, self.session_id = self.session_id, None
        # A finished session needs no delete: its env was released when the episode ended, and the
        # server forgets the record on its own (one request less per episode). A transport bound to
        # another (maybe closed) loop cannot send it.
        transport = self.transport
        if session_id is None or self.done or transport is None or transport.loop is not _running_loop():
            return
        with contextlib.suppress(Unsent, Lost, InfraError):  # the reaper closes what a lost delete leaves
            await self._send("delete", session_id, None, timeout_s=5.0)


def wire_turn(turn: AssistantTurn) -> dict[str, Any]:
    """A turn as the step request's `turn` (what `dataclasses.asdict` gives, without its deep copy)."""
    calls = [
        {"name": c.name, "arguments": c.arguments, "raw": c.raw, "id": c.id, "parse_error": c.parse_error}
        for c in turn.tool_calls
    ]
    return {
        "content": turn.content,
        "tool_calls": calls,
        "reasoning": turn.reasoning,
        "finish_reason": turn.finish_reason,
        "raw_text": turn.raw_text,
    }


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
