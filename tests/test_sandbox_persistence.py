"""Nothing of one episode reaches the next through a reset, in both sandbox backends: files in any
writable place, processes that leave their session or double-fork, SysV IPC objects and POSIX message
queues (which outlive the process that made them), and resources a hostile episode pins (memory held in
shared memory or tmpfs, the disk, process slots) are all gone or free again when the next one starts."""

from __future__ import annotations

import pytest
from sandbox_helpers import LIMITS, boot_fixture, healthy, py, sandbox_fixture, sh  # noqa: F401 (fixtures)

pytestmark = pytest.mark.security


LIBC = "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\nrt = ctypes.CDLL('librt.so.1', use_errno=True)\n"

# Every kind of IPC object a call can leave behind; each line prints the id it got (-1: refused).
MAKE_IPC = LIBC + (
    "shm = libc.shmget(0x5ec7e7, 1 << 20, 0o1600)\n"
    "msg = libc.msgget(0x5ec7e7, 0o1600)\n"
    "sem = libc.semget(0x5ec7e7, 1, 0o1600)\n"
    "mq = rt.mq_open(b'/leftover', os.O_CREAT | os.O_RDWR, 0o600, None)\n"
    "print(shm, msg, sem, mq)\n"
)

LIST_IPC = LIBC + (
    "rows = [l for kind in ('shm', 'msg', 'sem') for l in open('/proc/sysvipc/' + kind).readlines()[1:]]\n"
    "print(len(rows), rt.mq_open(b'/leftover', os.O_RDONLY, 0, None))\n"
)


def test_sysv_ipc_and_message_queues_do_not_survive_a_reset(sandbox, boot):
    made = py(sandbox, MAKE_IPC)
    assert made.exit_code == 0, made
    ids = [int(x) for x in made.stdout.split()]
    if sandbox.kind == "process":
        # No cgroup charges them to anything there: the seccomp filter refuses them outright.
        assert ids == [-1, -1, -1, -1], made
    assert sandbox.reset_sync()
    left = py(sandbox, LIST_IPC)
    assert left.stdout == "0 -1\n", left  # no SysV object, and the queue is gone
    healthy(sandbox, boot)


def test_shared_memory_is_gone_when_its_maker_exits(sandbox, boot):
    # Segments marked for removal only when the last user detaches (Docker's kernel.shm_rmid_forced):
    # within one episode a segment is no channel from a call to the next either.
    made = py(sandbox, LIBC + "print(libc.shmget(0, 4096, 0o1600))")
    assert made.exit_code == 0
    rows = py(sandbox, "print(len(open('/proc/sysvipc/shm').readlines()) - 1)")
    assert rows.stdout == "0\n", (made, rows)
    healthy(sandbox, boot)


def test_files_anywhere_writable_are_gone_after_a_reset(sandbox, boot):
    out = sh(
        sandbox,
        "for d in /work /tmp /dev/shm; do echo s > $d/.hidden; mkdir -p $d/a/b; echo s > $d/a/b/f; "
        "chmod 000 $d/a; done; ls -A /work /tmp /dev/shm | wc -l",
    )
    assert out.exit_code == 0 and int(out.stdout) > 6
    assert sandbox.reset_sync()
    listing = sh(sandbox, "ls -A /work /tmp /dev/shm")
    assert listing.stdout == "/dev/shm:\n\n/tmp:\n\n/work:\n", listing
    healthy(sandbox, boot)


def test_a_double_forked_daemon_does_not_write_into_the_next_episode(sandbox, boot):
    daemon = (
        "import os, time\n"
        "if os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
        "        time.sleep(1.0)\n"
        "        while True:\n            open('/tmp/from-the-past', 'a').write('x')\n            time.sleep(0.05)\n"
        "    os._exit(0)\n"
        "print('started')\n"
    )
    assert py(sandbox, daemon).stdout == "started\n"
    assert sandbox.reset_sync()
    later = sh(sandbox, "sleep 1.5; ls -A /tmp")
    assert later.stdout == "", later
    healthy(sandbox, boot)


# ---- resource pinning: a hostile episode fills what it can, the next one gets the full limits ------


def test_memory_held_in_shared_memory_and_tmpfs_is_freed_for_the_next_episode(sandbox, boot):
    # Fill tmpfs (/dev/shm, /tmp, /work under their sizes) and as many touched SysV segments as allowed.
    pin = LIBC + (
        "libc.shmat.restype = ctypes.c_void_p\n"
        "held = 0\n"
        "for _ in range(16):\n"
        "    seg = libc.shmget(0, 32 << 20, 0o1600)\n"
        "    if seg < 0:\n        break\n"
        "    at = libc.shmat(seg, None, 0)\n"
        "    if at in (None, ctypes.c_void_p(-1).value):\n        break\n"
        "    ctypes.memset(at, 1, 32 << 20)\n    libc.shmdt(ctypes.c_void_p(at))\n    held += 32\n"
        "for d in ('/dev/shm', '/tmp', '/work'):\n"
        "    try:\n        open(d + '/fill', 'wb').write(b'x' * (20 << 20))\n"
        "    except OSError:\n        pass\n"
        "print(held)\n"
    )
    py(sandbox, pin, 20.0)
    assert sandbox.reset_sync()
    # The next episode gets its whole per-call memory and its whole disk.
    alloc = py(sandbox, f"x = bytearray({LIMITS.call_memory_mb - 64} << 20)\nprint('ok')")
    assert alloc.stdout == "ok\n", alloc
    disk = sh(sandbox, f"dd if=/dev/zero of=/work/f bs=1M count={LIMITS.work_mb - 4} 2>&1 | tail -1")
    assert disk.exit_code == 0, disk
    healthy(sandbox, boot)


def test_process_slots_are_free_again_after_a_fork_bomb_episode(sandbox, boot):
    py(sandbox, "import os, time\nfor _ in range(1000):\n    try:\n        os.fork() or time.sleep(60)\n"
       "    except OSError:\n        break\ntime.sleep(60)", 2.0)  # fmt: skip
    assert sandbox.reset_sync()
    many = sh(sandbox, "for i in $(seq 40); do sleep 2 & done; wait; echo done")
    assert many.stdout == "done\n", many
    healthy(sandbox, boot)
