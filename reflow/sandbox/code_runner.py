"""Where an env runs model-written Python: a sandbox (docker, process) or a plain host subprocess.

This is how an env asks for a sandbox without knowing the sandbox's parts: `code_runner("docker" |
"process" | "subprocess" | "auto")` returns an object with `run_python(code, stdin=, timeout_s=,
output_limit=)` giving a `host_subprocess.ExecResult`, plus `end_episode()` (the sandbox goes back to its
pool to be reset) and `close()`. "auto" (the default, or what REFLOW_SANDBOX says) takes the strongest
kind that works here. A runner raises `RunnerError` when the infrastructure fails (no sandbox to be had,
the sandbox died); a program that fails or times out is an ordinary result.
"""

from __future__ import annotations

from typing import Protocol

from reflow.sandbox import host_subprocess
from reflow.sandbox.base import SandboxError
from reflow.sandbox.factory import backend_problem, resolve_kind, shared_pool
from reflow.sandbox.host_subprocess import ExecResult
from reflow.sandbox.pool import SandboxPool
from reflow.sandbox.session import SandboxSession

KINDS = ("docker", "process", "subprocess", "auto")


class RunnerError(RuntimeError):
    """The code could not be run (sandbox infrastructure), as opposed to a program that failed."""


class CodeRunner(Protocol):
    kind: str

    async def run_python(
        self, code: str, *, stdin: str = "", timeout_s: float = 5.0, output_limit: int = 8192
    ) -> ExecResult: ...

    async def end_episode(self) -> None: ...

    async def close(self) -> None: ...


class SubprocessRunner:
    """A host subprocess with rlimits (`host_subprocess`): no isolation, for trusted code or no sandbox."""

    kind = "subprocess"

    async def run_python(
        self, code: str, *, stdin: str = "", timeout_s: float = 5.0, output_limit: int = 8192
    ) -> ExecResult:
        return await host_subprocess.run_python(
            code, stdin=stdin, timeout_s=timeout_s, output_limit=output_limit
        )

    async def end_episode(self) -> None:
        pass

    async def close(self) -> None:
        pass


class SandboxCodeRunner:
    """Runs Python for an env in pooled sandboxes of one kind, through a `SandboxSession`."""

    def __init__(self, kind: str, pool: SandboxPool | None = None) -> None:
        self.kind = kind
        self._pool = pool
        self.session: SandboxSession | None = None  # made on first use: no pool for an env never run

    def _session(self) -> SandboxSession:
        if self.session is None:
            self.session = SandboxSession(self._pool or shared_pool(self.kind))
        return self.session

    async def run_python(
        self, code: str, *, stdin: str = "", timeout_s: float = 5.0, output_limit: int = 8192
    ) -> ExecResult:
        args = {"code": code, "stdin": stdin, "output_limit": output_limit}
        try:
            out = await self._session().run_tool("run_python", args, timeout_s=timeout_s)
        except SandboxError as e:
            raise RunnerError(f"no sandbox available: {e}") from e
        if not out.ok and not out.timed_out:
            raise RunnerError(out.error or "the sandbox failed")
        return ExecResult(out.stdout, out.stderr, out.exit_code, out.timed_out, out.truncated, out.latency_s)

    async def end_episode(self) -> None:
        if self.session is not None:
            await self.session.end_episode()

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()


def code_runner(kind: str | None = None) -> CodeRunner:
    """A runner of `kind`; "auto" or None picks the best available (REFLOW_SANDBOX overrides)."""
    if kind not in (*KINDS, None):
        raise ValueError(f"unknown sandbox kind {kind!r}; choose from {', '.join(KINDS)}")
    if kind == "subprocess":
        return SubprocessRunner()
    resolved = resolve_kind(kind)
    if resolved == "subprocess":
        return SubprocessRunner()
    problem = backend_problem(resolved)
    if problem:
        raise RunnerError(f"sandbox {resolved!r} is not available here: {problem}")
    return SandboxCodeRunner(resolved)
