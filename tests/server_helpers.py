"""A real `reflow serve-envs` in a child process on a free loopback port, for the env-server tests.

The child also registers the test envs of `fake_envs` (slow, crashy, echo) and serves them beside the
built-in ones unless the arguments list the envs (`--env`), so failure paths can be driven through the
real server. Where no sandbox works (no Docker engine or image, no bubblewrap) it passes
`--allow-host-code`, and where bubblewrap is the sandbox but gets no cgroup `--allow-uncapped-sandbox`,
so PyCode-v0 is served as a local run would play it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
from fake_envs import BUILTIN_ENVS, TEST_ENVS

TESTS = Path(__file__).resolve().parent
TOKEN = "test-token-0123456789abcdef"
SERVED = (*BUILTIN_ENVS, *TEST_ENVS)
LAUNCHER = (
    "import sys; sys.path.insert(0, sys.argv.pop(1)); import fake_envs; fake_envs.register_test_envs(); "
    "from reflow.server.cli import main; sys.exit(main(sys.argv[1:]))"
)


class ServerProcess:
    """`with ServerProcess(tmp_path, "--max-sessions", "2") as server:` ... `server.url`, `server.kill()`."""

    def __init__(
        self, workdir: Path, *args: str, token: str | None = TOKEN, envs: tuple[str, ...] | None = SERVED
    ) -> None:
        """`envs`: served when `args` name none (None: the server's own default)."""
        self.workdir, self.args, self.token = Path(workdir), list(args), token
        if envs is not None and "--env" not in args:
            self.args += [a for env_id in envs for a in ("--env", env_id)]
        self.args += _allowances_here()
        self.proc: subprocess.Popen[str] | None = None
        self.url = ""
        self.log_path = self.workdir / f"server-{os.getpid()}-{time.monotonic_ns()}.log"

    def start(self, timeout_s: float = 60.0) -> ServerProcess:
        auth = ["--no-auth"]
        if self.token is not None:
            token_file = self.workdir / "token"
            token_file.write_text(self.token + "\n")
            token_file.chmod(0o600)
            auth = ["--token-file", str(token_file)]
        cmd = [sys.executable, "-c", LAUNCHER, str(TESTS), "--port", "0", *auth, "--log-level", "warning"]
        self.log = open(self.log_path, "w")  # noqa: SIM115  (closed in stop)
        self.proc = subprocess.Popen([*cmd, *self.args], stdout=subprocess.PIPE, stderr=self.log, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # "reflow serve-envs: listening on http://127.0.0.1:PORT (...)"
        if "listening on" not in line:
            self.stop()
            raise RuntimeError(f"server did not start: {line!r}\n{self.log_path.read_text()}")
        self.url = line.split("listening on ", 1)[1].split()[0]
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/healthz", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.log_path.read_text()}")
            time.sleep(0.05)
        self.stop()
        raise RuntimeError("server did not become healthy")

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    def client(self, **kwargs) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=30, **kwargs)

    def terminate(self) -> None:
        """SIGTERM: the graceful shutdown path."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL: the server dies with no chance to answer anything."""
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(10)

    def wait(self, timeout_s: float = 30.0) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout_s)

    def logs(self) -> str:
        return self.log_path.read_text()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if self.proc is not None and self.proc.stdout is not None:
            self.proc.stdout.close()
        if hasattr(self, "log"):
            self.log.close()

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _allowances_here() -> list[str]:
    """The flags that let this machine's sandbox backend be served: none where Docker works."""
    from reflow.sandbox.cgroup import cgroup_problem
    from reflow.sandbox.factory import best_backend

    kind = best_backend()
    if kind == "subprocess":
        return ["--allow-host-code"]
    return ["--allow-uncapped-sandbox"] if kind == "process" and cgroup_problem() is not None else []


def remote_kwargs(server: ServerProcess, env_id: str, **kwargs) -> dict:
    """`reflow.make("reflow/Remote-v0", **remote_kwargs(server, "reflow/Calc-v0"))`."""
    return {"url": server.url, "env_id": env_id, "token": server.token, **kwargs}
