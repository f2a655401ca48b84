"""What `reflow serve-envs` asks of uvicorn for its connections, and the one limit it adds itself.

- `limit_concurrency` is the settings' `max_connections`: uvicorn counts open connections, WebSockets
  included, and answers an HTTP request past the limit with 503 (its own plain-text body). WebSocket
  handshakes past it are refused by the app (`reflow.server.sockets.WsGate`).
- `ws_max_size` is twice the body limit: a frame a little over the limit is read and answered with an
  error (the socket stays open); a larger one is never buffered, and the socket closes with 1009.
- No per-message deflate: frames are small, and a compressed frame costs the server CPU to inflate
  (and can inflate to far more than it weighs on the wire).
- A deadline for a request head: uvicorn has none (its keep-alive timer runs only between requests,
  and each byte received stops it), so a client that sends a head a byte at a time, or nothing at all,
  holds its connection for ever ("slowloris"). `HeadTimeoutProtocol` closes such a connection
  `head_timeout_s` after the head's first byte (or the connection's start), with a 408 when part of a
  head came. A slow body is not timed: the body limit and `max_connections` bound what it can hold.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from uvicorn.protocols.http.auto import AutoHTTPProtocol

from reflow.server.settings import ServerSettings


def _timeout_response(timeout_s: float) -> bytes:
    body = json.dumps(
        {
            "error_kind": "agent",
            "code": "request_timeout",
            "message": f"the request head did not arrive within {timeout_s:g}s",
        }
    ).encode()
    head = (
        "HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


class HeadTimeoutProtocol(AutoHTTPProtocol):  # type: ignore[misc,valid-type]
    """uvicorn's HTTP protocol (httptools, else h11), with a deadline for each request head.

    Armed when the connection opens and when the first byte of a request arrives between requests;
    disarmed when a response completes. When it fires, the connection is closed unless a new request
    (a new request cycle) began since it was armed or the connection became a WebSocket."""

    head_timeout_s = 10.0
    _head_timer: asyncio.TimerHandle | None = None
    _head_cycle: object = None
    _head_started = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._head_timer is None and (self.cycle is None or self.cycle.response_complete):
            self._arm()
        self._head_started = True
        super().data_received(data)

    def on_response_complete(self) -> None:
        self._disarm()
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._head_cycle, self._head_started = self.cycle, False
        self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timeout)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timeout(self) -> None:
        self._head_timer = None
        transport = self.transport
        if (
            transport.is_closing()
            or transport.get_protocol() is not self
            or self.cycle is not self._head_cycle
        ):
            return  # closed, upgraded to a WebSocket, or the head came
        if self._head_started:
            transport.write(_timeout_response(self.head_timeout_s))
        transport.close()


def head_timeout_protocol(head_timeout_s: float) -> type[asyncio.Protocol]:
    """`HeadTimeoutProtocol` with its deadline set (uvicorn makes one protocol object a connection)."""
    return type("HeadTimeoutProtocol", (HeadTimeoutProtocol,), {"head_timeout_s": head_timeout_s})


def uvicorn_options(settings: ServerSettings) -> dict[str, Any]:
    """The keyword arguments of `uvicorn.Config` that carry the settings' connection limits."""
    return {
        "http": head_timeout_protocol(settings.head_timeout_s),
        "limit_concurrency": settings.max_connections,
        "ws_max_size": 2 * settings.max_body_bytes,
        "ws_per_message_deflate": False,
    }
