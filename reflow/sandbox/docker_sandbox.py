"""`DockerSandbox`: a container on a real Docker engine, with the tool server as its init process.

Isolation, all on by default: no network (only loopback exists inside), memory (no swap), pids and CPU
limits, a read-only root with tmpfs work dirs (/work, /tmp, a small /dev/shm), a private IPC namespace
with small caps (`ipc_sysctls`), a non-root user, every capability dropped, no-new-privileges, no core
dumps, owner labels for the reaper. The tool server (`reflow_tools.in_sandbox`, sent as the `python3 -c`
program) is PID 1: code inside cannot kill it, and it reaps orphans and kills whatever a call leaves
running; a reset also removes the IPC objects and POSIX message queues a call left. The host talks to
it over one attach stream that stays open, so a tool call costs a round trip on that stream, not a
`docker exec`.

`exec` is a plain `docker exec` (a fresh process each time), kept as the baseline the benchmark compares
against and for commands that must not go through the tool server.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

from reflow.sandbox.base import SandboxDied, SandboxError, SandboxLimits, ToolOutput, ToolSandbox
from reflow.sandbox.channel import DockerStream, ToolServerClient, server_program
from reflow.sandbox.images import DEFAULT_IMAGE, SANDBOX_UID, docker_client
from reflow.sandbox.reaper import owner_labels

WORKDIR = "/work"
SERVER_ENV = {
    "HOME": WORKDIR,
    "LANG": "C.UTF-8",
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "PYTHONHASHSEED": "0",
    "PYTHONDONTWRITEBYTECODE": "1",
}
START_TIMEOUT_S = 30.0

_client: Any = None
_client_pid = 0


def shared_client() -> Any:
    """One Docker SDK client per process (its connection pool serves every sandbox)."""
    global _client, _client_pid
    if _client is None or _client_pid != os.getpid():  # a forked child must not share the sockets
        _client, _client_pid = None, os.getpid()
        from reflow.sandbox.images import BuildError

        try:
            _client = docker_client(timeout=60)
        except BuildError as e:
            raise SandboxError(str(e)) from e
    return _client


def ipc_sysctls(limits: SandboxLimits) -> dict[str, str]:
    """Caps on the container's own IPC namespace (these sysctls are per namespace).

    A SysV segment outlives its process and keeps its memory; with `shm_rmid_forced` it goes when its
    last user exits, so a call cannot leave memory pinned (the reset removes message queues and
    semaphores). Every size is within the container's memory limit."""
    memory = limits.memory_mb << 20
    return {
        "kernel.shm_rmid_forced": "1",
        "kernel.shmmax": str(memory),
        "kernel.shmall": str(memory // 4096),
        "kernel.shmmni": "64",
        "kernel.msgmni": "64",
        "fs.mqueue.queues_max": "64",
    }


def container_config(image: str, limits: SandboxLimits, labels: dict[str, str]) -> dict[str, Any]:
    """The keyword arguments of `containers.create`: every isolation setting in one place."""
    from docker.types import LogConfig, Ulimit

    uid = SANDBOX_UID
    return {
        "image": image,
        "command": ["python3", "-s", "-c", server_program()],
        "stdin_open": True,
        "tty": False,
        "user": f"{uid}:{uid}",
        "working_dir": WORKDIR,
        "environment": SERVER_ENV,
        "hostname": "sandbox",
        "network_mode": "none",
        "read_only": True,
        "tmpfs": {
            WORKDIR: f"rw,exec,nosuid,nodev,size={limits.work_mb}m,uid={uid},gid={uid},mode=0755",
            "/tmp": f"rw,exec,nosuid,nodev,size={limits.tmp_mb}m,mode=1777",
        },
        "shm_size": "16m",
        "sysctls": ipc_sysctls(limits),
        "mem_limit": f"{limits.memory_mb}m",
        "memswap_limit": f"{limits.memory_mb}m",
        "pids_limit": limits.pids,
        "nano_cpus": int(limits.cpus * 1e9),
        "cap_drop": ["ALL"],
        "security_opt": ["no-new-privileges:true"],
        "ulimits": [Ulimit(name="core", soft=0, hard=0), Ulimit(name="nofile", soft=1024, hard=1024)],
        "log_config": LogConfig(type="none"),
        "labels": labels,
        "detach": True,
    }


class DockerSandbox:
    """One container, the backend of a `ToolSandbox`; see the module docstring. Create with
    `DockerSandbox.create()` (which returns the `ToolSandbox`) or from a pool."""

    kind = "docker"
    has_cgroup = True  # the container's own

    def __init__(self, container: Any, client: Any) -> None:
        self.container = container
        self.client = client
        self.id = container.id
        self.server: ToolServerClient | None = None
        self.server_info: dict[str, Any] = {}

    @classmethod
    def create(
        cls,
        image: str = DEFAULT_IMAGE,
        limits: SandboxLimits | None = None,
        *,
        client: Any = None,
        pool: str = "",
    ) -> ToolSandbox:
        """Start a container and its tool server (a cold start: about a `docker run`)."""
        limits = limits or SandboxLimits()
        client = client or shared_client()
        try:
            container = client.containers.create(**container_config(image, limits, owner_labels(pool)))
        except Exception as e:
            hint = " (build it: reflow sandbox build)" if "No such image" in str(e) else ""
            raise SandboxError(f"cannot create a sandbox from {image}: {e}{hint}") from e
        backend = cls(container, client)
        sandbox = ToolSandbox(backend, limits)
        try:
            backend._start(limits)
        except BaseException:
            sandbox.close_sync()
            raise
        return sandbox

    def _start(self, limits: SandboxLimits) -> None:
        params = {"stdin": 1, "stdout": 1, "stderr": 1, "stream": 1}
        try:
            sock = self.client.api.attach_socket(self.id, params=params)
            self.container.start()
        except Exception as e:
            raise SandboxError(f"cannot start sandbox {self.id[:12]}: {e}") from e
        self.server = ToolServerClient(DockerStream(sock), f"sandbox {self.id[:12]}")
        hello = {
            "workdir": WORKDIR,
            "sweep": True,
            "wipe": [WORKDIR, "/tmp", "/dev/shm", "/dev/mqueue"],
            "memory_mb": limits.call_memory_mb,
            "file_limit": limits.file_mb << 20,
            "env": {k: v for k, v in SERVER_ENV.items() if k != "PYTHONHASHSEED"},
        }
        try:
            reply = self.server.request("hello", hello, START_TIMEOUT_S)
        except SandboxDied as e:
            raise SandboxError(f"the tool server did not start: {e}") from e
        if not reply.get("ok"):
            raise SandboxError(f"the tool server refused to start: {reply.get('error')}")
        self.server_info = reply.get("data") or {}

    def request(self, op: str, args: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        if self.server is None:
            raise SandboxDied("not started")
        return self.server.request(op, args, timeout_s)

    def exec_sync(
        self, sandbox: ToolSandbox, cmd: str | Sequence[str], *, timeout_s: float | None, stdin: str
    ) -> ToolOutput:
        """A plain `docker exec` as the sandbox user, killed after the timeout (`timeout -s KILL`)."""
        start = time.perf_counter()
        timeout, error = sandbox.call_timeout(timeout_s)
        if error:
            return ToolOutput.failure("exec", error)
        argv = ["sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)
        argv = ["timeout", "-s", "KILL", f"{timeout:.3f}", *argv]
        api = self.client.api
        with sandbox.lock:
            try:
                exec_id = api.exec_create(
                    self.id, argv, stdin=bool(stdin), user=f"{SANDBOX_UID}:{SANDBOX_UID}", workdir=WORKDIR
                )["Id"]
                stream = DockerStream(api.exec_start(exec_id, socket=True))
                try:
                    if stdin:
                        stream.send(stdin.encode())
                    stream.close_stdin()
                    deadline = time.monotonic() + timeout + 5.0
                    out, err, truncated = stream.read_all(deadline, sandbox.limits.output_limit)
                finally:
                    stream.close()
                exit_code = api.exec_inspect(exec_id).get("ExitCode")
            except TimeoutError:
                return ToolOutput.failure(
                    "exec", "docker exec did not finish in time", time.perf_counter() - start
                )
            except Exception as e:
                return ToolOutput.failure("exec", f"docker exec failed: {e}", time.perf_counter() - start)
        latency = time.perf_counter() - start
        timed_out = exit_code == 137 and latency >= timeout
        return ToolOutput(
            "exec",
            ok=not timed_out,
            stdout=out.decode("utf-8", "replace"),
            stderr=err.decode("utf-8", "replace"),
            exit_code=-9 if timed_out else exit_code,
            latency_s=latency,
            truncated=truncated,
            timed_out=timed_out,
            error=f"timed out after {timeout:g}s" if timed_out else None,
        )

    def running(self) -> bool:
        return self.server is not None and not self.server.broken

    def close(self) -> None:
        """Remove the container (killing everything in it)."""
        if self.server is not None:
            self.server.close()
        try:
            self.container.remove(force=True, v=True)
        except Exception as e:
            if "No such container" not in str(e) and "already in progress" not in str(e):
                raise SandboxError(f"cannot remove sandbox {self.id[:12]}: {e}") from e
