"""The host's end of the tool-server protocol: JSON lines over a stream that stays open.

Two transports carry it: a Docker attach stream (a hijacked HTTP connection whose output comes in
frames of 8-byte headers, stdout and stderr multiplexed) and a pair of pipes (the process sandbox).
`ToolServerClient` sends a request and reads lines until the reply with the same id arrives, within a
deadline; a closed stream or a missed deadline raises `SandboxDied`, because a server that stops
answering cannot be trusted with the next call either.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import socket
import time
from collections.abc import Callable
from functools import cache
from importlib import resources
from typing import IO, Any, Protocol

from reflow.sandbox.base import SandboxDied

STDERR_KEEP = 4096


SERVER_PACKAGE = "reflow_tools.in_sandbox"
SERVER_MODULES = ("procs", "server")  # in import order
BOOTSTRAP = """\
import sys, types
for name in ("reflow_tools", PACKAGE):
    package = types.ModuleType(name)
    package.__path__ = []
    sys.modules[name] = package
for name, source in MODULES:
    module = types.ModuleType(PACKAGE + "." + name)
    module.__file__ = name + ".py"
    sys.modules[module.__name__] = module
    exec(compile(source, module.__file__, "exec"), module.__dict__)
sys.modules[PACKAGE + ".server"].main()
"""


@cache
def server_program() -> str:
    """The `python3 -c` program that runs the tool server: the modules of `reflow_tools.in_sandbox`,
    inlined.

    The sandbox needs nothing but Python 3; the server's code travels with each start."""
    package = resources.files(SERVER_PACKAGE)
    modules = tuple(
        (name, package.joinpath(name + ".py").read_text(encoding="utf-8")) for name in SERVER_MODULES
    )
    return f"PACKAGE = {SERVER_PACKAGE!r}\nMODULES = {modules!r}\n{BOOTSTRAP}"


class Transport(Protocol):
    stderr_tail: bytearray

    def send(self, data: bytes) -> None: ...

    def read_line(self, deadline: float) -> bytes: ...

    def close(self) -> None: ...


def _take_line(buffer: bytearray, fill: Callable[[float], None], deadline: float) -> bytes:
    """The first line of `buffer` (newline included), calling `fill(deadline)` until it holds one.

    Each transport keeps its own `stdout` buffer and knows how to top it up; the line splitting is
    the same for both."""
    while True:
        newline = buffer.find(b"\n")
        if newline >= 0:
            line = bytes(buffer[: newline + 1])
            del buffer[: newline + 1]
            return line
        fill(deadline)


class DockerStream:
    """A Docker attach/exec stream with stdin open and tty off: demultiplexes its frames."""

    def __init__(self, sock: Any) -> None:
        self.sock: socket.socket = getattr(sock, "_sock", sock)  # docker-py hands out a SocketIO
        self._keepalive = sock
        self.raw = bytearray()
        self.stdout = bytearray()
        self.stderr_tail = bytearray()
        self.eof = False

    def send(self, data: bytes) -> None:
        try:
            self.sock.settimeout(10.0)
            self.sock.sendall(data)
        except OSError as e:
            raise SandboxDied(f"cannot write to the sandbox: {e}") from e

    def read_line(self, deadline: float) -> bytes:
        return _take_line(self.stdout, self._fill, deadline)

    def close_stdin(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_WR)

    def _fill(self, deadline: float) -> None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError
        self.sock.settimeout(remaining)
        try:
            chunk = self.sock.recv(1 << 16)
        except TimeoutError:
            raise TimeoutError from None
        except OSError as e:
            raise SandboxDied(f"the sandbox's stream broke: {e}") from e
        if not chunk:
            self.eof = True
            raise EOFError
        self.raw += chunk
        while len(self.raw) >= 8:
            size = int.from_bytes(self.raw[4:8], "big")
            if len(self.raw) < 8 + size:
                break
            kind, payload = self.raw[0], bytes(self.raw[8 : 8 + size])
            del self.raw[: 8 + size]
            if kind == 2:
                self.stderr_tail += payload
                del self.stderr_tail[:-STDERR_KEEP]
            else:
                self.stdout += payload

    def read_all(self, deadline: float, limit: int) -> tuple[bytes, bytes, bool]:
        """Everything until EOF (for a plain exec): stdout and stderr, at most `limit` bytes each."""
        out, err, truncated = bytearray(), bytearray(), False
        self.stderr_tail = bytearray()  # here stderr is output, not a diagnostics tail
        while True:
            try:
                self._fill(deadline)
            except EOFError:
                break
            finally:
                for src, dst in ((self.stdout, out), (self.stderr_tail, err)):
                    room = limit - len(dst)
                    dst += src[: max(room, 0)]
                    truncated |= len(src) > max(room, 0)
                    del src[:]
        return bytes(out), bytes(err), truncated

    def close(self) -> None:
        for obj in (self.sock, self._keepalive):
            with contextlib.suppress(Exception):
                obj.close()


class PipeStream:
    """The tool server's stdin and stdout as pipes of a child process (the process sandbox)."""

    def __init__(self, stdin: IO[bytes], stdout: IO[bytes]) -> None:
        self._files = (stdin, stdout)  # closed through these objects, so no fd is ever closed twice
        self.stdin_fd, self.stdout_fd = stdin.fileno(), stdout.fileno()
        self.stdout = bytearray()
        self.stderr_tail = bytearray()

    def send(self, data: bytes) -> None:
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(self.stdin_fd, view) :]
        except (OSError, ValueError) as e:
            raise SandboxDied(f"cannot write to the sandbox: {e}") from e

    def read_line(self, deadline: float) -> bytes:
        return _take_line(self.stdout, self._fill, deadline)

    def _fill(self, deadline: float) -> None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError
        try:
            ready, _, _ = select.select([self.stdout_fd], [], [], remaining)
            if not ready:
                return
            chunk = os.read(self.stdout_fd, 1 << 16)
        except (OSError, ValueError) as e:
            raise SandboxDied(f"the sandbox's pipe broke: {e}") from e
        if not chunk:
            raise EOFError
        self.stdout += chunk

    def close(self) -> None:
        for f in self._files:
            with contextlib.suppress(OSError):
                f.close()


class ToolServerClient:
    """Request/reply over a transport; not thread-safe (the sandbox serialises calls)."""

    def __init__(self, transport: Transport, describe: str = "sandbox") -> None:
        self.transport = transport
        self.describe = describe
        self.next_id = 0
        self.broken: str | None = None

    def request(self, op: str, args: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        if self.broken:
            raise SandboxDied(self.broken)
        self.next_id += 1
        rid = self.next_id
        self.transport.send((json.dumps({"id": rid, "op": op, "args": args}) + "\n").encode())
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self.transport.read_line(deadline)
            except EOFError:
                self.broken = f"the tool server of {self.describe} exited{self._stderr()}"
                raise SandboxDied(self.broken) from None
            except TimeoutError:
                self.broken = f"the tool server of {self.describe} did not answer within {timeout_s:.1f}s"
                raise SandboxDied(self.broken) from None
            try:
                reply = json.loads(line)
            except ValueError:
                continue  # not ours (a stray line); the protocol stream only carries JSON
            if isinstance(reply, dict) and reply.get("id") == rid:
                return reply

    def _stderr(self) -> str:
        tail = bytes(self.transport.stderr_tail).decode("utf-8", "replace").strip()
        return f": {tail[-500:]}" if tail else ""

    def close(self) -> None:
        self.transport.close()
