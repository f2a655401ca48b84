"""`create_app(settings)`: the FastAPI application of the env server.

It owns what is the same for every route: the lifespan (the env catalog, each env's sandbox backend
logged, and the reaper on start; a graceful close of every session and sandbox pool on stop), the
request-body limit, auth on everything but `/healthz` (the OpenAPI document included; without a token,
loopback hosts and origins only), the refusal of an env that would run model code on the host (unless
`allow_host_code`) or in bubblewrap sandboxes with no cgroup (unless `allow_uncapped_sandbox`), and one
error shape: every error answers
`{error_kind, code, message}`. Env failures are `env`; infrastructure, capacity and timeouts `infra`;
bad requests, validation and auth `agent`. A method a path does not take answers 405 with an `Allow`
header naming those it does; `OPTIONS` answers 204 with the same header.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from reflow.env import make
from reflow.env.registration import spec_kwargs
from reflow.sandbox.env_backend import HOST, PROCESS, env_backend, host_code_reason, uncapped_reason
from reflow.server import openenv_ws
from reflow.server.auth import OPEN_PATHS, SECURITY_SCHEME, LoopbackOnly, TokenGate
from reflow.server.routes import capacity, envs, error_response, health, sessions, ws
from reflow.server.schemas import ApiError, StepRequest
from reflow.server.sessions import SessionManager, served_env_ids
from reflow.server.settings import ServerSettings
from reflow.server.sockets import WsGate

log = logging.getLogger(__name__)


class BodyLimit:
    """413 for a request body over `max_bytes`, whether it says its length up front or is chunked."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None:
            if not declared.isdigit():
                await error_response(400, "agent", "bad_request", "invalid Content-Length")(
                    scope, receive, send
                )
                return
            if int(declared) > self.max_bytes:
                await self._too_large()(scope, receive, send)
                return
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_bytes:
                # FastAPI passes an HTTPException from the body read through to the handlers below.
                raise HTTPException(413, self._message())
            return message

        await self.app(scope, limited, send)

    def _message(self) -> str:
        return f"request body over {self.max_bytes} bytes"

    def _too_large(self) -> JSONResponse:
        return error_response(413, "agent", "body_too_large", self._message())


class BackendRefused(ValueError):
    """A served env would run model-written code where the settings do not allow it: on the host, or in
    sandboxes that no cgroup bounds."""


def _served_kinds(settings: ServerSettings) -> dict[str, str | None]:
    kinds = {}
    for env_id in served_env_ids(settings):
        with contextlib.suppress(Exception):  # not registered or not importable: the catalog says so
            kinds[env_id] = env_backend(env_id, settings.env_kwargs.get(env_id))
    return kinds


def refuse_backends(settings: ServerSettings) -> None:
    """BackendRefused (one line, naming the envs, the reason and the flag) when a served env's sandbox
    resolved to the host and `allow_host_code` is off (every client's code would run as the server's
    user: it could read the token, outlive its time limit, reach the network), or to bubblewrap with no
    cgroup to be had and `allow_uncapped_sandbox` off (a call's processes and tmpfs would be charged to
    no limit: one client could pin the host's memory)."""
    kinds = _served_kinds(settings)
    host = [env_id for env_id, kind in kinds.items() if kind == HOST]
    if host and not settings.allow_host_code:
        reason = host_code_reason(host[0], settings.env_kwargs.get(host[0]))
        raise BackendRefused(
            f"{', '.join(host)} would run model-written code on this host, unsandboxed ({reason}); "
            "make a sandbox work here, or serve it anyway with --allow-host-code"
        )
    uncapped = [env_id for env_id, kind in kinds.items() if kind == PROCESS]
    reason = uncapped_reason(uncapped[0], settings.env_kwargs.get(uncapped[0])) if uncapped else None
    if reason is not None and not settings.allow_uncapped_sandbox:
        raise BackendRefused(
            f"{', '.join(uncapped)} would run model-written code in bubblewrap sandboxes with no memory or "
            f"pids limit ({reason}); give the server a cgroup, use Docker, or serve it anyway with "
            "--allow-uncapped-sandbox"
        )


def _log_backend(env_id: str, kwargs: dict[str, Any]) -> None:
    kind = env_backend(env_id, kwargs)
    if kind == HOST:
        log.warning("%s: model code runs on this host, unsandboxed (--allow-host-code)", env_id)
    elif kind is None:
        log.info("%s: runs no model code", env_id)
    elif (reason := uncapped_reason(env_id, kwargs)) is not None:
        log.warning(
            "%s: model code runs in %s sandboxes with no memory or pids limit (--allow-uncapped-sandbox): %s",
            env_id,
            kind,
            reason,
        )
    else:
        log.info("%s: model code runs in %s sandboxes", env_id, kind)


async def build_catalog(ids: list[str], settings: ServerSettings) -> list[dict[str, Any]]:
    """Each served env's tools and limits, read from one instance; an env that cannot be made is left out."""
    catalog = []
    for env_id in ids:
        try:
            env = make(env_id, **settings.env_kwargs.get(env_id, {}))
        except Exception as e:
            log.warning("not serving %s: it cannot be made here (%s: %s)", env_id, type(e).__name__, e)
            continue
        _log_backend(env_id, settings.env_kwargs.get(env_id, {}))
        spec = spec_kwargs(env_id)
        tools = [tool.schema for tool in env.unwrapped.tools]
        await env.close()
        catalog.append(
            {
                "env_id": env_id,
                "tools": tools,
                "max_turns": spec["max_turns"],
                "deadline_s": spec["deadline_s"],
            }
        )
    return catalog


def create_app(settings: ServerSettings) -> FastAPI:
    """The app; serve it with uvicorn (`reflow serve-envs` does). BackendRefused: see `refuse_backends`."""
    refuse_backends(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.catalog = await build_catalog(served_env_ids(settings), settings)
        app.state.manager = SessionManager(settings, [e["env_id"] for e in app.state.catalog])
        app.state.started = time.monotonic()
        app.state.manager.start()
        yield
        await app.state.manager.shutdown()
        from reflow.sandbox import close_shared_pools  # sandboxes this process started go too

        await asyncio.to_thread(close_shared_pools)

    app = FastAPI(
        title="ReFlow env server",
        version="1",
        description=__doc__,
        lifespan=lifespan,
        openapi_url=None,  # served below, behind the token
        docs_url=None,
        redoc_url=None,
    )
    app.state.settings = settings
    app.state.ws_gate = WsGate(settings.max_connections, settings.ws_idle_timeout_s, settings.retry_after_s)

    for module in (health, sessions, envs, capacity, ws):  # ws: the session protocol over one WebSocket
        app.include_router(module.router)
    app.include_router(openenv_ws.router)  # OpenEnv's /ws protocol beside ours, under /openenv/<env id>

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi() -> JSONResponse:
        return JSONResponse(openapi_document(app))

    _add_error_handlers(app)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    if settings.token is not None:
        app.add_middleware(TokenGate, token=settings.token)  # added last: runs first
    else:
        app.add_middleware(LoopbackOnly)
    return app


def openapi_document(app: FastAPI) -> dict[str, Any]:
    """FastAPI's document, with the bearer scheme on every route but health (TokenGate enforces it
    before routing, so no route declares it) and the served env ids as the choices of `env_id`."""
    doc = copy.deepcopy(app.openapi())
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    step = StepRequest.model_json_schema(ref_template="#/components/schemas/{model}")
    schemas.update(step.pop("$defs", {}), StepRequest=step)  # the step route reads its body itself
    if app.state.settings.token is not None:
        doc.setdefault("components", {})["securitySchemes"] = {"HTTPBearer": SECURITY_SCHEME}
        for path, operations in doc["paths"].items():
            for operation in operations.values() if path not in OPEN_PATHS else ():
                operation["security"] = [{"HTTPBearer": []}]
    manager = getattr(app.state, "manager", None)
    if manager is not None and manager.served:
        doc["components"]["schemas"]["CreateSession"]["properties"]["env_id"]["enum"] = sorted(manager.served)
    return doc


_METHODS = ("DELETE", "GET", "HEAD", "PATCH", "POST", "PUT")


def allowed_methods(app: FastAPI, scope: Scope) -> list[str]:
    """Every method some route of `app` takes at the scope's path, and OPTIONS (answered by the 405
    handler): each method is matched against the routes as a request with it would be."""
    allowed = {"OPTIONS"}
    for method in _METHODS:
        probe = {**scope, "method": method}
        if any(route.matches(probe)[0] == Match.FULL for route in app.router.routes):
            allowed.add(method)
    return sorted(allowed)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError) -> JSONResponse:
        return error_response(e.status, e.kind, e.code, e.message, e.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err.get('loc', ())) or 'body'}: {err.get('msg', '')}"
            for err in e.errors()[:5]
        )
        return error_response(422, "agent", "invalid_request", problems or "invalid request")

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> Response:
        headers = e.headers
        if e.status_code == 405:
            # Starlette's Allow names the methods of the first route that matched the path, not of the path.
            headers = {**(headers or {}), "Allow": ", ".join(allowed_methods(request.app, request.scope))}
            if request.method == "OPTIONS":  # asking what a path takes is a question, not an error
                return Response(status_code=204, headers=headers)
        codes = {404: "not_found", 405: "method_not_allowed", 413: "body_too_large"}
        return error_response(
            e.status_code, "agent", codes.get(e.status_code, "bad_request"), str(e.detail), headers
        )

    @app.exception_handler(Exception)
    async def crashed(request: Request, e: Exception) -> JSONResponse:
        log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=e)
        return error_response(500, "infra", "internal_error", f"the server failed: {type(e).__name__}")
