"""Bearer-token auth: every route but `/healthz` asks for `Authorization: Bearer <token>`.

`TokenGate` checks the header before anything else runs (routing, body parsing), so a client without
the token learns nothing but 401 (header missing or malformed) or 403 (wrong token). The comparison
takes the same time however much of the token matches (`hmac.compare_digest`). `SECURITY_SCHEME` is the
scheme the OpenAPI document declares, so that it says what to send.
"""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from reflow.server.routes import error_response
from reflow.server.schemas import ApiError

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
