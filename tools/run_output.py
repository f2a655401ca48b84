"""How a program run is shown to the model: how it ended, then its stdout and stderr."""

from __future__ import annotations


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
