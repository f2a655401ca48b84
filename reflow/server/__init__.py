"""The hosted environment server and its client.

This package owns the network face of environments: `reflow serve-envs` serves every registered env
over HTTP with a session protocol (create, step with an idempotent turn index, get,
delete, env list, capacity, health), and `RemoteEnv` makes a served env look like any local one
(`reflow.make("reflow/Remote-v0", url=..., env_id=...)`).

- `schemas`: the wire models and the one session state-transition table.
- `settings`: the server's limits and its token.
- `sessions`: the session manager (limits, step cache, deadlines, idle reaper, shutdown).
- `auth`, `app`, `routes/`: the FastAPI application (FastAPI and uvicorn are the `server` extra).
- `client`, `transports`: `RemoteEnv` over one WebSocket per env (`/v1/ws`, `websockets`) or HTTP
  (httpx); it imports without FastAPI or uvicorn.
- `cli`: `reflow serve-envs`.

It imports `reflow.env` and `reflow.sandbox` only, so it runs on a machine with no torch at all.
"""

from typing import Any

__all__ = ["RemoteEnv", "ServerError"]


def __getattr__(name: str) -> Any:  # lazy: `reflow serve-envs --help` need not import httpx
    if name in __all__:
        from reflow.server import client

        return getattr(client, name)
    raise AttributeError(name)
