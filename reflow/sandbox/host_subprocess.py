"""The "subprocess" kind, which is no sandbox: run a Python program in a host child process with
resource limits, and capture what it prints.

This is a subprocess with rlimits, NOT a security sandbox. The program runs as the same user, sees the
same filesystem and network, and can leave its process group (setsid) to outlive the time limit.
The limits guard against accidents (infinite loops, runaway memory, floods of output), not
against hostile code. The Docker sandbox is what PyCode-v0 uses for untrusted code; this is its last fallback
(`code_runner`).

Each run gets a fresh temporary working directory (deleted afterwards) and a minimal environment, and
starts a new session so that the whole process group can be killed on timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import resource
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass

FILE_SIZE_LIMIT = 16 * 1024 * 1024
KILL_GRACE_S = 1.0


@dataclass
class ExecResult:
    """What a run produced. `exit_code` is negative (-signal) when the process was killed."""

    stdout: str
    stderr: str
    exit_code: int | None
    timed_out: bool
    truncated: bool
    latency_s: float


class _Capture(asyncio.SubprocessProtocol):
    """Keeps the first `limit` bytes of stdout and stderr and discards the rest as it arrives."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.buffers = {1: bytearray(), 2: bytearray()}
        self.truncated = False
        loop = asyncio.get_running_loop()
        self.exited: asyncio.Future[None] = loop.create_future()
        self.closed: asyncio.Future[None] = loop.create_future()

    def pipe_data_received(self, fd: int, data: bytes | str) -> None:
        buf = self.buffers[fd]
        room = self.limit - len(buf)
        if room > 0:
            buf += data[:room]  # type: ignore[operator]
        if len(data) > max(room, 0):
            self.truncated = True

    def process_exited(self) -> None:
        if not self.exited.done():
            self.exited.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)


def _limits(timeout_s: float, memory_mb: int) -> None:
    """Runs in the child between fork and exec."""
    cpu = max(1, math.ceil(timeout_s)) + 1  # CPU time only backs up the wall-clock kill
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    memory = memory_mb * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_SIZE_LIMIT, FILE_SIZE_LIMIT))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    # No RLIMIT_NPROC: it counts every process of the user (a fixed value breaks on a busy host) and
    # root ignores it. A fork bomb is stopped by the process-group kill; the Docker sandbox caps pids.


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _environment(workdir: str) -> dict[str, str]:
    # Not -I: it implies -E, which would drop PYTHONHASHSEED. Building the environment from scratch
    # keeps PYTHONPATH, PYTHONSTARTUP etc. of the host out instead.
    return {
        "PATH": os.defpath,
        "HOME": workdir,
        "TMPDIR": workdir,
        "LANG": "C.UTF-8",
        "PYTHONHASHSEED": "0",
        "PYTHONNOUSERSITE": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONIOENCODING": "utf-8",
        "PYTHONUNBUFFERED": "1",
    }


async def run_python(
    code: str,
    *,
    stdin: str = "",
    timeout_s: float = 5.0,
    output_limit: int = 8192,
    memory_mb: int = 512,
) -> ExecResult:
    """Run `code` as a Python program; keep at most `output_limit` bytes of stdout and of stderr.

    The program is killed (with its whole process group) after `timeout_s` seconds of wall-clock time.
    """
    start = time.perf_counter()
    workdir = tempfile.mkdtemp(prefix="reflow-py-")
    try:
        script = os.path.join(workdir, "main.py")
        with open(script, "w", encoding="utf-8") as f:
            f.write(code)
        flags = ["-s", "-P"] if sys.version_info >= (3, 11) else ["-s"]
        loop = asyncio.get_running_loop()
        transport, capture = await loop.subprocess_exec(
            lambda: _Capture(output_limit),
            sys.executable,
            *flags,
            script,
            stdin=asyncio.subprocess.PIPE if stdin else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            cwd=workdir,
            env=_environment(workdir),
            start_new_session=True,
            preexec_fn=lambda: _limits(timeout_s, memory_mb),
        )
        pgid = transport.get_pid()  # start_new_session: the child leads its own group
        try:
            try:
                if stdin:
                    pipe = transport.get_pipe_transport(0)
                    # Buffered by the loop, so a child that never reads stdin cannot block us.
                    pipe.write(stdin.encode("utf-8"))
                    pipe.write_eof()
                done, _ = await asyncio.wait({capture.exited}, timeout=timeout_s)
                timed_out = not done
            finally:
                # Also on a normal exit or a cancellation: nothing of the group may outlive the run.
                _kill_group(pgid)
            # Output already in the pipes still arrives; a process that left the group may hold them open.
            await asyncio.wait({capture.exited, capture.closed}, timeout=KILL_GRACE_S)
            exit_code = transport.get_returncode()
        finally:
            transport.close()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return ExecResult(
        stdout=capture.buffers[1].decode("utf-8", errors="replace"),
        # Tracebacks name the script by its path; without the random directory they are reproducible.
        stderr=capture.buffers[2].decode("utf-8", errors="replace").replace(workdir + os.sep, ""),
        exit_code=exit_code,
        timed_out=timed_out,
        truncated=capture.truncated,
        latency_s=time.perf_counter() - start,
    )
