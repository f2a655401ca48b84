"""The sandbox protocol, its limits and results, and `ToolSandbox`: what both backends share.

A sandbox is one isolated place where model-written code runs, used by one episode at a time. Its
async methods are the protocol: `exec` (a plain command, started fresh), `run_tool` (a call to the
tool server living in the sandbox: run_python, run_shell, read_file, write_file, list_dir),
`upload`, `download`, `close` and `is_alive`. The work happens in blocking `*_sync` methods run on a
shared thread pool, so a sandbox is not tied to one event loop and a pool's background thread can
reset it. Calls into one sandbox are serialised; different sandboxes run in parallel.

A sandbox is a `ToolSandbox` holding a backend (`SandboxBackend`: `DockerSandbox`, `ProcessSandbox`):
the time limits, the lock, the closed and dead handling and the tool calls are written once here; a
backend supplies the round trip to its tool server, `exec`, whether it is still running, and teardown.

Results are `ToolOutput`s. `ok` is False, with a short `error` meant for the model, when a call could not
do what was asked: a timeout, bad arguments, a missing file, the sandbox dying, the episode's time
being used up. A program that ran and exited non-zero is ok, with its `exit_code`.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar, runtime_checkable

T = TypeVar("T")

TOOLS = ("run_python", "run_shell", "read_file", "write_file", "list_dir")
# Host-side slack on top of a call's own timeout: the server's kill sweep and the reply's trip back.
REPLY_GRACE_S = 5.0

# Blocking sandbox work runs here; sized for many concurrent episodes (threads start lazily).
_EXECUTOR = ThreadPoolExecutor(max_workers=256, thread_name_prefix="reflow-sandbox")


class SandboxError(RuntimeError):
    """A sandbox could not be created or used (no engine, no image, a dead container)."""


class SandboxDied(SandboxError):
    """The sandbox (its container or its tool server) is gone; a pool replaces it."""


@dataclass(frozen=True)
class SandboxLimits:
    """Isolation settings. Docker enforces all of them; the process sandbox only some (see its docs)."""

    memory_mb: int = 1024  # the whole sandbox: tool server, calls and the tmpfs work dirs
    call_memory_mb: int = 512  # address space of one call's processes
    pids: int = 256
    cpus: float = 1.0
    work_mb: int = 256  # tmpfs at /work (the writable work dir)
    tmp_mb: int = 64  # tmpfs at /tmp
    file_mb: int = 64  # largest file one call may write
    call_timeout_s: float = 10.0  # default per call
    max_call_timeout_s: float = 600.0
    episode_timeout_s: float | None = None  # default per episode (pool.acquire can set it per lease)
    output_limit: int = 8192  # bytes kept per stream per call


@dataclass
class ToolOutput:
    """The outcome of one call into a sandbox."""

    tool: str
    ok: bool = True
    stdout: str = ""
    stderr: str = ""
    exit_code: int | None = None
    latency_s: float = 0.0
    truncated: bool = False
    timed_out: bool = False
    error: str | None = None
    data: Any = None
    server_latency_s: float | None = None

    @classmethod
    def failure(cls, tool: str, error: str, latency_s: float = 0.0) -> ToolOutput:
        return cls(tool, ok=False, error=error, latency_s=latency_s)


@runtime_checkable
class Sandbox(Protocol):
    """What callers hold: the awaitable calls (see the module docstring) and what a pool reads and sets."""

    limits: SandboxLimits
    uses: int  # episodes served (a pool replaces a sandbox after max_uses)
    closed: bool

    @property
    def kind(self) -> str: ...

    async def exec(
        self, cmd: str | Sequence[str], *, timeout_s: float | None = None, stdin: str = ""
    ) -> ToolOutput: ...

    async def run_tool(
        self, name: str, args: dict[str, Any] | None = None, *, timeout_s: float | None = None
    ) -> ToolOutput: ...

    async def upload(self, path: str, data: bytes | str) -> None: ...

    async def download(self, path: str, max_bytes: int = 16 << 20) -> bytes: ...

    async def close(self) -> None: ...

    async def is_alive(self) -> bool: ...

    def begin_episode(self, timeout_s: float | None = None) -> None: ...

    def ping_sync(self, timeout_s: float = 2.0) -> bool: ...

    def reset_sync(self) -> bool: ...

    def close_sync(self) -> None: ...


@runtime_checkable
class SandboxBackend(Protocol):
    """What a backend (a container, a bubblewrap process) supplies to the `ToolSandbox` that holds it."""

    kind: str
    id: str
    server_info: dict[str, Any]  # the tool server's hello reply

    @property
    def has_cgroup(self) -> bool:
        """Whether the kernel charges the sandbox's memory and processes to its limits."""
        ...

    def request(self, op: str, args: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """Send one request to the tool server and return its reply; SandboxDied if it is gone."""
        ...

    def exec_sync(
        self, sandbox: ToolSandbox, cmd: str | Sequence[str], *, timeout_s: float | None, stdin: str
    ) -> ToolOutput:
        """Run a plain command; `sandbox` gives the call's timeout and the lock that serialises calls."""
        ...

    def running(self) -> bool:
        """Whether the process or container and its tool server connection are still up (no round trip)."""
        ...

    def close(self) -> None:
        """Tear down (kill everything inside); called once."""
        ...


@dataclass
class _Episode:
    deadline: float | None = None
    timeout_s: float | None = None
    calls: int = 0
    started: float = field(default_factory=time.monotonic)


class ToolSandbox:
    """A sandbox as callers use it: the behaviour both backends share over the `backend` it holds.

    It owns per-call and per-episode time limits, the lock that serialises one sandbox's calls, the
    closed and dead handling, the tool calls and the async facade; the backend owns the process or
    container, its tool server connection, `exec` and the teardown."""

    def __init__(self, backend: SandboxBackend, limits: SandboxLimits | None = None) -> None:
        self.backend = backend
        self.limits = limits or SandboxLimits()
        self.uses = 0  # episodes served (a pool replaces a sandbox after max_uses)
        self.closed = False
        self.created = time.monotonic()
        self.lock = threading.Lock()  # held for one call: calls into one sandbox run one at a time
        self.episode = _Episode()
        self.begin_episode(self.limits.episode_timeout_s)

    @property
    def kind(self) -> str:
        return self.backend.kind

    @property
    def id(self) -> str:
        return self.backend.id

    @property
    def has_cgroup(self) -> bool:
        """Whether the kernel charges the sandbox's memory and processes to its limits."""
        return self.backend.has_cgroup

    @property
    def server_info(self) -> dict[str, Any]:
        return self.backend.server_info

    # ---- episodes -------------------------------------------------------------------------------------
    def begin_episode(self, timeout_s: float | None = None) -> None:
        """Start the clock of a new episode; calls after `timeout_s` seconds fail."""
        now = time.monotonic()
        self.episode = _Episode(now + timeout_s if timeout_s else None, timeout_s, 0, now)

    def call_timeout(self, timeout_s: float | None) -> tuple[float | None, str | None]:
        """The timeout a call gets (clipped to the episode's remaining time), or an error."""
        timeout = self.limits.call_timeout_s if timeout_s is None else float(timeout_s)
        timeout = min(max(timeout, 0.01), self.limits.max_call_timeout_s)
        if self.episode.deadline is not None:
            left = self.episode.deadline - time.monotonic()
            if left <= 0:
                return None, f"the episode's time limit of {self.episode.timeout_s:g}s is used up"
            timeout = min(timeout, left)
        return timeout, None

    # ---- the calls (blocking) -------------------------------------------------------------------------
    def run_tool_sync(
        self, name: str, args: dict[str, Any] | None = None, *, timeout_s: float | None = None
    ) -> ToolOutput:
        start = time.perf_counter()
        if name not in TOOLS:
            return ToolOutput.failure(name, f"unknown tool {name!r}; sandbox tools: {', '.join(TOOLS)}")
        args = dict(args or {})
        timeout, error = self.call_timeout(args.pop("timeout_s", timeout_s))
        if error:
            return ToolOutput.failure(name, error, time.perf_counter() - start)
        if name in ("run_python", "run_shell"):
            args["timeout_s"] = timeout
            args.setdefault("output_limit", self.limits.output_limit)
        reply = self.request(name, args, timeout)
        return self._output(name, reply, start)

    def request(self, op: str, args: dict[str, Any], timeout_s: float | None = None) -> dict[str, Any]:
        """One serialised round trip to the tool server; a failed reply (never an exception) on death."""
        timeout = (timeout_s or self.limits.call_timeout_s) + REPLY_GRACE_S
        with self.lock:
            if self.closed:
                return {"ok": False, "error": "the sandbox is closed"}
            self.episode.calls += 1
            try:
                return self.backend.request(op, args, timeout)
            except SandboxDied as e:
                return {"ok": False, "error": f"the sandbox died during the call ({e})", "dead": True}

    @staticmethod
    def _output(name: str, reply: dict[str, Any], start: float) -> ToolOutput:
        return ToolOutput(
            tool=name,
            ok=bool(reply.get("ok")),
            stdout=reply.get("stdout") or "",
            stderr=reply.get("stderr") or "",
            exit_code=reply.get("exit_code"),
            latency_s=time.perf_counter() - start,
            truncated=bool(reply.get("truncated")),
            timed_out=bool(reply.get("timed_out")),
            error=reply.get("error"),
            data=reply.get("data"),
            server_latency_s=reply.get("latency_s"),
        )

    def upload_sync(self, path: str, data: bytes | str) -> None:
        import base64

        blob = data.encode() if isinstance(data, str) else data
        args = {"path": path, "content": base64.b64encode(blob).decode(), "encoding": "base64"}
        reply = self.request("write_file", args)
        if not reply.get("ok"):
            raise SandboxError(reply.get("error") or "upload failed")

    def download_sync(self, path: str, max_bytes: int = 16 << 20) -> bytes:
        import base64

        reply = self.request("read_file", {"path": path, "max_bytes": max_bytes, "encoding": "base64"})
        if not reply.get("ok"):
            raise SandboxError(reply.get("error") or "download failed")
        return base64.b64decode(reply.get("data") or "")

    def ping_sync(self, timeout_s: float = 2.0) -> bool:
        if self.closed:
            return False
        reply = self.request("ping", {}, max(0.01, timeout_s - REPLY_GRACE_S))
        return bool(reply.get("ok"))

    def exec_sync(
        self, cmd: str | Sequence[str], *, timeout_s: float | None = None, stdin: str = ""
    ) -> ToolOutput:
        return self.backend.exec_sync(self, cmd, timeout_s=timeout_s, stdin=stdin)

    def is_alive_sync(self) -> bool:
        if self.closed or not self.backend.running():
            return False
        return self.ping_sync()

    def close_sync(self) -> None:
        """Tear the sandbox down (killing everything in it). Safe to call more than once."""
        if self.closed:
            return
        self.closed = True
        self.backend.close()

    def reset_sync(self) -> bool:
        """Kill every process and empty the writable dirs; False when the sandbox should be replaced."""
        reply = self.request("reset", {}, 10.0)
        self.begin_episode(self.limits.episode_timeout_s)
        return bool(reply.get("ok"))

    # ---- the protocol (async) -------------------------------------------------------------------------
    async def _in_thread(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(_EXECUTOR, functools.partial(fn, *args, **kwargs))

    async def exec(
        self, cmd: str | Sequence[str], *, timeout_s: float | None = None, stdin: str = ""
    ) -> ToolOutput:
        return await self._in_thread(self.exec_sync, cmd, timeout_s=timeout_s, stdin=stdin)

    async def run_tool(
        self, name: str, args: dict[str, Any] | None = None, *, timeout_s: float | None = None
    ) -> ToolOutput:
        return await self._in_thread(self.run_tool_sync, name, args, timeout_s=timeout_s)

    async def upload(self, path: str, data: bytes | str) -> None:
        await self._in_thread(self.upload_sync, path, data)

    async def download(self, path: str, max_bytes: int = 16 << 20) -> bytes:
        return await self._in_thread(self.download_sync, path, max_bytes)

    async def reset(self) -> bool:
        return await self._in_thread(self.reset_sync)

    async def close(self) -> None:
        await self._in_thread(self.close_sync)

    async def is_alive(self) -> bool:
        return await self._in_thread(self.is_alive_sync)

    def __repr__(self) -> str:
        return f"<{type(self.backend).__name__} {self.id[:12]}{' closed' if self.closed else ''}>"
