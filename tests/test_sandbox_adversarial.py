"""Hostile programs in both sandbox backends: each is contained with a clear tool error or a plain failed
run, the tool server survives it (same server, nothing left running), and the next call and the next
episode work as if nothing happened."""

from __future__ import annotations

import os
import secrets

import pytest
from sandbox_helpers import LIMITS, boot_fixture, healthy, py, sandbox_fixture, sh  # noqa: F401 (fixtures)


def test_fork_bomb_is_killed_at_the_deadline(sandbox, boot):
    out = py(
        sandbox, "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass", 2.0
    )
    assert out.timed_out and not out.ok and "timed out after 2s" in out.error
    healthy(sandbox, boot)


def test_shell_fork_bomb_dies_with_its_call(sandbox, boot):
    out = sh(sandbox, "bomb() { bomb | bomb & }; bomb; sleep 1", 3.0)
    # The calling shell itself may die of a failed fork once the bomb holds every pid; either way the
    # call returns (the server sweeps the bomb once the call's shell ends, or at the deadline).
    assert out.exit_code is not None and "Syntax error" not in out.stderr
    healthy(sandbox, boot)


def test_memory_bomb_fails_with_memory_error(sandbox, boot):
    out = py(sandbox, "x = bytearray(8 * 1024**3)\nprint('allocated')")
    assert out.ok and out.exit_code == 1 and "MemoryError" in out.stderr and out.stdout == ""
    growing = py(sandbox, "chunks = []\nwhile True:\n    chunks.append(b'x' * (16 << 20))")
    assert growing.exit_code == 1 and "MemoryError" in growing.stderr
    healthy(sandbox, boot)


def test_memory_bomb_across_processes_spares_the_server(sandbox, boot):
    # Each child stays under the per-call address-space cap; together they pass the sandbox's memory.
    code = (
        "import os, time\npids = []\nfor _ in range(4):\n    pid = os.fork()\n    if pid == 0:\n"
        "        data = b'x' * (150 << 20)\n        time.sleep(2)\n        os._exit(0)\n    pids.append(pid)\n"
        "print(sum(os.waitpid(p, 0)[1] == 9 for p in pids), 'killed')"
    )
    out = py(sandbox, code, 10.0)
    assert out.exit_code == 0 and out.stdout.endswith(" killed\n")
    if sandbox.has_cgroup:  # the cgroup's OOM killer takes children, never the server
        assert int(out.stdout.split()[0]) >= 1
    healthy(sandbox, boot)


def test_infinite_loop_times_out(sandbox, boot):
    out = py(sandbox, "print('started', flush=True)\nwhile True:\n    pass", 1.0)
    assert out.timed_out and out.exit_code == -9 and out.stdout == "started\n"
    assert "timed out" in out.error and out.latency_s < 1.0 + 5.0
    healthy(sandbox, boot)


@pytest.mark.parametrize("tool", ["run_python", "run_shell"])
def test_a_hundred_megabytes_of_output_are_cut_to_the_cap(sandbox, boot, tool):
    if tool == "run_python":
        out = py(
            sandbox, "import sys\nchunk = 'x' * (1 << 20)\nfor _ in range(100):\n    sys.stdout.write(chunk)"
        )
    else:
        out = sh(sandbox, "head -c 100000000 /dev/zero | tr '\\0' x")
    assert out.ok and out.exit_code == 0 and out.truncated
    assert out.stdout == "x" * LIMITS.output_limit
    healthy(sandbox, boot)


def test_filling_the_disk_fails_cleanly_and_a_reset_frees_it(sandbox, boot):
    # Files under the per-file cap, together past the tmpfs sizes of /work and /tmp.
    out = sh(
        sandbox,
        "for d in /work /tmp; do for i in 1 2 3; do dd if=/dev/zero of=$d/fill$i bs=1M count=20; done; done",
    )
    assert out.ok and out.exit_code != 0 and out.stderr.count("No space left on device") >= 2
    big = sh(sandbox, "rm /work/fill*; dd if=/dev/zero of=/work/big bs=1M count=30")
    assert (
        big.exit_code != 0 and "File size limit exceeded" in big.stderr + big.stdout
    ) or big.exit_code == 153
    sh(sandbox, "for i in 1 2 3; do dd if=/dev/zero of=/work/fill$i bs=1M count=20; done")
    full = sandbox.run_tool_sync("write_file", {"path": "more.txt", "content": "y" * (4 << 20)})
    assert not full.ok and "cannot write more.txt" in full.error
    healthy(sandbox, boot)  # the server needs no disk to run a call
    assert sandbox.reset_sync()
    assert sandbox.run_tool_sync("write_file", {"path": "more.txt", "content": "y" * (4 << 20)}).ok


def test_the_root_file_system_is_not_writable(sandbox, boot):
    out = sh(sandbox, "touch /usr/evil; touch /etc/evil; touch /evil")
    assert out.exit_code != 0 and out.stderr.count("touch: cannot touch") == 3
    healthy(sandbox, boot)


def test_host_secrets_and_files_are_out_of_reach(sandbox, boot, tmp_path):
    marker = tmp_path / f"secret-{secrets.token_hex(4)}"
    marker.write_text("host secret")
    out = py(sandbox, "print(open('/etc/shadow').read())\n")
    assert out.exit_code == 1 and ("PermissionError" in out.stderr or "FileNotFoundError" in out.stderr)
    assert "root:" not in out.stdout
    probe = py(sandbox, f"import os\nprint(os.path.exists({str(marker)!r}), os.path.exists({os.getcwd()!r}))")
    assert probe.stdout == "False False\n"
    home = sh(sandbox, "ls /root 2>&1; cat /root/.bash_history 2>&1")
    assert home.exit_code != 0
    healthy(sandbox, boot)


def test_no_network_but_loopback(sandbox, boot):
    out = py(sandbox, "import socket\nsocket.create_connection(('192.0.2.1', 53), timeout=3)")
    assert (
        out.exit_code == 1 and "OSError" in out.stderr
    )  # Network is unreachable (192.0.2.1: TEST-NET-1, never routed)
    dns = py(sandbox, "import socket\nsocket.getaddrinfo('example.com', 443)")
    assert dns.exit_code == 1 and "gaierror" in dns.stderr
    devices = py(
        sandbox, "print(sorted(l.split(':')[0].strip() for l in open('/proc/net/dev').readlines()[2:]))"
    )
    assert devices.stdout == "['lo']\n"
    loopback = py(
        sandbox,
        "import socket\ns = socket.socket()\ns.bind(('127.0.0.1', 0))\ns.listen()\n"
        "c = socket.create_connection(s.getsockname())\nconn, _ = s.accept()\nc.sendall(b'hi')\nprint(conn.recv(2))",
    )
    assert loopback.stdout == "b'hi'\n"
    healthy(sandbox, boot)


def test_the_tool_server_cannot_be_killed_or_impersonated_from_inside(sandbox, boot):
    out = py(
        sandbox,
        "import os, signal\nfor sig in (signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGSTOP):\n"
        "    os.kill(os.getppid(), sig)\n    os.kill(1, sig)\nprint('still here', os.getppid())",
    )
    assert out.stdout == "still here 1\n"
    everyone = sh(sandbox, "kill -9 -1; echo survived")
    assert everyone.stdout == "survived\n"
    # The server's protocol pipes and memory are closed to the code it runs (it is not dumpable).
    forge = py(sandbox, "open('/proc/1/fd/1', 'w').write('{\"id\": 99, \"ok\": true}\\n')")
    assert forge.exit_code == 1 and "PermissionError" in forge.stderr
    peek = py(sandbox, "open('/proc/1/mem', 'rb').read(1)")
    assert peek.exit_code == 1 and ("PermissionError" in peek.stderr or "OSError" in peek.stderr)
    healthy(sandbox, boot)


def test_sleeping_past_the_deadline_is_cut_off(sandbox, boot):
    out = py(sandbox, "import time\ntime.sleep(100)", 1.0)
    assert out.timed_out and not out.ok and out.latency_s < 1.0 + 5.0
    background = sh(
        sandbox, "(sleep 100 &) ; nohup sleep 100 > /dev/null 2>&1 & setsid sleep 100 & echo started"
    )
    assert background.stdout == "started\n"
    healthy(sandbox, boot)  # nothing a call starts outlives it, daemons included


def test_the_episode_time_limit_ends_every_later_call(sandbox, boot):
    sandbox.begin_episode(1.5)
    out = py(sandbox, "import time\ntime.sleep(100)", 30.0)
    assert out.timed_out and out.latency_s < 1.5 + 5.0  # clipped to what is left of the episode
    late = py(sandbox, "print('too late')")
    assert not late.ok and "time limit of 1.5s is used up" in late.error and late.stdout == ""
    sandbox.begin_episode(None)
    healthy(sandbox, boot)


def test_the_next_episode_starts_clean(sandbox, boot):
    sh(sandbox, "echo x > /work/left.txt; echo y > /tmp/left.txt; mkdir -p /work/d/e; chmod 000 /work/d")
    assert sandbox.reset_sync()
    listing = sh(sandbox, "ls -A /work /tmp")
    assert listing.stdout == "/tmp:\n\n/work:\n", listing
    healthy(sandbox, boot)


def test_bad_calls_are_tool_errors(sandbox, boot):
    assert "unknown tool" in sandbox.run_tool_sync("format_disk", {}).error
    missing = sandbox.run_tool_sync("read_file", {"path": "nope.txt"})
    assert not missing.ok and "No such file" in missing.error
    device = sandbox.run_tool_sync("read_file", {"path": "/dev/zero"})
    assert not device.ok and "not a regular file" in device.error
    wrong = sandbox.run_tool_sync("run_python", {"source": "print(1)"})
    assert not wrong.ok and "bad arguments for run_python" in wrong.error
    healthy(sandbox, boot)


def test_both_backends_sit_behind_the_one_sandbox_class(sandbox, boot):
    # The shared behaviour (limits, serialised calls, closed and dead handling) is written once, in
    # `ToolSandbox`; each backend supplies only the `SandboxBackend` part.
    from reflow.sandbox import Sandbox, SandboxBackend, ToolSandbox

    assert type(sandbox) is ToolSandbox and isinstance(sandbox, Sandbox)
    assert isinstance(sandbox.backend, SandboxBackend) and sandbox.kind == sandbox.backend.kind
    assert repr(sandbox).startswith(f"<{type(sandbox.backend).__name__} ")
    healthy(sandbox, boot)
