"""The process sandbox's seccomp filter: a short deny list compiled by hand to classic BPF.

bubblewrap loads it (`bwrap --seccomp FD`) right before it starts the tool server, so it binds the
server and everything a call starts. It is a deny list (Docker's default profile is an allow list):
every system call a sandboxed program has a use for stays allowed, and these fail with EPERM:

- another process's memory: ptrace, process_vm_readv, process_vm_writev;
- mounts and namespaces: mount and the new mount API, umount2, pivot_root, setns, and unshare or clone
  with any CLONE_NEW* flag (user namespaces above all: the largest kernel surface open to a user);
- host administration: kexec, modules, reboot, swap, acct, quotactl, syslog;
- wide kernel surfaces no test program needs: bpf, perf_event_open, userfaultfd, io_uring, keyrings
  (not namespaced), file handles (open_by_handle_at reaches past a bind mount);
- SysV IPC and POSIX message queues: no cgroup charges their memory to the sandbox and they outlive
  the process that made them.

clone3 fails with ENOSYS (its flags sit in memory a filter cannot read), so the C library falls back to
clone, whose flags it can. System calls of another ABI (i386 or x32 on x86_64) kill the process.
"""

from __future__ import annotations

import errno
import platform
import struct

# name: (x86_64, aarch64) system call numbers.
DENIED: dict[str, tuple[int, int]] = {
    "ptrace": (101, 117),
    "process_vm_readv": (310, 270),
    "process_vm_writev": (311, 271),
    "mount": (165, 40),
    "umount2": (166, 39),
    "pivot_root": (155, 41),
    "open_tree": (428, 428),
    "move_mount": (429, 429),
    "fsopen": (430, 430),
    "fsconfig": (431, 431),
    "fsmount": (432, 432),
    "fspick": (433, 433),
    "mount_setattr": (442, 442),
    "setns": (308, 268),
    "kexec_load": (246, 104),
    "kexec_file_load": (320, 294),
    "init_module": (175, 105),
    "finit_module": (313, 273),
    "delete_module": (176, 106),
    "reboot": (169, 142),
    "swapon": (167, 224),
    "swapoff": (168, 225),
    "acct": (163, 89),
    "quotactl": (179, 60),
    "syslog": (103, 116),
    "bpf": (321, 280),
    "perf_event_open": (298, 241),
    "userfaultfd": (323, 282),
    "io_uring_setup": (425, 425),
    "io_uring_enter": (426, 426),
    "io_uring_register": (427, 427),
    "keyctl": (250, 219),
    "add_key": (248, 217),
    "request_key": (249, 218),
    "open_by_handle_at": (304, 265),
    "name_to_handle_at": (303, 264),
    "shmget": (29, 194),
    "msgget": (68, 186),
    "semget": (64, 190),
    "mq_open": (240, 180),
}
# Denied only with a namespace flag in their first argument.
FLAG_CHECKED: dict[str, tuple[int, int]] = {"clone": (56, 220), "unshare": (272, 97)}
CLONE3 = 435  # the same on both
CLONE_NEW_FLAGS = 0x7E020080  # NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET, NEWTIME

ARCHES = {"x86_64": (0, 0xC000003E), "aarch64": (1, 0xC00000B7)}  # column in the tables, AUDIT_ARCH_*
X32_SYSCALL_BIT = 0x40000000

# Classic BPF (linux/filter.h, linux/seccomp.h).
LD_W_ABS, JEQ_K, JGE_K, JSET_K, RET_K = 0x20, 0x15, 0x35, 0x45, 0x06
RET_KILL_PROCESS, RET_ALLOW, RET_ERRNO = 0x80000000, 0x7FFF0000, 0x00050000
NR_OFFSET, ARCH_OFFSET, ARG0_LOW_OFFSET = 0, 4, 16  # struct seccomp_data (little-endian arg0)


def supported() -> bool:
    return platform.machine() in ARCHES


def filter_program(machine: str | None = None) -> bytes:
    """The compiled filter (an array of `struct sock_filter`) for this machine's architecture."""
    machine = machine or platform.machine()
    if machine not in ARCHES:
        raise ValueError(f"no seccomp filter for {machine} (only {', '.join(ARCHES)})")
    column, audit_arch = ARCHES[machine]
    deny = ("ret", RET_ERRNO | errno.EPERM)
    # Each entry: (code, k, jump-if-true label, jump-if-false label) or ("ret", value); labels resolve
    # to relative offsets below. None means "the next instruction".
    prog: list[tuple] = [
        (LD_W_ABS, ARCH_OFFSET, None, None),
        (JEQ_K, audit_arch, None, "kill"),
        (LD_W_ABS, NR_OFFSET, None, None),
    ]
    if machine == "x86_64":
        prog.append((JGE_K, X32_SYSCALL_BIT, "kill", None))
    for numbers in DENIED.values():
        prog.append((JEQ_K, numbers[column], "deny", None))
    prog.append((JEQ_K, CLONE3, "enosys", None))
    for numbers in FLAG_CHECKED.values():
        prog.append((JEQ_K, numbers[column], "flags", None))
    prog += [
        ("ret", RET_ALLOW),
        ("label", "flags"),
        (LD_W_ABS, ARG0_LOW_OFFSET, None, None),
        (JSET_K, CLONE_NEW_FLAGS, "deny", None),
        ("ret", RET_ALLOW),
        ("label", "deny"),
        deny,
        ("label", "enosys"),
        ("ret", RET_ERRNO | errno.ENOSYS),
        ("label", "kill"),
        ("ret", RET_KILL_PROCESS),
    ]
    return _assemble(prog)


def _assemble(prog: list[tuple]) -> bytes:
    labels, index = {}, 0
    for item in prog:
        if item[0] == "label":
            labels[item[1]] = index
        else:
            index += 1
    out, index = [], 0
    for item in prog:
        if item[0] == "label":
            continue
        if item[0] == "ret":
            out.append(struct.pack("=HBBI", RET_K, 0, 0, item[1]))
        else:
            code, k, jt, jf = item
            out.append(struct.pack("=HBBI", code, _jump(labels, jt, index), _jump(labels, jf, index), k))
        index += 1
    return b"".join(out)


def _jump(labels: dict[str, int], label: str | None, index: int) -> int:
    if label is None:
        return 0
    offset = labels[label] - index - 1
    if not 0 <= offset <= 255:
        raise ValueError(f"a seccomp jump to {label} is out of range ({offset})")
    return offset
