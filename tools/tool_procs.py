"""Running a tool call's process inside the sandbox: start it, feed it, collect its output, kill it.

Part of the in-sandbox tool server (see tool_server.py; both are sent into the sandbox together).
`Calls.run` starts the process with a launcher: `fork_python` forks the server's own interpreter and
runs the code as `__main__` (no interpreter start-up per call), `spawn` uses posix_spawn (vfork and
exec, several times cheaper than forking this interpreter to exec a program). Each call gets its own
session, rlimits (address space, CPU seconds, file size, no core dumps, optionally processes), an OOM
score that makes the kernel take it before the server, a wall-clock timeout and a cap on the bytes kept
from stdout and stderr (the rest is read and dropped, so a flood never blocks). After the call,
`sweep` kills every other process in the sandbox (`kill(-1, SIGKILL)` until none is left), so nothing
a call starts outlives it, forked-off daemons included.

Standard library only (Python 3.8 or newer).
"""

from __future__ import annotations

import contextlib
import io
import os
import resource
import selectors
import signal
import sys
import time
import traceback
import types

KILL_GRACE_S = 0.5
MAX_OUTPUT_LIMIT = 32 * 1024 * 1024
PR_SET_DUMPABLE = 4
PR_SET_CHILD_SUBREAPER = 36
IPC_RMID = 0


def prctl(option: int, value: int) -> bool:
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(option, value, 0, 0, 0) == 0
    except Exception:
        return False


def remove_ipc() -> list:
    """Remove every SysV IPC object of this IPC namespace; what could not be removed.

    Segments, message queues and semaphore sets outlive the process that made them (a segment keeps its
    memory), so without this one episode could pin memory for, or pass data to, the next."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
    except Exception as e:  # no ctypes: nothing can have made an object through it either
        return [f"ipc: {e}"]
    removers = {
        "shm": lambda i: libc.shmctl(i, IPC_RMID, None),
        "msg": lambda i: libc.msgctl(i, IPC_RMID, None),
        "sem": lambda i: libc.semctl(i, 0, IPC_RMID),
    }
    left = []
    for kind, remove in removers.items():
        for ipc_id in ipc_ids(kind):
            remove(ipc_id)
        left += [f"{kind} {i}" for i in ipc_ids(kind)]
    return [f"IPC objects left: {', '.join(left[:5])}"] if left else []


def ipc_ids(kind: str) -> list:
    """The ids in /proc/sysvipc/<kind> (the second column; the first line is a header)."""
    try:
        with open("/proc/sysvipc/" + kind) as f:
            return [int(line.split()[1]) for line in f.readlines()[1:] if line.strip()]
    except (OSError, ValueError, IndexError):
        return []


def exit_code(status: int) -> int:
    """A wait status as an exit code; -N when killed by signal N."""
    if os.WIFSIGNALED(status):
        return -os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


def oom_first(pid: str) -> None:
    """Make the OOM killer take this process (and what it starts) before the server."""
    with contextlib.suppress(OSError), open(f"/proc/{pid}/oom_score_adj", "w") as f:
        f.write("1000")


class Calls:
    """The process side of the server: one call at a time, and the sweep after it."""

    def __init__(self, config) -> None:
        self.config = config
        self.exited: dict = {}  # pid -> wait status of children reaped by a sweep
        self.wake_r, self.wake_w = os.pipe()
        for fd in (self.wake_r, self.wake_w):
            os.set_blocking(fd, False)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.set_wakeup_fd(self.wake_w, warn_on_full_buffer=False)

    # ---- processes ------------------------------------------------------------------------------------
    def _reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self.exited[pid] = status

    def others(self) -> list:
        me, found = os.getpid(), []
        try:
            names = os.listdir("/proc")
        except OSError:
            return found
        for name in names:
            if not name.isdigit() or int(name) in (1, me):
                continue
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    if f.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X"):
                        continue
            except (OSError, IndexError):
                continue
            found.append(int(name))
        return found

    def sweep(self) -> bool:
        """Kill every process in the sandbox but init and this server; True when none is left."""
        if not self.config.sweep:
            return True
        for attempt in range(400):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(-1, signal.SIGKILL)
            self._reap()
            if not self.others():
                return True
            time.sleep(min(0.001 * attempt, 0.02))
        return False

    def _limits(self, timeout_s: float, memory_mb: int) -> list:
        cpu = int(timeout_s) + 2  # CPU seconds only back up the wall-clock kill
        limits = [
            (resource.RLIMIT_CPU, (cpu, cpu + 1)),
            (resource.RLIMIT_FSIZE, (self.config.file_limit, self.config.file_limit)),
            (resource.RLIMIT_CORE, (0, 0)),
        ]
        if memory_mb:
            limits.append((resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20)))
        if self.config.nproc:
            limits.append((resource.RLIMIT_NPROC, (self.config.nproc, self.config.nproc)))
        return limits

    def fork_python(self, code: str, fds: tuple, workdir: str, limits: list) -> int:
        """A forked copy of this interpreter running `code` as `__main__` (see `run_main`)."""
        pid = os.fork()
        if pid == 0:
            try:
                signal.set_wakeup_fd(-1)
                for sig in (signal.SIGCHLD, signal.SIGINT):
                    signal.signal(sig, signal.SIG_DFL)
                os.setsid()
                for target, fd in enumerate(fds):
                    os.dup2(fd, target)
                os.closerange(3, 65536)
                os.chdir(workdir)
                os.environ.clear()
                os.environ.update(self.config.env)
                for which, value in limits:
                    with contextlib.suppress(ValueError, OSError):
                        resource.setrlimit(which, value)
                oom_first("self")
                run_main(code)
            except BaseException:
                with contextlib.suppress(BaseException):
                    os.write(2, traceback.format_exc().encode())
            os._exit(127)
        return pid

    def spawn(self, path: str, argv: list, fds: tuple, workdir: str, limits: list) -> int:
        """posix_spawn (vfork and exec: several times cheaper than fork and exec of this interpreter).

        The child inherits the soft limits from its first instruction; its hard limits (and CPU time)
        are lowered right after the spawn returns, while it is still starting up."""
        saved = []
        for which, (soft, _) in limits:
            if which != resource.RLIMIT_CPU:  # ours would count this server's own CPU time
                current = resource.getrlimit(which)
                saved.append((which, current))
                with contextlib.suppress(ValueError, OSError):
                    resource.setrlimit(which, (soft, current[1]))
        actions = [(os.POSIX_SPAWN_DUP2, fd, target) for target, fd in enumerate(fds)]
        try:
            os.chdir(workdir)
            pid = os.posix_spawn(
                path, argv, self.config.env, file_actions=actions, setsid=True,
                setsigdef=(signal.SIGPIPE, signal.SIGXFSZ),
            )  # fmt: skip
        finally:
            for which, value in saved:
                with contextlib.suppress(ValueError, OSError):
                    resource.setrlimit(which, value)
            os.chdir(self.config.workdir)
        for which, value in limits:
            with contextlib.suppress(ValueError, OSError):
                resource.prlimit(pid, which, value)
        oom_first(str(pid))
        return pid

    def run(self, launch, stdin: str, timeout_s: float, output_limit: int, memory_mb: int, cwd):
        """Start a call's process with `launch(fds, workdir, limits)` and collect what it writes."""
        start = time.monotonic()
        timeout_s = max(0.01, float(timeout_s))
        output_limit = max(0, min(int(output_limit), MAX_OUTPUT_LIMIT))
        workdir = os.path.join(self.config.workdir, cwd) if cwd else self.config.workdir
        if not os.path.isdir(workdir):
            return {"ok": False, "error": f"no such directory: {workdir}"}
        in_r, in_w = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        self._reap()
        try:
            pid = launch((in_r, out_w, err_w), workdir, self._limits(timeout_s, memory_mb))
        except OSError as e:
            for fd in (in_r, in_w, out_r, out_w, err_r, err_w):
                os.close(fd)
            return {"ok": False, "error": f"cannot start the process: {e}"}
        for fd in (in_r, out_w, err_w):
            os.close(fd)
        data = stdin.encode() if stdin else b""
        if not data:
            os.close(in_w)
        buffers = {out_r: bytearray(), err_r: bytearray()}
        truncated = False
        sel = selectors.DefaultSelector()
        for fd in (out_r, err_r, self.wake_r):
            os.set_blocking(fd, False)
            sel.register(fd, selectors.EVENT_READ)
        if data:
            os.set_blocking(in_w, False)
            sel.register(in_w, selectors.EVENT_WRITE)
        status, timed_out = None, False
        deadline = start + timeout_s

        def read(fd: int) -> bool:
            nonlocal truncated
            try:
                chunk = os.read(fd, 1 << 16)
            except BlockingIOError:
                return True
            if not chunk:
                sel.unregister(fd)
                return False
            buf = buffers[fd]
            room = output_limit - len(buf)
            if room > 0:
                buf += chunk[:room]
            if len(chunk) > max(room, 0):
                truncated = True
            return True

        open_pipes = {out_r, err_r}
        try:
            while True:
                if status is None:
                    if pid in self.exited:
                        status = self.exited.pop(pid)
                    else:
                        try:
                            done, st = os.waitpid(pid, os.WNOHANG)
                        except ChildProcessError:
                            done, st = pid, 0
                        if done:
                            status = st
                if status is not None:
                    break  # the call's own process ended: whatever it left running is killed below
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    timed_out = True
                    break
                for key, _ in sel.select(remaining):
                    fd = key.fd
                    if fd == self.wake_r:
                        try:
                            while os.read(fd, 512):
                                pass
                        except BlockingIOError:
                            pass
                    elif fd == in_w:
                        try:
                            data = data[os.write(fd, data[: 1 << 16]) :]
                        except BrokenPipeError:
                            data = b""
                        if not data:
                            sel.unregister(fd)
                            os.close(fd)
                            in_w = -1
                    elif fd in open_pipes and not read(fd):
                        open_pipes.discard(fd)
        finally:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
            swept = self.sweep()
            # Output still in the pipes arrives; nobody is left to hold them open (after a sweep).
            end = time.monotonic() + KILL_GRACE_S
            while open_pipes and time.monotonic() < end:
                for key, _ in sel.select(max(0.0, end - time.monotonic())):
                    if key.fd in open_pipes and not read(key.fd):
                        open_pipes.discard(key.fd)
            if status is None:
                if pid in self.exited:
                    status = self.exited.pop(pid)
                else:
                    try:
                        status = os.waitpid(pid, 0)[1]
                    except ChildProcessError:
                        status = None
            sel.close()
            for fd in (out_r, err_r, in_w):
                if fd >= 0:
                    with contextlib.suppress(OSError):
                        os.close(fd)
        reply = {
            "stdout": buffers[out_r].decode("utf-8", errors="replace"),
            "stderr": buffers[err_r].decode("utf-8", errors="replace"),
            "exit_code": None if status is None else exit_code(status),
            "timed_out": timed_out,
            "truncated": truncated,
        }
        if timed_out:
            reply["ok"] = False
            reply["error"] = (
                f"timed out after {timeout_s:g}s; the process and everything it started were killed"
            )
        if not swept:
            reply["ok"] = False
            reply["error"] = "processes started by the call could not all be killed"
        return reply


def run_main(code: str) -> None:
    """In a forked child: run `code` like `python3 main.py` would, then exit with its status."""
    import builtins
    import linecache

    stdin = open(0, "rb", closefd=False)  # noqa: SIM115 (the program's stdin for its whole life)
    sys.stdin = sys.__stdin__ = io.TextIOWrapper(stdin, encoding="utf-8")
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(
        io.FileIO(1, "w", closefd=False), encoding="utf-8", write_through=True
    )
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(
        io.FileIO(2, "w", closefd=False), encoding="utf-8", errors="backslashreplace", write_through=True
    )
    sys.argv = ["main.py"]
    main = types.ModuleType("__main__")
    main.__file__ = "main.py"
    main.__builtins__ = builtins
    sys.modules["__main__"] = main
    linecache.cache["main.py"] = (len(code), None, code.splitlines(True), "main.py")
    status = 0
    try:
        exec(compile(code, "main.py", "exec", dont_inherit=True), main.__dict__)
    except SystemExit as e:
        status = system_exit_status(e)
    except BaseException as e:
        tb = e.__traceback__.tb_next if e.__traceback__ is not None else None
        with contextlib.suppress(BaseException):
            traceback.print_exception(type(e), e, tb)
        status = 1
    try:
        threading = sys.modules.get("threading")
        if threading is not None:
            threading._shutdown()  # type: ignore[attr-defined]
        import atexit

        atexit._run_exitfuncs()
    except SystemExit as e:
        status = system_exit_status(e)
    except BaseException:
        pass
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(BaseException):
            stream.flush()
    os._exit(status & 0xFF)


def system_exit_status(e: SystemExit) -> int:
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    with contextlib.suppress(BaseException):
        print(e.code, file=sys.stderr)
    return 1
