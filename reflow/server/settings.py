"""The env server's settings: its limits, which envs it serves (and which kwargs clients set), whether
model code may run on the host or in sandboxes no cgroup bounds, its bearer token, and what counts as a
loopback host."""

from __future__ import annotations

import ipaddress
import os
import stat
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from reflow.server.client_kwargs import KwargRule

TOKEN_ENV_VAR = "REFLOW_SERVER_TOKEN"
MIN_TOKEN_CHARS = 16
BUILTIN_ENVS = (
    "reflow/Calc-v0",
    "reflow/Guess-v0",
    "reflow/LongTail-v0",
    "reflow/Math-v0",
    "reflow/PyCode-v0",
)
"""What the server serves unless told otherwise: ReFlow's own envs. Never, unless listed, a proxy
(reflow/Remote-v0 or an interop adapter would let any client make the server call any URL or start any
program) or a plugin's env."""
LOOPBACK_NAMES = ("localhost",)


def is_loopback(host: str) -> bool:
    """Whether `host` (a name or an address, IPv6 with or without brackets) is this machine only."""
    host = host.strip("[]")
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass
class ServerSettings:
    """Everything `create_app` needs. Times are seconds; `token=None` with `no_auth=True` serves anyone."""

    token: str | None = None
    no_auth: bool = False
    max_sessions: int = 256
    """Live sessions (creating, ready or stepping) at once; one more gets 429 with Retry-After."""
    max_body_bytes: int = 1 << 20
    step_timeout_s: float = 60.0
    """One step may take this long; past it the episode ends with status "timeout"."""
    default_deadline_s: float = 600.0
    """Wall-clock budget of a session from its creation (sandbox start included) when it asks for none."""
    max_deadline_s: float = 3600.0
    max_extend_s: float = 3600.0
    """How far a session's deadline may move in all for the pauses its client reports (`extend`: an
    episode carried over a train step waits without using its env); 0 refuses every extension."""
    idle_timeout_s: float = 300.0
    """A session nobody touched for this long is closed and its env (and sandbox) released."""
    reaper_interval_s: float = 5.0
    retry_after_s: int = 1
    ended_kept: int = 4096
    """Finished sessions whose final results are kept for retries; older ones are forgotten first."""
    ended_ttl_s: float = 60.0
    """How long a finished session's final result is kept (a client need not delete it)."""
    env_pool_size: int = 32
    """Idle envs kept per env id and kwargs, reset for the next session instead of built again."""
    max_idle_envs: int = 64
    """Idle envs kept in all, across env ids and kwargs values (the longest idle is closed first)."""
    shutdown_grace_s: float = 10.0
    """On shutdown, in-flight steps get this long to finish before they are cancelled."""
    max_connections: int | None = None
    """Open connections at once, WebSockets included: past it an HTTP request gets 503 (uvicorn's
    `limit_concurrency`) and a WebSocket handshake 503 with Retry-After. None: 1024, or twice
    `max_sessions` when that is more (a RemoteEnv holds one WebSocket a session)."""
    head_timeout_s: float = 10.0
    """A request's head (request line and headers) must arrive within this long of its first byte, or
    of the connection's start; else the connection is closed (408), so slow heads cannot hold it."""
    ws_idle_timeout_s: float = 300.0
    """A WebSocket on which the client sends no frame for this long is closed (1000)."""
    env_ids: list[str] | None = None
    """Envs to serve (None: `BUILTIN_ENVS`)."""
    env_kwargs: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Constructor kwargs per env id, set by whoever runs the server."""
    client_env_kwargs: dict[str, dict[str, KwargRule]] = field(default_factory=dict)
    """Per env id, the constructor kwargs a client may set when it creates a session and their values
    (none by default; `reflow.server.client_kwargs` says what may be declared; never `sandbox`)."""
    allow_host_code: bool = False
    """Serve an env that would run model-written code on the host (its sandbox resolved to "subprocess").
    Off: such an env is refused at start-up."""
    allow_uncapped_sandbox: bool = False
    """Serve an env whose code runs in bubblewrap sandboxes when no cgroup can be made for them here
    (`reflow.sandbox.cgroup.cgroup_problem`): its processes and tmpfs then count against no memory or
    pids limit. Off: such an env is refused at start-up."""

    def __post_init__(self) -> None:
        if self.token is None and not self.no_auth:
            raise ValueError(f"no token: give one (a file or ${TOKEN_ENV_VAR}) or run with no_auth=True")
        if self.max_sessions < 1 or self.max_body_bytes < 1024:
            raise ValueError("max_sessions must be >= 1 and max_body_bytes >= 1024")
        if self.max_connections is None:
            self.max_connections = max(1024, 2 * self.max_sessions)
        if self.max_connections < 1:
            raise ValueError("max_connections must be >= 1")
        for name in (
            "step_timeout_s",
            "default_deadline_s",
            "max_deadline_s",
            "idle_timeout_s",
            "head_timeout_s",
            "ws_idle_timeout_s",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        if not (self.max_idle_envs >= 0 and self.max_extend_s >= 0):  # (NaN too)
            raise ValueError("max_idle_envs and max_extend_s must be >= 0")
        if self.client_env_kwargs:
            from reflow.server.client_kwargs import OPERATOR_ONLY

            for env_id, rules in self.client_env_kwargs.items():
                if OPERATOR_ONLY & set(rules):  # where model code runs is never a client's choice
                    raise ValueError(
                        f"clients cannot set {sorted(OPERATOR_ONLY)} of {env_id}: the operator's"
                    )


def load_token(token_file: str | Path | None = None) -> str | None:
    """The token from `token_file`, else from $REFLOW_SERVER_TOKEN, else None.

    A short token is refused; a token file that others can read is allowed with a warning.
    """
    if token_file is not None:
        path = Path(token_file)
        token = path.read_text(encoding="utf-8").strip()
        if path.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            warnings.warn(f"token file {path} is readable by others (chmod 600 it)", stacklevel=2)
        source = str(path)
    else:
        token = os.environ.get(TOKEN_ENV_VAR, "").strip()
        source = f"${TOKEN_ENV_VAR}"
        if not token:
            return None
    if len(token) < MIN_TOKEN_CHARS or any(c.isspace() for c in token):
        raise ValueError(f"the token in {source} must be at least {MIN_TOKEN_CHARS} characters, no spaces")
    return token
