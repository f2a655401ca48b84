"""`GET /v1/capacity`: live sessions against the limit, sessions by state, steps in flight."""

from __future__ import annotations

from fastapi import APIRouter, Request

from reflow.server.routes import errors
from reflow.server.schemas import Capacity

router = APIRouter(tags=["capacity"])


@router.get("/v1/capacity", response_model=Capacity, responses=errors(), summary="Sessions and limits")
async def capacity(request: Request) -> Capacity:
    return Capacity(**request.app.state.manager.capacity())
