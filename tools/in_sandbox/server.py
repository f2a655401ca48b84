"""The in-sandbox tool server: one long-lived process that runs tool calls sent as JSON lines.

It runs inside a sandbox (a Docker container, a bubblewrap namespace) as the sandbox's init, PID 1, so
code it runs cannot kill it: the kernel drops signals sent to a namespace's init from inside unless it
handles them, and `kill(-1)` spares it. The host sends one JSON object per line on stdin and reads one
JSON object per line on stdout, so a call costs a pipe round trip instead of a `docker exec`.

Requests: {"id": n, "op": NAME, "args": {...}}. The first must be `hello` (its args configure the
server: work dir, whether to sweep, what to wipe on reset). Ops: hello, ping, run_python, run_shell,
read_file, write_file, list_dir, reset, shutdown. Every reply has id, ok, stdout, stderr, exit_code,
timed_out, truncated, latency_s, error (a message for the model when ok is false) and data.
How a call's process runs, is limited and is cleaned up after: procs.py.

Standard library only; runs on the image's Python 3 (3.8 or newer). The host sends this module and
procs.py as the program text of `python3 -c` (see `reflow.sandbox.channel.server_program`), so
the image never needs rebuilding when they change.
"""

from __future__ import annotations

import base64
import errno
import json
import os
import signal
import stat
import sys
import time

from reflow_tools.in_sandbox.procs import (
    MAX_OUTPUT_LIMIT,
    PR_SET_CHILD_SUBREAPER,
    PR_SET_DUMPABLE,
    Calls,
    prctl,
    remove_ipc,
)

PROTOCOL = 1
MAX_LIST_ENTRIES = 2000


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
        self.calls = Calls(self.config)
        self.boot = os.urandom(8).hex()  # tells a restarted server from the one that was there
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # as init, a signal without a handler is dropped
        prctl(PR_SET_DUMPABLE, 0)  # /proc/<pid>/fd and ptrace closed to the code we run
        prctl(PR_SET_CHILD_SUBREAPER, 1)  # orphans of a call come back to us (when we are not init)

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

    # ---- tools ----------------------------------------------------------------------------------------
    def op_hello(self, **config) -> dict:
        self.config = self.calls.config = Config(config)
        self.calls.sweep()
        data = {"pid": os.getpid(), "boot": self.boot, "python": sys.version.split()[0], "protocol": PROTOCOL}
        return {"data": data}

    def op_ping(self) -> dict:
        return {"data": {"pid": os.getpid(), "boot": self.boot, "processes": len(self.calls.others())}}

    def op_run_python(
        self, code: str, stdin: str = "", timeout_s: float = 5.0, output_limit: int = 8192,
        memory_mb: int | None = None, cwd: str | None = None,
    ) -> dict:  # fmt: skip
        def launch(fds: tuple, workdir: str, limits: list) -> int:
            return self.calls.spawn_python(code, fds, workdir, limits)

        memory = self.config.memory_mb if memory_mb is None else memory_mb
        return self.calls.run(launch, stdin, timeout_s, output_limit, memory, cwd)

    def op_run_shell(
        self, command: str, stdin: str = "", timeout_s: float = 5.0, output_limit: int = 8192,
        memory_mb: int | None = None, cwd: str | None = None,
    ) -> dict:  # fmt: skip
        def launch(fds: tuple, workdir: str, limits: list) -> int:
            return self.calls.spawn("/bin/sh", ["sh", "-c", command], fds, workdir, limits)

        memory = self.config.memory_mb if memory_mb is None else memory_mb
        return self.calls.run(launch, stdin, timeout_s, output_limit, memory, cwd)

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
        """Kill every process, remove IPC objects, empty the writable dirs: the sandbox as it started."""
        swept = self.calls.sweep()
        problems = remove_ipc()
        for top in self.config.wipe:
            for name in os.listdir(top) if os.path.isdir(top) else []:
                problems += _remove(os.path.join(top, name))
        if not swept:
            problems.append("processes survived the sweep")
        os.chdir(self.config.workdir)
        if problems:
            return {"ok": False, "error": "reset incomplete: " + "; ".join(problems[:5])}
        return {"data": {"processes": len(self.calls.others())}}

    def op_shutdown(self) -> dict:
        self.calls.sweep()
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


def main() -> None:
    # `python3 -c` puts the current directory first on sys.path; the code we run must not import from it.
    if sys.path and sys.path[0] in ("", os.getcwd()):
        del sys.path[0]
    out = os.dup(1)
    os.dup2(2, 1)  # a stray print in the server goes to stderr, never into the protocol stream
    ToolServer(0, out).serve()


if __name__ == "__main__":
    main()
