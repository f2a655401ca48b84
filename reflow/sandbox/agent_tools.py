"""The sandbox's tools as `reflow.env.Tool`s, for envs that hand the agent a whole sandbox.

`sandbox_tools(session)` gives run_python, run_shell, read_file, write_file and list_dir, each bound to
the session's sandbox of the current episode (acquired on the first call). A program's result is the
model-facing text (exit code, stdout, stderr, a truncation note); a call that could not do what was
asked (a timeout, a missing file, the episode's time used up, the sandbox dying) is a `ToolError`, which
the env API turns into an error message to the model.
"""

from __future__ import annotations

from typing import Any

from reflow.env import Tool, ToolError, ToolResult
from reflow.sandbox.base import ToolOutput
from reflow.sandbox.session import SandboxSession


def describe_run(
    *,
    exit_code: int | None,
    stdout: str,
    stderr: str,
    truncated: bool,
    timed_out: bool = False,
    timeout_s: float | None = None,
    output_limit: int | None = None,
) -> str:
    """How a program run is shown to the model: how it ended, then its stdout and stderr."""
    if timed_out:
        head = f"timed out after {timeout_s:g}s (killed)" if timeout_s is not None else "timed out (killed)"
    else:
        head = f"exit code: {exit_code}"
    parts = [head]
    if stdout:
        parts.append("stdout:\n" + stdout)
    if stderr:
        parts.append("stderr:\n" + stderr)
    if not stdout and not stderr:
        parts.append("(no output)")
    if truncated:
        parts.append(
            f"[output truncated to {output_limit} bytes per stream]" if output_limit else "[output truncated]"
        )
    return "".join(p if p.endswith("\n") else p + "\n" for p in parts)


def describe(out: ToolOutput) -> str:
    """What the model sees of a run: how it ended, then stdout and stderr."""
    return describe_run(
        exit_code=out.exit_code, stdout=out.stdout, stderr=out.stderr, truncated=out.truncated
    )


def _result(out: ToolOutput, content: str | None = None) -> ToolResult:
    if not out.ok:
        partial = f"\n{describe(out)}" if out.timed_out and (out.stdout or out.stderr) else ""
        raise ToolError((out.error or "the call failed") + partial)
    text = describe(out) if content is None else content
    return ToolResult("", out.tool, text, exit_code=out.exit_code, truncated=out.truncated)


def sandbox_tools(session: SandboxSession, *, timeout_s: float | None = None) -> list[Tool]:
    """The five sandbox tools, bound to `session` (per-call `timeout_s`, default the sandbox's)."""

    async def call(name: str, args: dict[str, Any]) -> ToolOutput:
        return await session.run_tool(name, args, timeout_s=timeout_s)

    async def run_python(code: str, stdin: str = "") -> ToolResult:
        """Run a Python program in the sandbox and return its exit code, stdout and stderr.

        Args:
            code: the complete program; print what you want to see.
            stdin: text given to the program on standard input.
        """
        return _result(await call("run_python", {"code": code, "stdin": stdin}))

    async def run_shell(command: str, stdin: str = "") -> ToolResult:
        """Run a shell command (sh -c) in the sandbox's work dir and return its exit code, stdout and stderr.

        Args:
            command: the command line.
            stdin: text given to the command on standard input.
        """
        return _result(await call("run_shell", {"command": command, "stdin": stdin}))

    async def read_file(path: str) -> ToolResult:
        """Read a text file of the sandbox.

        Args:
            path: the file, relative to the work dir or absolute.
        """
        out = await call("read_file", {"path": path})
        return _result(out, out.stdout + ("\n[file truncated]" if out.truncated else ""))

    async def write_file(path: str, content: str) -> ToolResult:
        """Write a text file in the sandbox (parent directories are made), replacing what was there.

        Args:
            path: the file, relative to the work dir or absolute.
            content: the whole new content.
        """
        out = await call("write_file", {"path": path, "content": content})
        return _result(out, f"wrote {out.data['bytes'] if out.ok else 0} bytes to {path}")

    async def list_dir(path: str = ".", recursive: bool = False) -> ToolResult:
        """List a directory of the sandbox (directories end with /).

        Args:
            path: the directory, relative to the work dir or absolute.
            recursive: also list everything below it.
        """
        out = await call("list_dir", {"path": path, "recursive": recursive})
        return _result(out, out.stdout or "(empty)")

    return [Tool.from_function(fn) for fn in (run_python, run_shell, read_file, write_file, list_dir)]
