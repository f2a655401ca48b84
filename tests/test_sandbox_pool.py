"""The warm pool (reuse with a reset between episodes, replacement of dead sandboxes, the live cap, the
start rate), sessions, and the reaper, including after `kill -9` of a process that owned a pool."""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from sandbox_helpers import BACKENDS, LIMITS, start

from reflow.sandbox import PoolExhausted, SandboxPool, SandboxSession, make_sandbox, reap
from reflow.sandbox.pool import TokenBucket
from reflow.sandbox.reaper import POOL_LABEL, list_sandboxes, owner_status

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_pool(kind: str, **kwargs) -> SandboxPool:
    """A pool whose containers carry a label of their own (so a test can count them on the engine)."""
    name = f"tests-{secrets.token_hex(4)}"
    return SandboxPool(lambda: make_sandbox(kind, LIMITS, pool=name), name=name, **kwargs)


def test_token_bucket_allows_a_burst_then_refuses_within_a_short_deadline():
    bucket = TokenBucket(rate=0.5, burst=2)
    assert bucket.take() and bucket.take()
    assert not bucket.take(deadline=time.monotonic() + 0.2)  # the next token is 2 s away


@pytest.mark.parametrize("kind", BACKENDS)
def test_a_released_sandbox_is_reset_and_reused(kind):
    pool = make_pool(kind, size=1, max_live=1)
    try:
        first = pool.acquire()
        first.run_tool_sync("run_shell", {"command": "echo secret > /work/notes.txt; sleep 300 &"})
        pool.release(first)
        second = pool.acquire()
        assert second is first and second.uses == 1
        assert second.run_tool_sync("run_shell", {"command": "ls -A /work"}).stdout == ""
        assert second.request("ping", {})["data"]["processes"] == 0  # the background sleep is gone
        pool.release(second)
        assert pool.wait_ready(1, timeout_s=30)
        assert pool.stats.resets == 2 and pool.stats.created == 1 and pool.stats.failed_resets == 0
    finally:
        pool.close()
    assert pool.snapshot()["live"] == 0


@pytest.mark.docker
def test_a_dead_sandbox_is_replaced_not_handed_out():
    pool = make_pool("docker", size=1, max_live=2)
    try:
        sb = pool.acquire()
        sb.backend.container.kill()
        pool.release(sb)  # the reset fails: it is removed and a fresh one started
        again = pool.acquire()
        assert again is not sb and again.is_alive_sync()
        pool.release(again)
        assert pool.stats.failed_resets == 1
    finally:
        pool.close()


@pytest.mark.docker
def test_the_live_cap_is_never_exceeded():
    pool = make_pool("docker", size=2, max_live=2, create_rate=50, create_burst=4)
    try:
        a, b = pool.acquire(), pool.acquire()
        with pytest.raises(PoolExhausted):
            pool.acquire(timeout_s=0.5)
        on_engine = [c.id for c in list_sandboxes(a.backend.client) if c.labels.get(POOL_LABEL) == pool.name]
        assert sorted(on_engine) == sorted([a.id, b.id])
        waiter: list = []
        thread = threading.Thread(target=lambda: waiter.append(pool.acquire(timeout_s=30)))
        thread.start()
        pool.release(a)  # the waiting acquire gets it once it is reset
        thread.join(30)
        assert waiter and waiter[0] is a
        assert pool.snapshot()["live"] <= 2 and pool.stats.created == 2
        assert (
            len([c for c in list_sandboxes(a.backend.client) if c.labels.get(POOL_LABEL) == pool.name]) == 2
        )
    finally:
        pool.close()


@pytest.mark.docker
async def test_a_session_leases_per_episode_and_survives_a_dead_sandbox():
    pool = make_pool("docker", size=1, max_live=3)
    try:
        session = SandboxSession(pool)
        out = await session.run_tool("run_python", {"code": "print(1)"})
        assert out.ok and session.current is not None
        first = session.current
        first.backend.container.kill()
        broken = await session.run_tool("run_python", {"code": "print(2)"})
        assert not broken.ok and "replaced" in broken.error and session.current is None
        fixed = await session.run_tool("run_python", {"code": "print(3)"})
        assert fixed.stdout == "3\n" and session.current is not first
        await session.end_episode()
        assert session.current is None and pool.snapshot()["leased"] == 0
        again = SandboxSession(pool)
        await again.run_tool("run_shell", {"command": "true"})
        del again  # garbage-collected without close(): the lease still goes back
        assert pool.snapshot()["leased"] == 0
    finally:
        pool.close()


@pytest.mark.docker
def test_reap_leaves_live_owners_alone():
    sb = start("docker")
    try:
        reaped = reap(sb.backend.client)
        assert sb.id not in {r.id for r in reaped} and sb.is_alive_sync()
        mine = reap(sb.backend.client, mine=True, dry_run=True)
        assert sb.id in {r.id for r in mine} and {r.reason for r in mine} == {"mine"}
        assert sb.is_alive_sync()  # a dry run removes nothing
    finally:
        sb.close_sync()


OWNER = textwrap.dedent(
    """
    import sys, time
    from reflow.sandbox import DockerSandbox, SandboxPool, SandboxLimits
    limits = SandboxLimits(memory_mb=256, work_mb=8, tmp_mb=8)
    pool = SandboxPool(lambda: DockerSandbox.create(limits=limits, pool="orphans"), size=3, max_live=4)
    leased = pool.acquire()
    pool.wait_ready(3, timeout_s=60)
    ids = [leased.id] + [sb.id for sb in pool.idle]
    print(" ".join(ids), flush=True)
    time.sleep(600)
    """
)


@pytest.mark.docker
def test_after_kill_9_of_the_owner_the_reaper_removes_every_container_it_left():
    owner = subprocess.Popen([sys.executable, "-c", OWNER], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        ids = owner.stdout.readline().split()
        assert len(ids) == 4, ids
    finally:
        owner.send_signal(signal.SIGKILL)
        owner.wait()
    from reflow.sandbox.docker_sandbox import shared_client

    client = shared_client()
    left = [c for c in list_sandboxes(client) if c.id in ids]
    assert len(left) == 4 and all(owner_status(c.labels) == "dead" for c in left)  # kill -9: no cleanup ran
    out = subprocess.run(
        [sys.executable, "-m", "reflow.cli", "sandbox", "reap"], capture_output=True, text=True, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr
    assert not [c for c in list_sandboxes(client) if c.id in ids]
    assert sum(line.startswith("removed") for line in out.stdout.splitlines()) >= 4


@pytest.mark.bwrap
def test_a_process_sandbox_dies_with_its_owner():
    code = (
        "from reflow.sandbox import ProcessSandbox\nimport time\nsb = ProcessSandbox.create()\n"
        "print(sb.backend.proc.pid, flush=True)\ntime.sleep(600)"
    )
    owner = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        bwrap_pid = int(owner.stdout.readline())
    finally:
        owner.send_signal(signal.SIGKILL)
        owner.wait()
    assert wait_dead(bwrap_pid, 10.0), "bwrap outlived its owner"


def wait_dead(pid: int, timeout_s: float) -> bool:
    """True once `pid` is gone or a zombie (dead, waiting for its parent to reap it)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.bwrap
def test_a_forked_child_gets_its_own_shared_pool():
    from reflow.sandbox import shared_pool

    parent = shared_pool("process")
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: a pool of its own, whose sandboxes answer
        try:
            pool = shared_pool("process")
            sb = pool.acquire(timeout_s=30)
            out = sb.run_tool_sync("run_python", {"code": "print('child')"})
            os.write(
                write, f"{pool is not parent} {pool.owner_pid == os.getpid()} {out.stdout.strip()}".encode()
            )
            pool.close()
        finally:
            os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    with os.fdopen(read) as f:
        assert f.read() == "True True child"
    assert parent.owner_pid == os.getpid() and not parent.closed


@pytest.mark.bwrap
async def test_the_sandbox_tools_for_an_env():
    from reflow.env import ToolCall
    from reflow.sandbox import sandbox_tools

    pool = make_pool("process", size=1, max_live=2)
    session = SandboxSession(pool)
    try:
        tools = {t.name: t for t in sandbox_tools(session, timeout_s=2.0)}
        assert set(tools) == {"run_python", "run_shell", "read_file", "write_file", "list_dir"}
        assert tools["run_shell"].schema["function"]["parameters"]["required"] == ["command"]

        async def use(name: str, **arguments):
            return await tools[name](ToolCall(name, arguments, raw=""))

        wrote = await use("write_file", path="src/a.py", content="print('from a file')\n")
        assert wrote.ok and wrote.content == "wrote 21 bytes to src/a.py"
        ran = await use("run_shell", command="python3 src/a.py; exit 4")
        assert ran.ok and ran.exit_code == 4 and ran.content == "exit code: 4\nstdout:\nfrom a file\n"
        assert (await use("list_dir", recursive=True)).content == "src/\nsrc/a.py"
        assert (await use("read_file", path="src/a.py")).content == "print('from a file')\n"
        slow = await use("run_python", code="print('partial', flush=True)\nwhile True:\n    pass")
        assert (
            not slow.ok and slow.content.startswith("Error: timed out after 2s") and "partial" in slow.content
        )
        missing = await use("read_file", path="nope")
        assert not missing.ok and "No such file" in missing.content
    finally:
        await session.close()
        pool.close()


def settled(pool: SandboxPool, timeout_s: float = 30.0) -> dict[str, int]:
    """The pool's counts once no sandbox is waiting for or in its reset."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        snap = pool.snapshot()
        if not snap["resetting"] and not snap["starting"]:
            time.sleep(0.2)  # an abandoned acquire woken by the reset takes the sandbox about now
            return pool.snapshot()
        time.sleep(0.05)
    raise AssertionError(f"the pool did not settle: {pool.snapshot()}")


@pytest.mark.parametrize("kind", BACKENDS)
async def test_a_cancelled_acquire_leaks_no_lease(kind):
    # What a server does when a step runs past its deadline: it cancels the task waiting for a sandbox.
    pool = make_pool(kind, size=0, max_live=1)
    try:
        holder = pool.acquire()
        waiter = asyncio.ensure_future(pool.aacquire(timeout_s=60))
        await asyncio.sleep(0.5)  # waiting on the live cap
        assert not waiter.done()
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        pool.release(holder)
        snap = await asyncio.to_thread(settled, pool)
        assert snap["leased"] == 0 and snap["idle"] == 1, snap
        again = await pool.aacquire(timeout_s=10)
        assert again is holder
        assert again.run_tool_sync("run_python", {"code": "print('ok')"}).stdout == "ok\n"
        pool.release(again)
    finally:
        pool.close()


@pytest.mark.parametrize("kind", BACKENDS)
async def test_an_acquire_cancelled_while_its_sandbox_starts_gives_it_back(kind):
    pool = make_pool(kind, size=0, max_live=1)
    try:
        waiter = asyncio.ensure_future(pool.aacquire(timeout_s=60))
        await asyncio.sleep(0.05)  # a cold start is under way in the thread
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        snap = await asyncio.to_thread(settled, pool)
        assert snap["leased"] == 0 and snap["live"] == snap["idle"] <= 1, snap
        sandbox = await pool.aacquire(timeout_s=30)
        assert sandbox.run_tool_sync("run_python", {"code": "print('ok')"}).stdout == "ok\n"
        pool.release(sandbox)
    finally:
        pool.close()
