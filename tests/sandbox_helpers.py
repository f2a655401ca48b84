"""Shared pieces of the sandbox tests: small limits (so the bombs hit them fast) and a backend matrix."""

from __future__ import annotations

import pytest

from reflow.sandbox import BaseSandbox, SandboxLimits, make_sandbox

# Small enough that every bomb hits a limit in well under a second.
LIMITS = SandboxLimits(
    memory_mb=384, call_memory_mb=192, pids=96, work_mb=32, tmp_mb=16, file_mb=24, call_timeout_s=5.0
)

BACKENDS = [
    pytest.param("docker", marks=pytest.mark.docker, id="docker"),
    pytest.param("process", marks=pytest.mark.bwrap, id="process"),
]


def start(kind: str, limits: SandboxLimits = LIMITS) -> BaseSandbox:
    return make_sandbox(kind, limits, pool="tests")


def healthy(sandbox: BaseSandbox, boot: str | None = None) -> None:
    """The sandbox answers normally, nothing is left running in it, and (given `boot`) the same server."""
    out = sandbox.run_tool_sync("run_python", {"code": "print('ok')"}, timeout_s=10)
    assert out.ok and out.stdout == "ok\n" and out.exit_code == 0, out
    ping = sandbox.request("ping", {})
    assert ping["ok"] and ping["data"]["processes"] == 0, ping
    if boot is not None:
        assert ping["data"]["boot"] == boot, "the tool server was restarted"


def boot_of(sandbox: BaseSandbox) -> str:
    return sandbox.request("ping", {})["data"]["boot"]
