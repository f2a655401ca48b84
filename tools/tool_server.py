"""The in-sandbox tool server: one long-lived process that runs tool calls sent as JSON lines.

It runs inside a sandbox (a Docker container, a bubblewrap namespace) as the sandbox's init, PID 1, so
code it runs cannot kill it: the kernel drops signals sent to a namespace's init from inside unless it
handles them, and `kill(-1)` spares it. The host sends one JSON object per line on stdin and reads one
JSON object per line on stdout, so a call costs a pipe round trip instead of a `docker exec`.

Requests: {"id": n, "op": NAME, "args": {...}}. The first must be `hello` (its args configure the
server: work dir, whether to sweep, what to wipe on reset). Ops: hello, ping, run_python, run_shell,
read_file, write_file, list_dir, reset, shutdown. Every reply has id, ok, stdout, stderr, exit_code,
timed_out, truncated, latency_s, error (a message for the model when ok is false) and data.

`run_python` forks this interpreter (no interpreter start-up per call) and runs the code as `__main__`
of a fresh module, named main.py in tracebacks; `run_shell` forks and execs /bin/sh -c. Each call runs
in its own session with rlimits (address space, CPU seconds, file size, no core dumps), a wall-clock
timeout and a cap on the bytes kept from stdout and stderr (the rest is read and dropped, so a flood
never blocks). After every call, "sweep" kills every other process in the sandbox (`kill(-1, SIGKILL)`
until none is left), so nothing a call starts outlives it, forked-off daemons included.

Standard library only; runs on the image's Python 3 (3.8 or newer). The file is sent to the sandbox as
the program text of `python3 -c`, so the image never needs rebuilding when it changes.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import io
import json
import os
import resource
import selectors
import signal
import stat
import sys
import time
import traceback
import types

PROTOCOL = 1
KILL_GRACE_S = 0.5
MAX_OUTPUT_LIMIT = 32 * 1024 * 1024
MAX_LIST_ENTRIES = 2000
PR_SET_DUMPABLE = 4
PR_SET_CHILD_SUBREAPER = 36


def _prctl(option: int, value: int) -> bool:
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(option, value, 0, 0, 0) == 0
    except Exception:
        return False


def _exit_code(status: int) -> int:
    """A wait status as an exit code; -N when killed by signal N."""
    if os.WIFSIGNALED(status):
        return -os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


class Config:
    def __init__(self, args: dict) -> None:
        self.workdir = args.get("workdir") or os.getcwd()
        self.sweep = bool(args.get("sweep", False))
        self.wipe = list(args.get("wipe", []))
        self.nproc = args.get("nproc")  # per-call RLIMIT_NPROC; None where a pids cgroup does the job
        self.memory_mb = int(args.get("memory_mb", 512))
        self.file_limit = int(args.get("file_limit", 64 * 1024 * 1024))
        self.env = dict(args.get("env") or {})
        self.env.setdefault("PATH", "/usr/local/bin:/usr/bin:/bin")
        self.env.setdefault("HOME", self.workdir)
        self.env.setdefault("TMPDIR", "/tmp")
        self.env.setdefault("LANG", "C.UTF-8")
        for key, value in (
            ("PYTHONHASHSEED", "0"),
            ("PYTHONNOUSERSITE", "1"),
            ("PYTHONDONTWRITEBYTECODE", "1"),
            ("PYTHONIOENCODING", "utf-8"),
            ("PYTHONUNBUFFERED", "1"),
        ):
            self.env.setdefault(key, value)


class ToolServer:
    def __init__(self, infd: int = 0, outfd: int = 1) -> None:
        self.infd, self.outfd = infd, outfd
        self.config = Config({})
        self.boot = os.urandom(8).hex()  # tells a restarted server from the one that was there
        self.exited: dict = {}  # pid -> wait status of children reaped by a sweep
        self.wake_r, self.wake_w = os.pipe()
        for fd in (self.wake_r, self.wake_w):
            os.set_blocking(fd, False)
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # as init, a signal without a handler is dropped
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.set_wakeup_fd(self.wake_w, warn_on_full_buffer=False)
        _prctl(PR_SET_DUMPABLE, 0)  # /proc/<pid>/fd and ptrace closed to the code we run
        _prctl(PR_SET_CHILD_SUBREAPER, 1)  # orphans of a call come back to us (when we are not init)

    # ---- the loop -------------------------------------------------------------------------------------
    def serve(self) -> None:
        reader = open(self.infd, "rb", buffering=1 << 16, closefd=False)  # noqa: SIM115
        while True:
            line = reader.readline()
            if not line:
                return
            if not line.strip():
                continue
            start = time.monotonic()
            try:
                request = json.loads(line)
                rid, op, args = request.get("id"), request.get("op"), request.get("args") or {}
            except (ValueError, AttributeError) as e:
                self.reply({"id": None, "ok": False, "error": f"bad request: {e}"}, start)
                continue
            try:
                handler = getattr(self, "op_" + str(op), None)
                reply = {"ok": False, "error": f"unknown op {op!r}"} if handler is None else handler(**args)
            except TypeError as e:
                reply = {"ok": False, "error": f"bad arguments for {op}: {e}"}
            except Exception as e:  # a bug here must not take the server down
                reply = {"ok": False, "error": f"tool server error in {op}: {type(e).__name__}: {e}"}
            reply["id"] = rid
            self.reply(reply, start)
            if op == "shutdown":
                return

    def reply(self, reply: dict, start: float) -> None:
        base = {"ok": True, "stdout": "", "stderr": "", "exit_code": None, "timed_out": False}
        base.update({"truncated": False, "error": None, "data": None})
        base.update(reply)
        base["latency_s"] = time.monotonic() - start
        data = (json.dumps(base) + "\n").encode()
        view = memoryview(data)
        while view:
            try:
                view = view[os.write(self.outfd, view) :]
            except InterruptedError:
                continue

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

    def _others(self) -> list:
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
            if not self._others():
                return True
            time.sleep(min(0.001 * attempt, 0.02))
        return False

    def _child_limits(self, timeout_s: float, memory_mb: int) -> None:
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
        for which, value in limits:
            with contextlib.suppress(ValueError, OSError):
                resource.setrlimit(which, value)
        try:  # the OOM killer takes the call's processes before the server
            with open("/proc/self/oom_score_adj", "w") as f:
                f.write("1000")
        except OSError:
            pass

    def spawn(self, body, stdin: str, timeout_s: float, output_limit: int, memory_mb: int, cwd: str | None):
        """Fork, run `body()` in the child (it must not return), and collect what it writes."""
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
        pid = os.fork()
        if pid == 0:  # the child
            try:
                signal.set_wakeup_fd(-1)
                for sig in (signal.SIGCHLD, signal.SIGINT):
                    signal.signal(sig, signal.SIG_DFL)
                os.setsid()
                for fd, target in ((in_r, 0), (out_w, 1), (err_w, 2)):
                    os.dup2(fd, target)
                os.closerange(3, 65536)
                os.chdir(workdir)
                os.environ.clear()
                os.environ.update(self.config.env)
                self._child_limits(timeout_s, memory_mb)
                body()
            except BaseException:
                try:
                    os.write(2, traceback.format_exc().encode())
                finally:
                    os._exit(127)
            os._exit(127)
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
            "exit_code": None if status is None else _exit_code(status),
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

    # ---- tools ----------------------------------------------------------------------------------------
    def op_hello(self, **config) -> dict:
        self.config = Config(config)
        self.sweep()
        data = {"pid": os.getpid(), "boot": self.boot, "python": sys.version.split()[0], "protocol": PROTOCOL}
        return {"data": data}

    def op_ping(self) -> dict:
        return {"data": {"pid": os.getpid(), "boot": self.boot, "processes": len(self._others())}}

    def op_run_python(
        self, code: str, stdin: str = "", timeout_s: float = 5.0, output_limit: int = 8192,
        memory_mb: int | None = None, cwd: str | None = None,
    ) -> dict:  # fmt: skip
        def body() -> None:
            _run_main(code)

        memory = self.config.memory_mb if memory_mb is None else memory_mb
        return self.spawn(body, stdin, timeout_s, output_limit, memory, cwd)

    def op_run_shell(
        self, command: str, stdin: str = "", timeout_s: float = 5.0, output_limit: int = 8192,
        memory_mb: int | None = None, cwd: str | None = None,
    ) -> dict:  # fmt: skip
        env = self.config.env

        def body() -> None:
            for sig in ("SIGPIPE", "SIGXFSZ"):
                signal.signal(getattr(signal, sig), signal.SIG_DFL)
            os.execve("/bin/sh", ["sh", "-c", command], env)

        memory = self.config.memory_mb if memory_mb is None else memory_mb
        return self.spawn(body, stdin, timeout_s, output_limit, memory, cwd)

    def _path(self, path: str) -> str:
        return os.path.normpath(os.path.join(self.config.workdir, path))

    def op_read_file(self, path: str, max_bytes: int = 65536, encoding: str = "utf-8") -> dict:
        full = self._path(path)
        try:
            fd = os.open(full, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as e:
            return {"ok": False, "error": f"cannot read {path}: {e.strerror}"}
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return {"ok": False, "error": f"cannot read {path}: not a regular file"}
            max_bytes = max(0, min(int(max_bytes), MAX_OUTPUT_LIMIT))
            chunks, size = [], 0
            while size <= max_bytes:
                chunk = os.read(fd, min(1 << 20, max_bytes + 1 - size))
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
        except OSError as e:
            return {"ok": False, "error": f"cannot read {path}: {e.strerror}"}
        finally:
            os.close(fd)
        blob = b"".join(chunks)
        truncated = len(blob) > max_bytes
        blob = blob[:max_bytes]
        text = base64.b64encode(blob).decode() if encoding == "base64" else blob.decode("utf-8", "replace")
        return {"stdout": text if encoding != "base64" else "", "truncated": truncated, "data": text}

    def op_write_file(
        self, path: str, content: str, encoding: str = "utf-8", append: bool = False, make_dirs: bool = True
    ) -> dict:
        full = self._path(path)
        try:
            blob = base64.b64decode(content) if encoding == "base64" else content.encode("utf-8")
        except ValueError as e:
            return {"ok": False, "error": f"bad {encoding} content: {e}"}
        try:
            if make_dirs:
                os.makedirs(os.path.dirname(full), exist_ok=True)
            flags = os.O_WRONLY | os.O_CREAT | os.O_NONBLOCK | os.O_CLOEXEC
            flags |= os.O_APPEND if append else os.O_TRUNC
            fd = os.open(full, flags, 0o644)
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    return {"ok": False, "error": f"cannot write {path}: not a regular file"}
                view = memoryview(blob)
                while view:
                    view = view[os.write(fd, view) :]
            finally:
                os.close(fd)
        except OSError as e:
            return {
                "ok": False,
                "error": f"cannot write {path}: {e.strerror or errno.errorcode.get(e.errno)}",
            }
        return {"data": {"path": full, "bytes": len(blob)}}

    def op_list_dir(self, path: str = ".", recursive: bool = False) -> dict:
        root = self._path(path)
        if not os.path.isdir(root):
            return {"ok": False, "error": f"cannot list {path}: not a directory"}
        entries, truncated, stack = [], False, [root]
        while stack and not truncated:
            current = stack.pop()
            try:
                items = sorted(os.scandir(current), key=lambda e: e.name)
            except OSError as e:
                return {"ok": False, "error": f"cannot list {path}: {e.strerror}"}
            for entry in items:
                if len(entries) >= MAX_LIST_ENTRIES:
                    truncated = True
                    break
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                kind = "dir" if stat.S_ISDIR(st.st_mode) else "file" if stat.S_ISREG(st.st_mode) else "other"
                kind = "link" if stat.S_ISLNK(st.st_mode) else kind
                rel = os.path.relpath(entry.path, root)
                entries.append({"path": rel, "type": kind, "size": st.st_size})
                if recursive and kind == "dir":
                    stack.append(entry.path)
        listing = "\n".join(e["path"] + ("/" if e["type"] == "dir" else "") for e in entries)
        return {"stdout": listing, "truncated": truncated, "data": entries}

    def op_reset(self) -> dict:
        """Kill every process, empty the writable directories: the sandbox as it started."""
        swept = self.sweep()
        problems = []
        for top in self.config.wipe:
            for name in os.listdir(top) if os.path.isdir(top) else []:
                problems += _remove(os.path.join(top, name))
        if not swept:
            problems.append("processes survived the sweep")
        os.chdir(self.config.workdir)
        if problems:
            return {"ok": False, "error": "reset incomplete: " + "; ".join(problems[:5])}
        return {"data": {"processes": len(self._others())}}

    def op_shutdown(self) -> dict:
        self.sweep()
        return {}


def _remove(path: str) -> list:
    """Remove a file or a tree, making read-only directories writable first; the failures."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return []
    if stat.S_ISDIR(st.st_mode):
        try:
            os.chmod(path, 0o700)
            names = os.listdir(path)
        except OSError as e:
            return [f"{path}: {e.strerror}"]
        failures = []
        for name in names:
            failures += _remove(os.path.join(path, name))
        try:
            os.rmdir(path)
        except OSError as e:
            failures.append(f"{path}: {e.strerror}")
        return failures
    try:
        os.unlink(path)
    except OSError as e:
        return [f"{path}: {e.strerror}"]
    return []


def _run_main(code: str) -> None:
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
        status = _system_exit_status(e)
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
        status = _system_exit_status(e)
    except BaseException:
        pass
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(BaseException):
            stream.flush()
    os._exit(status & 0xFF)


def _system_exit_status(e: SystemExit) -> int:
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    with contextlib.suppress(BaseException):
        print(e.code, file=sys.stderr)
    return 1


def main() -> None:
    # `python3 -c` puts the current directory first on sys.path; the code we run must not import from it.
    if sys.path and sys.path[0] in ("", os.getcwd()):
        del sys.path[0]
    out = os.dup(1)
    os.dup2(2, 1)  # a stray print in the server goes to stderr, never into the protocol stream
    ToolServer(0, out).serve()


if __name__ == "__main__":
    main()
