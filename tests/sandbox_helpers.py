"""Shared pieces of the sandbox tests: small limits (so the bombs hit them fast) and a backend matrix."""

from __future__ import annotations

import pytest

from reflow.sandbox import SandboxLimits, ToolSandbox, make_sandbox

# Small enough that every bomb hits a limit in well under a second.
LIMITS = SandboxLimits(
    memory_mb=384, call_memory_mb=192, pids=96, work_mb=32, tmp_mb=16, file_mb=24, call_timeout_s=5.0
)

BACKENDS = [
    pytest.param("docker", marks=pytest.mark.docker, id="docker"),
    pytest.param("process", marks=pytest.mark.bwrap, id="process"),
]


def start(kind: str, limits: SandboxLimits = LIMITS) -> ToolSandbox:
    return make_sandbox(kind, limits, pool="tests")


def healthy(sandbox: ToolSandbox, boot: str | None = None) -> None:
    """The sandbox answers normally, nothing is left running in it, and (given `boot`) the same server."""
    out = sandbox.run_tool_sync("run_python", {"code": "print('ok')"}, timeout_s=10)
    assert out.ok and out.stdout == "ok\n" and out.exit_code == 0, out
    ping = sandbox.request("ping", {})
    assert ping["ok"] and ping["data"]["processes"] == 0, ping
    if boot is not None:
        assert ping["data"]["boot"] == boot, "the tool server was restarted"


def boot_of(sandbox: ToolSandbox) -> str:
    return sandbox.request("ping", {})["data"]["boot"]


# The hostile-program suites share one sandbox per backend and module; each test starts it reset.
# Test modules import these two (as `sandbox_fixture, boot_fixture`); tests ask for `sandbox`, `boot`.
@pytest.fixture(scope="module", params=BACKENDS, name="sandbox")
def sandbox_fixture(request):
    sb = start(request.param)
    yield sb
    sb.close_sync()


@pytest.fixture(name="boot")
def boot_fixture(sandbox):
    """The server's identity before the test; `healthy(sandbox, boot)` checks it is unchanged after."""
    assert sandbox.reset_sync()
    return boot_of(sandbox)


def py(sandbox: ToolSandbox, code: str, timeout_s: float = 5.0, **args):
    return sandbox.run_tool_sync("run_python", {"code": code, **args}, timeout_s=timeout_s)


def sh(sandbox: ToolSandbox, command: str, timeout_s: float = 5.0, **args):
    return sandbox.run_tool_sync("run_shell", {"command": command, **args}, timeout_s=timeout_s)
