"""Bearer-token auth: every route but `/healthz` asks for `Authorization: Bearer <token>`.

`TokenGate` checks the header before anything else runs (routing, body parsing), so a client without
the token learns nothing but 401 (header missing or malformed) or 403 (wrong token). The comparison
takes the same time however much of the token matches (`hmac.compare_digest`). `SECURITY_SCHEME` is the
scheme the OpenAPI document declares, so that it says what to send.

Without a token (`--no-auth`, loopback only) `LoopbackOnly` stands in its place: a web page the operator
visits could otherwise drive the server, by a WebSocket to 127.0.0.1 (browsers send its `Origin` but
do not stop it) or by DNS rebinding (a name of the page's that resolves to 127.0.0.1 later: the `Host`
says the name). So every request, WebSocket handshakes included, must name a loopback `Host`, and an
`Origin` if it sends one: else 403, before anything else runs.
"""

from __future__ import annotations

import hmac
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Receive, Scope, Send

from reflow.server.routes import error_response
from reflow.server.schemas import ApiError
from reflow.server.settings import is_loopback

SECURITY_SCHEME = {"type": "http", "scheme": "bearer", "description": "the token the server was started with"}
OPEN_PATHS = frozenset({"/healthz"})


def check_token(header: bytes | None, token: bytes) -> None:
    """Raise ApiError 401/403 unless `header` is `Bearer <token>`."""
    scheme, _, given = (header or b"").partition(b" ")
    if scheme.lower() != b"bearer" or not given.strip():
        raise ApiError(
            401,
            "agent",
            "unauthorized",
            "missing or malformed Authorization header; send 'Authorization: Bearer <token>'",
            {"WWW-Authenticate": "Bearer"},
        )
    if not hmac.compare_digest(given.strip(), token):
        raise ApiError(
            403, "agent", "forbidden", "wrong token", {"WWW-Authenticate": 'Bearer error="invalid_token"'}
        )


class TokenGate:
    """ASGI middleware: 401/403 for any request but health that lacks the right bearer token."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app, self.token = app, token.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            header = next((v for k, v in scope["headers"] if k == b"authorization"), None)
            try:
                check_token(header, self.token)
            except ApiError as e:
                await error_response(e.status, e.kind, e.code, e.message, e.headers)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _loopback_host(host: str) -> bool:
    """`host` is a Host header (name or address, maybe a port, IPv6 in brackets)."""
    try:
        return is_loopback(urlsplit(f"//{host}").hostname or "")
    except ValueError:  # a port that is not a number, a bracket left open
        return False


def loopback_refusal(headers: dict[bytes, bytes]) -> ApiError | None:
    """Why a request with these headers is refused by a server without a token, or None."""
    host = headers.get(b"host", b"").decode("latin-1")
    if not _loopback_host(host):
        return ApiError(
            403, "agent", "forbidden_host", "this server answers requests to a loopback host only"
        )
    origin = headers.get(b"origin")
    if origin is not None and not _loopback_host(urlsplit(origin.decode("latin-1")).netloc):
        return ApiError(
            403, "agent", "forbidden_origin", "this server answers pages of a loopback origin only"
        )
    return None


class LoopbackOnly:
    """ASGI middleware of a server without a token: 403 for a request (HTTP or a WebSocket handshake)
    whose Host, or Origin when it sends one, is not a loopback name or address."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            refusal = loopback_refusal(dict(scope["headers"]))
            if refusal is not None:
                response = error_response(refusal.status, refusal.kind, refusal.code, refusal.message)
                if scope["type"] == "http":
                    await response(scope, receive, send)
                elif "websocket.http.response" in scope.get("extensions", {}):
                    await send(
                        {
                            "type": "websocket.http.response.start",
                            "status": 403,
                            "headers": response.raw_headers,
                        }
                    )
                    await send({"type": "websocket.http.response.body", "body": response.body})
                else:
                    await send({"type": "websocket.close", "code": 1008})  # before accept: answered 403
                return
        await self.app(scope, receive, send)
