"""Choosing a backend, making sandboxes, and the process-wide shared pools envs draw from.

`best_backend()` picks, in order: "docker" (an engine answers and the sandbox image exists), "process"
(bubblewrap works here), else "subprocess" (no sandbox at all: a host subprocess with rlimits).
`REFLOW_SANDBOX=docker|process|subprocess` overrides the choice. Probes are cached per process.
"""

from __future__ import annotations

import os
import threading
from functools import cache
from typing import Any

from reflow.sandbox.base import SandboxError, SandboxLimits, ToolSandbox
from reflow.sandbox.images import DEFAULT_IMAGE
from reflow.sandbox.pool import SandboxPool

BACKENDS = ("docker", "process")
KINDS = ("docker", "process", "subprocess")


@cache
def docker_problem(image: str = DEFAULT_IMAGE) -> str | None:
    """None when Docker sandboxes can start here, else why not."""
    try:
        import docker
    except ImportError:
        return "the Docker SDK is not installed (pip install 'reflow-rl[sandbox]')"
    try:
        client = docker.from_env(timeout=5)
        client.ping()
    except Exception as e:
        return f"no Docker engine reachable ({str(e).splitlines()[0][:160]})"
    try:
        client.images.get(image)
    except Exception:
        return f"the sandbox image {image} is missing (build it: reflow sandbox build)"
    finally:
        client.close()
    return None


def backend_problem(kind: str) -> str | None:
    """None when `kind` can be used here, else why not."""
    if kind == "docker":
        return docker_problem()
    if kind == "process":
        from reflow.sandbox.process_sandbox import bwrap_problem

        return bwrap_problem()
    if kind == "subprocess":
        return None
    return f"unknown sandbox kind {kind!r}; choose from {', '.join(KINDS)}"


def best_backend() -> str:
    """The strongest kind that works here (or the one REFLOW_SANDBOX names)."""
    forced = os.environ.get("REFLOW_SANDBOX", "").strip().lower()
    if forced and forced != "auto":
        if forced not in KINDS:
            raise SandboxError(f"REFLOW_SANDBOX={forced!r}: choose from {', '.join(KINDS)} or auto")
        return forced
    for kind in BACKENDS:
        if backend_problem(kind) is None:
            return kind
    return "subprocess"


def resolve_kind(kind: str | None) -> str:
    return best_backend() if kind in (None, "", "auto") else str(kind)


def make_sandbox(
    kind: str | None = "auto",
    limits: SandboxLimits | None = None,
    *,
    image: str = DEFAULT_IMAGE,
    pool: str = "",
) -> ToolSandbox:
    """Start one sandbox of `kind` ("docker", "process" or "auto")."""
    kind = resolve_kind(kind)
    if kind == "docker":
        from reflow.sandbox.docker_sandbox import DockerSandbox

        return DockerSandbox.create(image, limits, pool=pool)
    if kind == "process":
        from reflow.sandbox.process_sandbox import ProcessSandbox

        return ProcessSandbox.create(limits, pool=pool)
    raise SandboxError(f"no sandbox of kind {kind!r} (subprocess is not a sandbox)")


_pools: dict[tuple[Any, ...], SandboxPool] = {}
_pools_lock = threading.Lock()


def shared_pool(
    kind: str | None = "auto",
    limits: SandboxLimits | None = None,
    *,
    image: str = DEFAULT_IMAGE,
    size: int = 2,
    max_live: int = 32,
    create_rate: float = 8.0,
) -> SandboxPool:
    """The process-wide pool for these settings, made on first use and closed at exit."""
    kind = resolve_kind(kind)
    if kind not in BACKENDS:
        raise SandboxError(f"no sandbox pool of kind {kind!r}")
    limits = limits or SandboxLimits()
    key = (kind, limits, image if kind == "docker" else None, size, max_live, create_rate)
    with _pools_lock:
        pool = _pools.get(key)
        # A forked child inherits the parent's pools (their threads gone, their sandboxes the parent's).
        if pool is None or pool.closed or pool.owner_pid != os.getpid():
            name = f"{kind}-{len(_pools)}"

            def factory() -> ToolSandbox:
                return make_sandbox(kind, limits, image=image, pool=name)

            if kind == "docker":
                _reap_orphans()
            pool = SandboxPool(factory, size=size, max_live=max_live, create_rate=create_rate, name=name)
            _pools[key] = pool
        return pool


def close_shared_pools() -> None:
    with _pools_lock:
        pools = list(_pools.values())
        _pools.clear()
    for pool in pools:
        pool.close()


def _reap_orphans() -> None:
    """Before a Docker pool starts: remove what owners that died (`kill -9`, a crash) left behind."""
    try:
        from reflow.sandbox.docker_sandbox import shared_client
        from reflow.sandbox.reaper import reap

        reap(shared_client())
    except Exception:
        pass  # best effort; `reflow sandbox reap` reports errors
