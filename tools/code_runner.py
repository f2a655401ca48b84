"""Where an env runs model-written Python: a sandbox (docker, process) or a plain host subprocess.

Envs import only `reflow.env` and `reflow_tools`, so this is how one asks for a sandbox without knowing
the sandbox package: `code_runner("docker" | "process" | "subprocess" | "auto")` returns an object with
`run_python(code, stdin=, timeout_s=, output_limit=)` giving a `python_exec.ExecResult`, plus
`end_episode()` (the sandbox goes back to its pool to be reset) and `close()`. "auto" (the default, or
what REFLOW_SANDBOX says) takes the strongest kind that works here. A runner raises `RunnerError` when
the infrastructure fails (no sandbox to be had, the sandbox died); a program that fails or times out is
an ordinary result.
"""

from __future__ import annotations

from typing import Protocol

from reflow_tools import python_exec

KINDS = ("docker", "process", "subprocess", "auto")


class RunnerError(RuntimeError):
    """The code could not be run (sandbox infrastructure), as opposed to a program that failed."""


class CodeRunner(Protocol):
    kind: str

    async def run_python(
        self, code: str, *, stdin: str = "", timeout_s: float = 5.0, output_limit: int = 8192
    ) -> python_exec.ExecResult: ...

    async def end_episode(self) -> None: ...

    async def close(self) -> None: ...


class SubprocessRunner:
    """A host subprocess with rlimits (`python_exec`): no isolation, for trusted code or no sandbox."""

    kind = "subprocess"

    async def run_python(
        self, code: str, *, stdin: str = "", timeout_s: float = 5.0, output_limit: int = 8192
    ) -> python_exec.ExecResult:
        return await python_exec.run_python(code, stdin=stdin, timeout_s=timeout_s, output_limit=output_limit)

    async def end_episode(self) -> None:
        pass

    async def close(self) -> None:
        pass


def code_runner(kind: str | None = None) -> CodeRunner:
    """A runner of `kind`; "auto" or None picks the best available (REFLOW_SANDBOX overrides)."""
    if kind not in (*KINDS, None):
        raise ValueError(f"unknown sandbox kind {kind!r}; choose from {', '.join(KINDS)}")
    if kind == "subprocess":
        return SubprocessRunner()
    from reflow.sandbox.factory import backend_problem, resolve_kind

    resolved = resolve_kind(kind)
    if resolved == "subprocess":
        return SubprocessRunner()
    problem = backend_problem(resolved)
    if problem:
        raise RunnerError(f"sandbox {resolved!r} is not available here: {problem}")
    from reflow.sandbox.session import SandboxCodeRunner

    return SandboxCodeRunner(resolved)
