"""Running a tool call's process inside the sandbox: start it, feed it, collect its output, kill it.

Part of the in-sandbox tool server (see server.py; both are sent into the sandbox together).
`Calls.run` starts the process with a launcher: `spawn` uses posix_spawn (vfork and exec, several
times cheaper than forking this interpreter to exec a program); `spawn_python` spawns a new interpreter
that runs the code as `__main__` (never a fork of the server, whose memory holds earlier calls' data). Each call gets its own
session, rlimits (address space, CPU seconds, file size, no core dumps, optionally processes), an OOM
score that makes the kernel take it before the server, a wall-clock timeout and a cap on the bytes kept
from stdout and stderr (the rest is read and dropped, so a flood never blocks). After the call,
`sweep` kills every other process in the sandbox (`kill(-1, SIGKILL)` until none is left), so nothing
a call starts outlives it, forked-off daemons included.

Standard library only (Python 3.8 or newer).
"""

from __future__ import annotations

import contextlib
import os
import resource
import selectors
import signal
import sys
import time

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

    def spawn_python(self, code: str, fds: tuple, workdir: str, limits: list) -> int:
        """A new interpreter running `code` as `__main__` (see RUNNER); the code comes on fd 3.

        Not a fork of this server: a fork inherits the server's heap, where earlier calls' programs
        and stdin linger (an earlier episode's, another client's), readable from the child's memory."""
        memfd = os.memfd_create("main.py", os.MFD_CLOEXEC)
        try:
            view = memoryview(code.encode("utf-8", "surrogatepass"))
            while view:
                view = view[os.write(memfd, view) :]
            os.lseek(memfd, 0, os.SEEK_SET)
            return self.spawn(sys.executable, ["python3", "-s", "-c", RUNNER], (*fds, memfd), workdir, limits)
        finally:
            os.close(memfd)

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


# The program a call's fresh interpreter runs: `code` from fd 3 as `__main__`, like `python3 main.py`
# would (a traceback without this runner's frame, the exit status of SystemExit).
RUNNER = r"""
import sys
if sys.path and sys.path[0] == "":  # the work dir: nothing may be imported from it before the code runs
    del sys.path[0]
import os, types
chunks = []
while True:
    chunk = os.read(3, 1 << 20)
    if not chunk:
        break
    chunks.append(chunk)
os.close(3)
code = b"".join(chunks).decode("utf-8", "surrogatepass")
del chunks, chunk
main = types.ModuleType("__main__")
main.__file__ = "main.py"
main.__builtins__ = __builtins__
sys.modules["__main__"] = main
sys.argv = ["main.py"]
try:
    exec(compile(code, "main.py", "exec", dont_inherit=True), main.__dict__)
except SystemExit:
    raise
except BaseException as e:
    import linecache, traceback
    linecache.cache["main.py"] = (len(code), None, code.splitlines(True), "main.py")
    traceback.print_exception(type(e), e, e.__traceback__.tb_next)
    sys.exit(1)
"""
