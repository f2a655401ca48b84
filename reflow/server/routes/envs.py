"""`GET /v1/envs`: the served envs with their tool schemas and limits (built once at start-up)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from reflow.server.routes import errors
from reflow.server.schemas import EnvList

router = APIRouter(tags=["envs"])


@router.get("/v1/envs", response_model=EnvList, responses=errors(), summary="Served envs")
async def list_envs(request: Request) -> EnvList:
    return EnvList(envs=request.app.state.catalog)
