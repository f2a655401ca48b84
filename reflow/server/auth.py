"""Bearer-token auth: every route but health asks for `Authorization: Bearer <token>`.

401 when the header is missing or malformed, 403 when the token is wrong; the comparison takes the
same time however much of the token matches (`hmac.compare_digest`).
"""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Request, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from reflow.server.schemas import ApiError

bearer = HTTPBearer(auto_error=False, description="the token the server was started with")


async def require_token(
    request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Security(bearer)]
) -> None:
    token: str | None = request.app.state.settings.token
    if token is None:  # started with --no-auth (loopback only)
        return
    if credentials is None or not credentials.credentials:
        raise ApiError(
            401,
            "agent",
            "unauthorized",
            "missing or malformed Authorization header; send 'Authorization: Bearer <token>'",
            {"WWW-Authenticate": "Bearer"},
        )
    if not hmac.compare_digest(credentials.credentials.encode(), token.encode()):
        raise ApiError(
            403, "agent", "forbidden", "wrong token", {"WWW-Authenticate": 'Bearer error="invalid_token"'}
        )
