"""`GET /healthz`: liveness, the one route without auth (it says nothing about sessions)."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request

from reflow.server.routes import errors
from reflow.server.schemas import Health

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health, responses=errors(auth=False), summary="Liveness")
async def health(request: Request) -> Health:
    manager = request.app.state.manager
    return Health(
        status="draining" if manager.draining else "ok",
        uptime_s=round(time.monotonic() - request.app.state.started, 3),
    )
