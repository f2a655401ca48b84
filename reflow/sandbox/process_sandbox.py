"""`ProcessSandbox`: bubblewrap namespaces plus rlimits, for machines without Docker. WEAKER than Docker.

What it does: new user, pid, network, ipc, uts and cgroup namespaces (`bwrap --unshare-all`), so code
inside sees only loopback, only its own processes and a fake uid; no further user namespaces
(`--disable-userns`); a seccomp filter that refuses ptrace, mounts, new namespaces, SysV IPC and a few
wide kernel surfaces (`reflow.sandbox.seccomp`); a read-only bind of the host's /usr (and nothing else
of the host's files but a few /etc files the loader needs); tmpfs at /work and /tmp with size caps; all
capabilities dropped, a new session (no terminal injection), death with its parent; when the host
process is root, bwrap itself runs as `nobody`, so the sandbox is not host root in any namespace. The
tool server is the namespace's PID 1 (unkillable from inside) and kills every process a call leaves;
each call gets rlimits: address space, CPU seconds, file size, number of processes. Where cgroups can
be made (root, or a delegated v2 subtree: `reflow.sandbox.cgroup`), the sandbox gets its own, with
the memory (tmpfs pages included) and pids limits; `has_cgroup` and `server_info["cgroup"]` say
whether it did, and `cgroup_problem()` why not.

What it does NOT do (Docker does): without a cgroup, no cap on the sandbox's total memory and no pids
cgroup (RLIMIT_NPROC per call stands in for it); no CPU share in either case; the host's /usr is
visible read-only (installed software, its versions, anything readable under /usr); it relies on the
kernel's namespace code as the boundary. Use Docker for untrusted code at scale.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Sequence
from functools import cache
from typing import Any

from reflow.sandbox import seccomp
from reflow.sandbox.base import SandboxDied, SandboxError, SandboxLimits, ToolOutput, ToolSandbox
from reflow.sandbox.cgroup import SandboxCgroup, cgroup_problem
from reflow.sandbox.channel import PipeStream, ToolServerClient, server_program

WORKDIR = "/work"
SANDBOX_UID = 10001
NOBODY = 65534
START_TIMEOUT_S = 15.0
PER_CALL_NPROC = 64
ETC_FILES = (
    "/etc/ld.so.cache",
    "/etc/ld.so.conf",
    "/etc/ld.so.conf.d",
    "/etc/localtime",
    "/etc/alternatives",
)
ENV = {
    "HOME": WORKDIR,
    "LANG": "C.UTF-8",
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "PYTHONHASHSEED": "0",
    "PYTHONDONTWRITEBYTECODE": "1",
}


def _python() -> str | None:
    """A Python 3 under /usr (the only host tree the sandbox sees)."""
    for candidate in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.access(candidate, os.X_OK):
            return candidate
    return None


def bwrap_argv(
    limits: SandboxLimits, passwd_fd: int, group_fd: int, seccomp_fd: int, options: Sequence[str] = ()
) -> list[str]:
    """The bubblewrap command line that starts the tool server in its namespaces."""
    python = _python()
    if python is None:
        raise SandboxError("no python3 under /usr for the process sandbox")
    argv = [
        "bwrap",
        *options,
        "--unshare-all",
        "--unshare-user",
        "--disable-userns",
        "--seccomp",
        str(seccomp_fd),
    ]
    argv += ["--die-with-parent", "--new-session", "--as-pid-1", "--cap-drop", "ALL"]
    argv += ["--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID), "--hostname", "sandbox"]
    argv += ["--ro-bind", "/usr", "/usr"]
    for top in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        path = "/" + top
        if os.path.islink(path):
            argv += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            argv += ["--ro-bind", path, path]
    for path in ETC_FILES:
        argv += ["--ro-bind-try", path, path]
    argv += ["--ro-bind-data", str(passwd_fd), "/etc/passwd", "--ro-bind-data", str(group_fd), "/etc/group"]
    argv += ["--proc", "/proc", "--dev", "/dev", "--size", str(16 << 20), "--tmpfs", "/dev/shm"]
    argv += ["--size", str(limits.work_mb << 20), "--tmpfs", WORKDIR]
    argv += ["--size", str(limits.tmp_mb << 20), "--tmpfs", "/tmp"]
    # bwrap's own root and /dev are unbounded tmpfs: read-only once set up (/work, /tmp, /dev/shm stay).
    argv += ["--remount-ro", "/dev", "--remount-ro", "/", "--chdir", WORKDIR, "--clearenv"]
    for key, value in ENV.items():
        argv += ["--setenv", key, value]
    return [*argv, python, "-s", "-c", server_program()]


def _data_fd(data: str | bytes) -> int:
    """A pipe's read end holding `data` (bwrap's --ro-bind-data and --seccomp read it)."""
    r, w = os.pipe()
    os.write(w, data.encode() if isinstance(data, str) else data)
    os.close(w)
    return r


def _start(
    limits: SandboxLimits, program: bytes, group: SandboxCgroup | None
) -> tuple[subprocess.Popen[bytes], Any]:
    """Start bwrap; with a cgroup, its sandboxed child joins the group before it runs anything."""
    passwd_fd = _data_fd(f"sandbox:x:{SANDBOX_UID}:{SANDBOX_UID}:sandbox:{WORKDIR}:/bin/sh\n")
    group_fd = _data_fd(f"sandbox:x:{SANDBOX_UID}:\n")
    seccomp_fd = _data_fd(program)
    fds = [passwd_fd, group_fd, seccomp_fd]
    options: list[str] = []
    if group is not None:  # bwrap tells the child's pid on info_w and waits for a byte on block_r
        info_r, info_w = os.pipe()
        block_r, block_w = os.pipe()
        fds += [info_w, block_r]
        options = ["--info-fd", str(info_w), "--block-fd", str(block_r)]
    stderr = tempfile.TemporaryFile()  # noqa: SIM115 (lives as long as the sandbox)
    as_nobody: dict[str, Any] = {}
    if os.geteuid() == 0:  # never host root, not even inside a user namespace
        as_nobody = {"user": NOBODY, "group": NOBODY, "extra_groups": []}
    try:
        proc = subprocess.Popen(
            bwrap_argv(limits, passwd_fd, group_fd, seccomp_fd, options),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            pass_fds=fds,
            cwd="/",
            start_new_session=True,
            **as_nobody,
        )
    except OSError as e:
        stderr.close()
        raise SandboxError(f"cannot start bwrap: {e}") from e
    finally:
        for fd in fds:
            os.close(fd)
    if group is not None:
        try:
            group.add(_child_pid(info_r, time.monotonic() + START_TIMEOUT_S))
            os.write(block_w, b"1")
        except (OSError, SandboxError) as e:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            stderr.close()
            raise SandboxError(f"the process sandbox could not join its cgroup: {e}") from e
        finally:
            os.close(info_r)
            os.close(block_w)
    return proc, stderr


def _child_pid(info_fd: int, deadline: float) -> int:
    """The sandboxed child's pid from bwrap's --info-fd JSON."""
    data = b""
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([info_fd], [], [], left)[0]:
            raise SandboxError("bwrap did not report its child in time")
        chunk = os.read(info_fd, 4096)
        if not chunk:
            raise SandboxError("bwrap exited before it started the sandbox")
        data += chunk
        with contextlib.suppress(ValueError):
            return int(json.loads(data)["child-pid"])


@cache
def bwrap_problem() -> str | None:
    """None when bubblewrap works here, else why not (a reason to skip, not an error)."""
    if shutil.which("bwrap") is None:
        return "bubblewrap is not installed (apt-get install -y bubblewrap)"
    try:
        sandbox = ProcessSandbox.create(SandboxLimits(work_mb=1, tmp_mb=1))
    except SandboxError as e:
        return str(e)
    sandbox.close_sync()
    return None


class ProcessSandbox:
    """The bubblewrap backend of a `ToolSandbox`; see the module docstring for what it lacks."""

    kind = "process"

    def __init__(
        self, proc: subprocess.Popen[bytes], stderr: Any, cgroup: SandboxCgroup | None = None
    ) -> None:
        self.proc = proc
        self.cgroup = cgroup
        self.id = f"bwrap-{proc.pid}"
        self._stderr = stderr
        assert proc.stdin is not None and proc.stdout is not None
        self.server = ToolServerClient(PipeStream(proc.stdin, proc.stdout), self.id)
        self.server_info: dict[str, Any] = {}

    @classmethod
    def create(cls, limits: SandboxLimits | None = None, *, pool: str = "") -> ToolSandbox:
        """Start bwrap and its tool server; the sandbox callers use holds this backend."""
        limits = limits or SandboxLimits()
        if shutil.which("bwrap") is None:
            raise SandboxError("bubblewrap (bwrap) is not installed")
        try:
            program = seccomp.filter_program()
        except ValueError as e:
            raise SandboxError(str(e)) from e
        group = None
        if cgroup_problem() is None:
            try:
                group = SandboxCgroup(limits.memory_mb << 20, limits.pids)
            except OSError as e:
                raise SandboxError(f"cannot make the sandbox's cgroup: {e}") from e
        try:
            proc, stderr = _start(limits, program, group)
        except BaseException:
            if group is not None:
                group.remove()
            raise
        backend = cls(proc, stderr, group)
        sandbox = ToolSandbox(backend, limits)
        hello = {
            "workdir": WORKDIR,
            "sweep": True,
            "wipe": [WORKDIR, "/tmp", "/dev/shm"],
            "memory_mb": limits.call_memory_mb,
            "file_limit": limits.file_mb << 20,
            # RLIMIT_NPROC counts every process of the host user all process sandboxes run as; it
            # stands in for the pids cgroup only where there is none.
            "nproc": None if group is not None else PER_CALL_NPROC,
            "env": {k: v for k, v in ENV.items() if k != "PYTHONHASHSEED"},
        }
        try:
            reply = backend.server.request("hello", hello, START_TIMEOUT_S)
            if not reply.get("ok"):
                raise SandboxError(f"the tool server refused to start: {reply.get('error')}")
        except (SandboxDied, SandboxError) as e:
            stderr.seek(0)
            detail = stderr.read().decode("utf-8", "replace").strip()[-500:]
            sandbox.close_sync()
            raise SandboxError(f"the process sandbox did not start: {e} {detail}".strip()) from e
        backend.server_info = {**(reply.get("data") or {}), "cgroup": group is not None}
        return sandbox

    @property
    def has_cgroup(self) -> bool:
        """Whether the kernel charges this sandbox's memory (tmpfs included) and processes to a limit."""
        return self.cgroup is not None

    def request(self, op: str, args: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        return self.server.request(op, args, timeout_s)

    def exec_sync(
        self, sandbox: ToolSandbox, cmd: str | Sequence[str], *, timeout_s: float | None, stdin: str
    ) -> ToolOutput:
        """Runs through the tool server (a bwrap namespace cannot be entered afresh like a container)."""
        command = cmd if isinstance(cmd, str) else " ".join(_quote(a) for a in cmd)
        out = sandbox.run_tool_sync("run_shell", {"command": command, "stdin": stdin}, timeout_s=timeout_s)
        out.tool = "exec"
        return out

    def running(self) -> bool:
        return self.proc.poll() is None and not self.server.broken

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # bwrap and, through --die-with-parent, the rest
        self.server.close()
        deadline = time.monotonic() + 5.0
        while self.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        self._stderr.close()
        if self.cgroup is not None:
            self.cgroup.remove()  # one still busy is removed when a later sandbox is made


def _quote(arg: str) -> str:
    import shlex

    return shlex.quote(arg)
