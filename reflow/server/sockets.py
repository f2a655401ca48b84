"""What the env server's two WebSocket protocols (`/v1/ws` and OpenEnv's `/ws`) share: the cap on open
sockets, the close of an idle one, and the reading of a frame.

uvicorn counts WebSockets among its connections but refuses none past `limit_concurrency` (it checks
HTTP requests only), and its pings keep a silent socket open for ever; `WsGate` does both for the app.
A frame is held to the body limit (`read_frame`) and read with pydantic's JSON reader, as the HTTP
routes read their bodies: it stops at a nesting depth, where the json module recurses into
RecursionError on `[[[[...`.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pydantic_core
from starlette.websockets import WebSocket, WebSocketDisconnect

from reflow.server.routes import error_response
from reflow.server.schemas import ApiError


class WsGate:
    """Open WebSockets of both protocols: at most `max_open` at once, each closed after `idle_s` with
    no frame from its client."""

    def __init__(self, max_open: int, idle_s: float, retry_after_s: int) -> None:
        self.max_open, self.idle_s, self.retry_after_s = max_open, idle_s, retry_after_s
        self.open = 0

    async def enter(self, websocket: WebSocket) -> bool:
        """Count a socket in (call `leave` when it ends), or refuse its handshake: 503 with Retry-After."""
        if self.open >= self.max_open:
            message = f"{self.max_open} WebSockets are open; retry later"
            headers = {"Retry-After": str(self.retry_after_s)}
            await deny(websocket, ApiError(503, "infra", "too_many_connections", message, headers))
            return False
        self.open += 1
        return True

    def leave(self) -> None:
        self.open -= 1

    async def receive(self, websocket: WebSocket) -> dict[str, Any] | None:
        """The next ASGI message of the socket; None when it sat idle `idle_s` (it is closed then)."""
        try:
            return await asyncio.wait_for(websocket.receive(), self.idle_s)
        except asyncio.TimeoutError:
            with contextlib.suppress(RuntimeError, OSError, WebSocketDisconnect):  # closed meanwhile
                await websocket.close(code=1000, reason=f"idle for {self.idle_s:g}s")
            return None


async def deny(websocket: WebSocket, e: ApiError) -> None:
    """Refuse a handshake with the HTTP routes' answer, where the server can send one (the ASGI denial
    response extension; uvicorn has it), else a plain refusal (403, no body)."""
    if "websocket.http.response" in websocket.scope.get("extensions", {}):
        await websocket.send_denial_response(error_response(e.status, e.kind, e.code, e.message, e.headers))
    else:
        await websocket.close(code=1008)


def frame_data(message: dict[str, Any]) -> str | bytes:
    """The data of a `websocket.receive` message: its text, else its bytes."""
    text = message.get("text")
    return text if text is not None else message.get("bytes") or b""


def read_frame(frame: str | bytes, max_bytes: int) -> Any:
    """A frame's JSON value. ApiError 413 `body_too_large` when it is over `max_bytes` (its UTF-8
    length), 400 `bad_request` when it is not JSON (or not UTF-8, or nested too deeply)."""
    # A text frame's length in bytes is its UTF-8 length (up to 4 a character): encoded only when it matters.
    small = isinstance(frame, bytes) or 4 * len(frame) <= max_bytes
    size = len(frame) if small else len(frame.encode("utf-8", "surrogatepass"))
    if size > max_bytes:
        raise ApiError(413, "agent", "body_too_large", f"frame over {max_bytes} bytes")
    try:
        return pydantic_core.from_json(frame)
    except ValueError as e:
        raise ApiError(400, "agent", "bad_request", f"a frame must be JSON text: {e}") from None
