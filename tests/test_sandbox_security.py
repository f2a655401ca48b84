"""Escape attempts of a hostile model in both sandbox backends: write or read outside the sandbox, reach
the host's network or its secrets, steer the tool server, mount, raise privileges, make namespaces.
Each is refused and the same tool server answers afterwards. The cases test_sandbox_adversarial.py
already makes (the root file system, /etc/shadow, killing the server, plain network) are not repeated.
"""

from __future__ import annotations

import os
import platform
import secrets
import socket

import pytest
from sandbox_helpers import (  # noqa: F401 (fixtures)
    LIMITS,
    boot_fixture,
    boot_of,
    healthy,
    py,
    sandbox_fixture,
    sh,
    start,
)

from reflow.sandbox import seccomp
from reflow.sandbox.cgroup import cgroup_problem

pytestmark = pytest.mark.security

LIBC = "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"


def errno_of(sandbox, call: str) -> str:
    """Run `libc.<call>` in the sandbox; 'ok' when it succeeded, else the errno name."""
    out = py(
        sandbox,
        LIBC
        + f"r = libc.{call}\nimport errno\nprint('ok' if r >= 0 else errno.errorcode[ctypes.get_errno()])",
    )
    assert out.exit_code == 0, out
    return out.stdout.strip()


def test_kernel_and_device_files_cannot_be_written(sandbox, boot):
    out = sh(
        sandbox,
        "echo x > /proc/sys/kernel/hostname; echo b > /proc/sysrq-trigger; echo 1 > /proc/sys/vm/drop_caches; "
        "mknod /work/mem c 1 1; mknod /tmp/sda b 8 0; ls /sys/fs/cgroup 2>/dev/null | head -1 > /work/cg; "
        "echo $$ > /sys/fs/cgroup/cgroup.procs",
    )
    assert out.exit_code != 0 and out.stderr.count("/") >= 6, out
    assert sh(sandbox, "hostname").stdout == "sandbox\n"
    healthy(sandbox, boot)


def test_the_host_token_and_environment_are_out_of_reach(sandbox, boot, tmp_path, monkeypatch):
    token = secrets.token_hex(16)
    (tmp_path / "token").write_text(token)
    monkeypatch.setenv("REFLOW_SERVER_TOKEN", token)  # what a server started with the env var holds
    fresh = py(sandbox, "print('x')")  # a call after the host process learnt the token
    assert fresh.ok
    probe = sh(
        sandbox,
        f"cat {tmp_path}/token; env; cat /proc/*/environ /proc/*/cmdline 2>/dev/null; "
        "grep -rs REFLOW /work /tmp 2>/dev/null; echo end",
    )
    assert token not in probe.stdout + probe.stderr and "REFLOW_SERVER_TOKEN" not in probe.stdout
    healthy(sandbox, boot)


def test_host_processes_are_invisible(sandbox, boot):
    out = py(sandbox, "import os\nprint(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))")
    pids = eval(out.stdout)
    assert pids[0] == 1 and os.getpid() not in pids[1:] and len(pids) <= 3, pids
    healthy(sandbox, boot)


def test_host_loopback_and_abstract_sockets_are_unreachable(sandbox, boot):
    tcp = socket.socket()
    tcp.bind(("127.0.0.1", 0))
    tcp.listen()
    abstract = socket.socket(socket.AF_UNIX)
    name = f"reflow-test-{secrets.token_hex(4)}"
    abstract.bind("\0" + name)
    abstract.listen()
    try:
        port = tcp.getsockname()[1]
        out = py(
            sandbox,
            f"import socket\nfor family, address in ((socket.AF_INET, ('127.0.0.1', {port})), (socket.AF_UNIX, '\\0{name}')):\n"
            "    s = socket.socket(family)\n    s.settimeout(2)\n    try:\n        s.connect(address)\n"
            "        print('connected')\n    except OSError as e:\n        print(type(e).__name__)\n",
        )
        assert out.exit_code == 0 and "connected" not in out.stdout, out
    finally:
        tcp.close()
        abstract.close()
    healthy(sandbox, boot)


def test_the_tool_server_cannot_be_traced_or_read(sandbox, boot):
    assert errno_of(sandbox, "ptrace(16, 1, 0, 0)") in ("EPERM", "EACCES")  # PTRACE_ATTACH to the server
    read = (
        "process_vm_readv(1, ctypes.byref((ctypes.c_void_p * 2)(ctypes.addressof(ctypes.create_string_buffer(16)), "
        "16)), 1, ctypes.byref((ctypes.c_void_p * 2)(0x400000, 16)), 1, 0)"
    )
    assert errno_of(sandbox, read) in ("EPERM", "EACCES", "ESRCH")
    environ = py(sandbox, "print(open('/proc/1/environ').read())")
    assert environ.exit_code == 1 and "PermissionError" in environ.stderr
    healthy(sandbox, boot)


def test_mounting_is_refused(sandbox, boot):
    assert errno_of(sandbox, "mount(b'none', b'/work', b'tmpfs', 0, None)") == "EPERM"
    assert errno_of(sandbox, "umount2(b'/work', 2)") == "EPERM"
    assert sh(sandbox, "mount -t proc proc /work 2>&1; echo $?").stdout.strip().endswith(("1", "32"))
    healthy(sandbox, boot)


def test_setuid_binaries_give_no_privilege(sandbox, boot):
    status = sh(sandbox, "grep -E '^(NoNewPrivs|CapEff|CapPrm|CapBnd)' /proc/self/status")
    lines = dict(line.split(":\t") for line in status.stdout.splitlines())
    assert lines["NoNewPrivs"] == "1" and lines["CapEff"] == lines["CapPrm"] == "0000000000000000", lines
    # Run every setuid binary the sandbox has; none may start with another effective uid.
    out = sh(
        sandbox,
        "for f in $(find / -xdev -perm -4000 -type f 2>/dev/null); do "
        '("$f" --version > /dev/null 2>&1 &); done; '
        "awk '/^Uid:/ {print $3}' /proc/[0-9]*/status 2>/dev/null | sort -u",
        10.0,
    )
    assert out.stdout.split() in (["10001"], []), out
    healthy(sandbox, boot)


def test_user_and_other_namespaces_cannot_be_made(sandbox, boot):
    new_user, new_net, new_mount = 0x10000000, 0x40000000, 0x00020000
    for flags in (new_user, new_net, new_mount, new_user | new_net):
        assert errno_of(sandbox, f"unshare({flags})") in ("EPERM", "ENOSPC", "EINVAL"), hex(flags)
    assert sh(sandbox, "unshare -U -r id 2>&1; echo $?").stdout.strip().endswith("1")
    assert errno_of(sandbox, "setns(os.open('/proc/self/ns/net', os.O_RDONLY), 0)") == "EPERM"
    # What the filter must leave alone: threads and child processes (clone3 gives way to clone).
    ordinary = py(
        sandbox,
        "import subprocess, threading\nt = threading.Thread(target=print, args=('thread',))\nt.start()\n"
        "t.join()\nprint(subprocess.run(['echo', 'child'], capture_output=True, text=True).stdout, end='')",
    )
    assert ordinary.stdout == "thread\nchild\n", ordinary
    healthy(sandbox, boot)


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86_64 system call numbers")
def test_kernel_surfaces_a_program_does_not_need_are_closed(sandbox, boot):
    assert errno_of(sandbox, "syscall(321, 0, 0, 0)") in ("EPERM", "ENOSYS")  # bpf (x86_64 number)
    assert errno_of(sandbox, "syscall(250, 0, 0, 0, 0, 0)") in ("EPERM", "ENOSYS")  # keyctl
    assert errno_of(sandbox, "syscall(298, 0, 0, -1, -1, 0)") in ("EPERM", "EACCES", "ENOSYS")  # perf
    healthy(sandbox, boot)


# ---- the process sandbox's own limits ---------------------------------------------------------------


@pytest.fixture
def confined():
    problem = cgroup_problem()
    if problem:
        pytest.skip(problem)
    sb = start("process")
    yield sb
    sb.close_sync()


@pytest.mark.bwrap
def test_the_process_sandbox_gets_a_cgroup_with_its_limits(confined):
    assert confined.has_cgroup and confined.server_info["cgroup"] is True
    boot = boot_of(confined)
    # Processes past the pids limit cannot start; the server and the next call are unaffected.
    bomb = py(confined, "import os, time\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n"
              "            time.sleep(30)\n        n += 1\nexcept OSError:\n    print(n)\n", 10.0)  # fmt: skip
    assert bomb.exit_code == 0 and 0 < int(bomb.stdout) < LIMITS.pids, bomb
    # Memory: tmpfs pages count with the processes'; together past the limit, a call is killed.
    fill = sh(confined, "head -c 30M /dev/zero > /work/f; head -c 14M /dev/zero > /tmp/f; echo filled")
    assert fill.stdout == "filled\n"
    hog = py(confined, "import os, time\nfor _ in range(3):\n    if os.fork() == 0:\n"
             "        b = b'x' * (150 << 20)\n        time.sleep(3)\n        os._exit(0)\n"
             "print(sum(os.wait()[1] == 9 for _ in range(3)))", 15.0)  # fmt: skip
    assert hog.exit_code == 0 and int(hog.stdout) >= 1, hog
    healthy(confined, boot)


@pytest.mark.bwrap
def test_a_closed_process_sandbox_leaves_no_cgroup(confined):
    paths = list(confined.backend.cgroup.paths)
    assert paths and all(os.path.isdir(p) for p in paths)
    confined.close_sync()
    assert not any(os.path.exists(p) for p in paths)


def test_the_seccomp_tables_agree_with_libseccomp():
    """The hand-written numbers against libseccomp's, where the library is installed."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("seccomp")
    if name is None:
        pytest.skip("libseccomp is not installed")
    lib = ctypes.CDLL(name)
    lib.seccomp_syscall_resolve_name_arch.argtypes = [ctypes.c_uint32, ctypes.c_char_p]
    for arch, (column, token) in seccomp.ARCHES.items():
        for call, numbers in {**seccomp.DENIED, **seccomp.FLAG_CHECKED, "clone3": (435, 435)}.items():
            assert lib.seccomp_syscall_resolve_name_arch(token, call.encode()) == numbers[column], (
                arch,
                call,
            )


# A later call must not find an earlier call's program or stdin (another episode's, another tenant's) in
# its own memory, as it did when calls were forks of the long-lived tool server.
SCAN_MEMORY = r"""
import ctypes
needle = bytes(reversed(NEEDLE))  # reversed in this program's text, so only a copy elsewhere counts
hits = 0
for line in open('/proc/self/maps').read().splitlines():
    fields = line.split()
    name = fields[5] if len(fields) > 5 else ''
    if not fields[1].startswith('r') or name not in ('', '[heap]', '[stack]'):
        continue  # unreadable, a mapped file (reading past its end faults) or a kernel page
    lo, hi = (int(x, 16) for x in fields[0].split('-'))
    hits += ctypes.string_at(lo, hi - lo).count(needle)
print(hits)
"""


def test_a_call_cannot_read_an_earlier_calls_program_or_stdin(sandbox, boot):
    program = "secret = 'first tenant: the expected value is 7f3a'\nprint(len(secret))\n" + "#" * 8000
    first = sandbox.run_tool_sync(
        "run_python", {"code": program, "stdin": "stdin of the first tenant " * 100}
    )
    assert first.stdout == "40\n"
    assert sandbox.reset_sync()  # the next episode
    for needle in (b"the expected value is 7f3a", b"stdin of the first tenant"):
        scan = py(sandbox, f"NEEDLE = {needle[::-1]!r}\n" + SCAN_MEMORY, 20.0)
        assert scan.exit_code == 0 and scan.stdout == "1\n", (needle, scan)  # its own needle only
    healthy(sandbox, boot)
