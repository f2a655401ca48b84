"""How `RemoteEnv` reaches the env server: one request of the session protocol, one `Answer`.

A transport sends `create`, `step`, `extend`, `get` or `delete` and returns the server's answer (HTTP status and
JSON body, errors included), or raises why there is none, in the two kinds the retry policy needs:
`Unsent` (the request surely did not reach the server: a refused connect, a socket found closed before
the send; sending it again is safe) and `Lost` (it may have arrived and its answer was lost: only an
idempotent step is sent again). A transport is bound to the event loop that first used it.

- `WsTransport` (the default): one WebSocket (`/v1/ws`, see `reflow.server.routes.ws`) for every request
  of its env, opened on first use and again after a loss. It costs a fraction of HTTP's CPU per step
  (httpx builds and parses a request, its URL, headers and cookies each time; a frame is one
  `json.dumps` and a few bytes of framing). No compression: frames are small, and deflate costs CPU on
  both ends.
- `HttpTransport`: httpx with keep-alive, the protocol of the server's OpenAPI document; used when asked
  for, when `websockets` is not installed, or when the server has no `/v1/ws` (`NoWsRoute`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
import sys
from dataclasses import dataclass
from functools import cache
from typing import Any

import httpx

from reflow.env import EnvError, InfraError

try:
    from websockets.asyncio.client import ClientConnection, connect
    from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus
    from websockets.protocol import State
except ImportError:  # the core installs without it; RemoteEnv then speaks HTTP
    connect = None  # type: ignore[assignment]

WS_PATH = "/v1/ws"
MAX_FRAME_BYTES = 64 * 2**20
ROUTES = {
    "create": ("POST", "/v1/sessions"),
    "step": ("POST", "/v1/sessions/{}/step"),
    "extend": ("POST", "/v1/sessions/{}/extend"),
    "get": ("GET", "/v1/sessions/{}"),
    "delete": ("DELETE", "/v1/sessions/{}"),
}


def route(op: str, session_id: str | None = None) -> tuple[str, str]:
    """The HTTP method and path of a protocol request."""
    method, path = ROUTES[op]
    return method, path.format(session_id)


def websockets_installed() -> bool:
    return connect is not None


class Unsent(Exception):
    """The request surely did not reach the server; sending it again is safe."""


class ConnectError(Unsent):
    """No connection to the server could be made (refused, unreachable, timed out, handshake failed)."""


class Lost(Exception):
    """The request may have reached the server, and no answer came back."""


class NoWsRoute(Exception):
    """The server does not serve `/v1/ws` (an older server, or one without WebSocket support)."""


class ServerError(RuntimeError):
    """The server refused a request for a reason other than infrastructure (auth, a bad request)."""

    def __init__(self, status: int, kind: str, code: str, message: str) -> None:
        super().__init__(f"env server answered {status} {code} ({kind}): {message}")
        self.status, self.kind, self.code, self.message = status, kind, code, message


@dataclass
class Answer:
    """The server's answer: status, the JSON body (None when the body was not JSON) and its text."""

    status: int
    body: Any
    text: str = ""
    retry_after: float | None = None

    def error(self) -> Exception:
        """The exception an error answer stands for: `InfraError` (infra), `EnvError` (env), else
        `ServerError`; a body that is not the server's error shape is an infra error."""
        try:
            kind, code, message = self.body["error_kind"], self.body["code"], self.body["message"]
        except (KeyError, TypeError):
            kind, code, message = "infra", "bad_response", self.text[:300]
        if kind == "infra":
            error: Exception = InfraError(f"env server answered {self.status} {code}: {message}")
        elif kind == "env":
            error = EnvError(f"env server answered {self.status} {code}: {message}")
        else:
            error = ServerError(self.status, kind, code, message)
        error.retry_after = self.retry_after  # type: ignore[attr-defined]
        return error


def seconds(value: str | None) -> float | None:
    """A Retry-After header's seconds (None unless it is a plain number)."""
    value = (value or "").strip()
    return float(value) if value.replace(".", "", 1).isdigit() else None


@cache
def ssl_context() -> ssl.SSLContext:
    return ssl.create_default_context()  # ~40 ms: made once, not once per env


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


class HttpTransport:
    def __init__(
        self, url: str, token: str | None, timeout_s: float, connect_timeout_s: float = 10.0
    ) -> None:
        self.url, self.token = url, token
        self.timeout = httpx.Timeout(timeout_s, connect=connect_timeout_s)
        self.client: httpx.AsyncClient | None = None
        self.loop: asyncio.AbstractEventLoop | None = None

    def http(self) -> httpx.AsyncClient:
        loop = _running_loop()
        if self.client is None or self.loop is not loop:  # an httpx client is bound to its loop
            headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
            self.client = httpx.AsyncClient(
                base_url=self.url,
                headers=headers,
                timeout=self.timeout,
                verify=ssl_context() if self.url.startswith("https") else False,
                limits=httpx.Limits(max_connections=4, max_keepalive_connections=1),
            )
            self.loop = loop
        return self.client

    async def send(
        self, op: str, session_id: str | None, body: dict[str, Any] | None, timeout_s: float | None = None
    ) -> Answer:
        method, path = route(op, session_id)
        timeout = self.timeout if timeout_s is None else httpx.Timeout(timeout_s)
        try:
            response = await self.http().request(method, path, json=body, timeout=timeout)
        except (httpx.ConnectError, httpx.ConnectTimeout) as e:
            raise ConnectError(f"{type(e).__name__}: {e}") from e
        except httpx.TransportError as e:
            raise Lost(f"{type(e).__name__}: {e}") from e
        try:
            data = response.json()
        except ValueError:
            data = None
        return Answer(response.status_code, data, response.text, seconds(response.headers.get("Retry-After")))

    async def aclose(self) -> None:
        client, self.client = self.client, None
        if client is not None and self.loop is _running_loop():
            await client.aclose()


class WsTransport:
    def __init__(
        self, url: str, token: str | None, timeout_s: float, connect_timeout_s: float = 10.0
    ) -> None:
        if connect is None:
            raise ImportError("RemoteEnv's WebSocket transport needs websockets (pip install websockets)")
        scheme, _, rest = url.partition("://")
        self.ws_url = {"http": "ws", "https": "wss"}.get(scheme, scheme) + "://" + rest + WS_PATH
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.timeout_s, self.connect_timeout_s = timeout_s, connect_timeout_s
        self.ws: ClientConnection | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._lock: asyncio.Lock | None = None
        self._last_id = 0

    async def send(
        self, op: str, session_id: str | None, body: dict[str, Any] | None, timeout_s: float | None = None
    ) -> Answer:
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        loop = _running_loop()
        if self._lock is None or self.loop is not loop:  # a socket (and a lock) is bound to its loop
            self.ws, self.loop, self._lock = None, loop, asyncio.Lock()
        lock = self._lock
        # One request at a time on the socket, so answers come back in order; a request that finds it
        # busy (a close while a step runs) waits at most its own timeout.
        if lock.locked():
            try:
                await asyncio.wait_for(lock.acquire(), timeout_s)
            except asyncio.TimeoutError as e:
                raise Unsent(f"the socket stayed busy for {timeout_s:g}s") from e
        else:
            await lock.acquire()
        try:
            return await self._exchange(op, session_id, body, timeout_s)
        finally:
            lock.release()

    async def _exchange(
        self, op: str, session_id: str | None, body: dict[str, Any] | None, timeout_s: float
    ) -> Answer:
        ws = self.ws
        if ws is None or ws.state is not State.OPEN:
            opened = await self._open()
            if isinstance(opened, Answer):  # the handshake was refused (a bad token): that is the answer
                return opened
            ws = self.ws = opened
        self._last_id += 1
        request_id = self._last_id
        frame: dict[str, Any] = {"id": request_id, "op": op}
        if session_id is not None:
            frame["session_id"] = session_id
        if body is not None:
            frame["body"] = body
        try:
            await ws.send(json.dumps(frame))
        except ConnectionClosed as e:
            self._drop(ws)
            raise Unsent(f"the socket closed before {op} was sent: {e}") from e
        try:
            reply = await self._answer(ws, request_id, timeout_s)
        except BaseException:  # lost, timed out or cancelled: a late answer would queue behind ours
            self._drop(ws)
            raise
        headers = reply.get("headers")
        retry_after = seconds(headers.get("Retry-After")) if isinstance(headers, dict) else None
        return Answer(reply["status"], reply.get("body"), retry_after=retry_after)

    async def _answer(self, ws: ClientConnection, request_id: int, timeout_s: float) -> dict[str, Any]:
        """The answer frame to `request_id` (an older request's late answer is skipped)."""
        try:
            while True:
                reply = json.loads(await _recv(ws, timeout_s))
                if isinstance(reply, dict) and reply.get("id") == request_id:
                    if not isinstance(reply.get("status"), int):
                        raise Lost(f"the server sent an answer without a status: {str(reply)[:300]}")
                    return reply
        except (ConnectionClosed, OSError) as e:
            raise Lost(f"the socket closed before the answer came: {type(e).__name__}: {e}") from e
        except asyncio.TimeoutError as e:
            raise Lost(f"no answer in {timeout_s:g}s") from e
        except ValueError as e:
            raise Lost(f"the server sent a frame that is not JSON: {e}") from e

    async def _open(self) -> ClientConnection | Answer:
        try:
            return await connect(
                self.ws_url,
                additional_headers=self.headers,
                open_timeout=self.connect_timeout_s,
                compression=None,
                max_size=MAX_FRAME_BYTES,
                ssl=ssl_context() if self.ws_url.startswith("wss") else None,
            )
        except InvalidStatus as e:
            return self._refusal(e.response.status_code, e.response.body or b"")
        except (OSError, asyncio.TimeoutError, InvalidHandshake) as e:
            raise ConnectError(f"cannot open {self.ws_url}: {type(e).__name__}: {e}") from e

    def _refusal(self, status: int, raw: bytes) -> Answer:
        text = raw.decode("utf-8", "replace")
        try:
            body = json.loads(text)
        except ValueError:
            body = None
        ours = isinstance(body, dict) and "error_kind" in body
        # 401/403 with our error body: the token. Anything else short of a server failure means that no
        # route answered the upgrade (Starlette refuses an unknown WebSocket path with a bare 403).
        if status < 500 and status != 429 and not (ours and status in (401, 403)):
            raise NoWsRoute(f"{self.ws_url} answered HTTP {status}: {text[:200]}")
        return Answer(status, body, text)

    def _drop(self, ws: ClientConnection) -> None:
        if self.ws is ws:
            self.ws = None
        ws.transport.abort()  # no closing handshake: the socket is not trusted any more

    async def aclose(self) -> None:
        ws, self.ws = self.ws, None
        if ws is not None and self.loop is _running_loop():
            with contextlib.suppress(Exception):
                await asyncio.wait_for(ws.close(), 2.0)


if sys.version_info >= (3, 11):

    async def _recv(ws: ClientConnection, timeout_s: float) -> str | bytes:
        async with asyncio.timeout(timeout_s):  # no task per frame, unlike wait_for before 3.12
            return await ws.recv()

else:

    async def _recv(ws: ClientConnection, timeout_s: float) -> str | bytes:
        return await asyncio.wait_for(ws.recv(), timeout_s)
