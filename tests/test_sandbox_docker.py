"""DockerSandbox on a real engine: the isolation settings as the engine reports them and as code inside
sees them, the protocol's methods, the plain `docker exec` path, files in and out, reset and close."""

from __future__ import annotations

import asyncio
import os

import pytest
from sandbox_helpers import LIMITS, start

from reflow.sandbox import Sandbox, ToolOutput
from reflow.sandbox.reaper import PID_LABEL, START_LABEL, owner_status, process_start

pytestmark = pytest.mark.docker


@pytest.fixture(scope="module")
def sandbox():
    sb = start("docker")
    yield sb
    sb.close_sync()


def test_the_engine_runs_the_container_with_every_isolation_setting(sandbox):
    attrs = sandbox.backend.client.api.inspect_container(sandbox.id)
    host, config = attrs["HostConfig"], attrs["Config"]
    assert host["NetworkMode"] == "none" and host["ReadonlyRootfs"] is True
    assert host["CapDrop"] == ["ALL"] and not host["CapAdd"] and not host["Privileged"]
    assert any(opt.startswith("no-new-privileges") for opt in host["SecurityOpt"])
    assert host["Memory"] == LIMITS.memory_mb << 20 and host["MemorySwap"] == host["Memory"]
    assert host["PidsLimit"] == LIMITS.pids and host["NanoCpus"] == int(LIMITS.cpus * 1e9)
    assert set(host["Tmpfs"]) == {"/work", "/tmp"} and f"size={LIMITS.work_mb}m" in host["Tmpfs"]["/work"]
    assert not attrs["Mounts"] and config["User"] == "10001:10001"
    labels = config["Labels"]
    assert labels[PID_LABEL] == str(os.getpid()) and labels[START_LABEL] == process_start(os.getpid())
    assert owner_status(labels) == "alive"


def test_code_inside_is_an_unprivileged_user_without_capabilities(sandbox):
    out = sandbox.run_tool_sync(
        "run_shell", {"command": "id -u; grep -E '^(CapEff|CapPrm|NoNewPrivs)' /proc/self/status; hostname"}
    )
    assert out.stdout.split() == [
        "10001",
        "CapPrm:",
        "0" * 16,
        "CapEff:",
        "0" * 16,
        "NoNewPrivs:",
        "1",
        "sandbox",
    ]
    init = sandbox.run_tool_sync("run_shell", {"command": "cat /proc/1/environ; ls /proc/1/fd"})
    assert init.exit_code != 0 and init.stderr.count("Permission denied") == 2  # PID 1 is not dumpable


def test_run_python_reports_like_a_python_process(sandbox):
    ok = sandbox.run_tool_sync(
        "run_python", {"code": "import sys\nprint('hello')\nprint(sys.stdin.read().upper())", "stdin": "abc"}
    )
    assert (ok.ok, ok.stdout, ok.stderr, ok.exit_code, ok.truncated, ok.timed_out) == (
        True, "hello\nABC\n", "", 0, False, False,
    )  # fmt: skip
    assert ok.latency_s > 0 and ok.server_latency_s is not None
    failed = sandbox.run_tool_sync("run_python", {"code": "print('before')\nraise ValueError('boom')"})
    assert failed.exit_code == 1 and failed.stdout == "before\n"
    assert 'File "main.py", line 2, in <module>' in failed.stderr and failed.stderr.endswith(
        "ValueError: boom\n"
    )
    assert sandbox.run_tool_sync("run_python", {"code": "import sys; sys.exit(7)"}).exit_code == 7
    main = sandbox.run_tool_sync("run_python", {"code": "import os\nprint(__name__, os.getcwd())"})
    assert main.stdout == "__main__ /work\n"


def test_files_go_in_and_out_and_the_work_dir_persists_within_an_episode(sandbox):
    blob = bytes(range(256)) * 100
    sandbox.upload_sync("data/blob.bin", blob)
    assert sandbox.download_sync("data/blob.bin") == blob
    written = sandbox.run_tool_sync("write_file", {"path": "hello.py", "content": "print('from a file')\n"})
    assert written.ok and written.data["bytes"] == 21
    assert sandbox.run_tool_sync("run_shell", {"command": "python3 hello.py"}).stdout == "from a file\n"
    listing = sandbox.run_tool_sync("list_dir", {"path": ".", "recursive": True})
    assert {e["path"] for e in listing.data} >= {"data", "data/blob.bin", "hello.py"}
    assert sandbox.run_tool_sync("read_file", {"path": "hello.py", "max_bytes": 5}).stdout == "print"


def test_plain_docker_exec_is_the_baseline_path(sandbox):
    out = sandbox.exec_sync(["sh", "-c", "echo out; echo err >&2; exit 3"])
    assert (out.stdout, out.stderr, out.exit_code, out.ok) == ("out\n", "err\n", 3, True)
    assert sandbox.exec_sync("cat", stdin="piped").stdout == "piped"
    slow = sandbox.exec_sync("sleep 30", timeout_s=1.0)
    assert slow.timed_out and not slow.ok and slow.exit_code == -9


async def test_the_async_protocol(sandbox):
    assert isinstance(sandbox, Sandbox)
    results = await asyncio.gather(
        sandbox.run_tool("run_python", {"code": "print(6 * 7)"}),
        sandbox.exec(["echo", "hi"]),
        sandbox.is_alive(),
    )
    assert isinstance(results[0], ToolOutput) and results[0].stdout == "42\n"
    assert results[1].stdout == "hi\n" and results[2] is True
    await sandbox.upload("async.txt", "text")
    assert await sandbox.download("async.txt") == b"text"


def test_close_removes_the_container():
    sb = start("docker")
    container_id = sb.id
    assert sb.is_alive_sync()
    sb.close_sync()
    sb.close_sync()  # twice is fine
    assert not sb.is_alive_sync()
    assert not sb.backend.client.containers.list(all=True, filters={"id": container_id})
    out = sb.run_tool_sync("run_python", {"code": "print(1)"})
    assert not out.ok and "closed" in out.error


def test_a_sandbox_killed_from_outside_reports_it_and_is_not_alive():
    sb = start("docker")
    try:
        sb.backend.container.kill()
        out = sb.run_tool_sync("run_python", {"code": "print(1)"})
        assert not out.ok and "died" in out.error
        assert not sb.is_alive_sync()
    finally:
        sb.close_sync()


def test_listing_sandboxes_skips_a_container_removed_while_it_is_listed():
    """The engine lists a container's id, then the container is gone before its inspection (a run or
    the reaper removing it meanwhile: a full CI run saw the 404 end an interrupted run's test)."""
    from types import SimpleNamespace

    from docker.errors import NotFound
    from docker.models.containers import ContainerCollection

    from reflow.sandbox.reaper import list_sandboxes

    def gone(container_id):
        raise NotFound(f"No such container: {container_id}")

    api = SimpleNamespace(containers=lambda **_: [{"Id": "removed-meanwhile"}], inspect_container=gone)
    client = SimpleNamespace(api=api)
    client.containers = ContainerCollection(client=client)  # the docker SDK's own listing
    assert list_sandboxes(client) == []
