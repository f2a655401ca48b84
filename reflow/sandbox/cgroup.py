"""A cgroup per process sandbox: the kernel charges the sandbox's processes and its tmpfs pages to a
memory and a pids limit, as Docker does for a container.

It needs write access to the memory and pids controllers: root on cgroup v1 (each in its own
hierarchy, e.g. /sys/fs/cgroup/memory), or on cgroup v2 a writable directory of the unified hierarchy
that has both controllers. Groups are made under the hierarchy's group of this process (v1) or beside
it (v2, whose groups with processes cannot give controllers to children), in a `reflow-sandboxes`
directory, one per sandbox, named after the owner's pid so that groups a dead owner left are removed
when the next one is made. `cgroup_problem()` says why none can be made here; the process sandbox then
runs without one and says so (`ProcessSandbox.has_cgroup`).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import time
from dataclasses import dataclass
from functools import cache

CONTROLLERS = ("memory", "pids")
BASE = "reflow-sandboxes"


@dataclass(frozen=True)
class Hierarchy:
    """Where one controller's groups are made: the directory under which each sandbox gets one."""

    controller: str  # "memory", "pids", or "" for the whole v2 hierarchy
    base: str


def _mounts() -> list[tuple[str, str, set[str]]]:
    """(mount point, file system type, super options) of every cgroup mount, from mountinfo."""
    found = []
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        for line in f:
            fields = line.split()
            tail = fields[fields.index("-") + 1 :]
            if tail[0] in ("cgroup", "cgroup2"):
                found.append((fields[4], tail[0], set(tail[2].split(","))))
    return found


def _own_groups() -> dict[str, str]:
    """This process's group per v1 controller, and "" for its v2 group (/proc/self/cgroup)."""
    groups = {}
    with open("/proc/self/cgroup", encoding="utf-8") as f:
        for line in f:
            _, names, path = line.rstrip("\n").split(":", 2)
            for name in names.split(",") if names else [""]:
                groups[name] = path
    return groups


def hierarchies() -> list[Hierarchy]:
    """Where the memory and pids groups go here; empty when no hierarchy offers both."""
    mounts, own = _mounts(), _own_groups()
    v1 = {c: point for point, kind, opts in mounts if kind == "cgroup" for c in CONTROLLERS if c in opts}
    if all(c in v1 for c in CONTROLLERS):
        return [Hierarchy(c, os.path.join(v1[c], own.get(c, "/").lstrip("/"), BASE)) for c in CONTROLLERS]
    for point, kind, _ in mounts:
        if kind != "cgroup2":
            continue
        parent = os.path.dirname(os.path.join(point, own.get("", "/").lstrip("/")).rstrip("/"))
        parent = parent if parent.startswith(point) else point
        with contextlib.suppress(OSError), open(os.path.join(parent, "cgroup.controllers")) as f:
            if set(CONTROLLERS) <= set(f.read().split()):
                return [Hierarchy("", os.path.join(parent, BASE))]
    return []


def _write(path: str, value: str) -> None:
    with open(path, "w", encoding="ascii") as f:
        f.write(value)


class SandboxCgroup:
    """One sandbox's group (a directory per hierarchy), its limits set; `add` moves a process in."""

    def __init__(self, memory_bytes: int, pids: int) -> None:
        found = hierarchies()
        if not found:
            raise OSError("no cgroup hierarchy with the memory and pids controllers is mounted")
        name = f"{os.getpid()}-{secrets.token_hex(4)}"
        self.paths: list[str] = []
        try:
            for h in found:
                _prepare_base(h)
                path = os.path.join(h.base, name)
                os.mkdir(path, 0o755)
                self.paths.append(path)
                _limit(h.controller, path, memory_bytes, pids)
        except OSError:
            self.remove()
            raise

    def add(self, pid: int) -> None:
        for path in self.paths:
            _write(os.path.join(path, "cgroup.procs"), str(pid))

    def remove(self, wait_s: float = 2.0) -> bool:
        """Remove the groups once their processes are gone; False if one is still busy."""
        deadline = time.monotonic() + wait_s
        for path in list(self.paths):
            while True:
                try:
                    os.rmdir(path)
                except FileNotFoundError:
                    pass
                except OSError:  # a process still exiting
                    if time.monotonic() < deadline:
                        time.sleep(0.02)
                        continue
                    return False
                self.paths.remove(path)
                break
        return True


def _prepare_base(h: Hierarchy) -> None:
    os.makedirs(h.base, 0o755, exist_ok=True)
    if not h.controller:  # v2: the controllers must be handed down to the sandboxes' groups
        _write(os.path.join(h.base, "cgroup.subtree_control"), "+memory +pids")
    for entry in os.scandir(h.base):  # groups of owners that died without removing them
        owner = entry.name.split("-", 1)[0]
        if entry.is_dir() and owner.isdigit() and not _alive(int(owner)):
            with contextlib.suppress(OSError):
                os.rmdir(entry.path)


def _limit(controller: str, path: str, memory_bytes: int, pids: int) -> None:
    if controller in ("", "pids"):
        _write(os.path.join(path, "pids.max"), str(pids))
    if controller == "memory":
        _write(os.path.join(path, "memory.limit_in_bytes"), str(memory_bytes))
        swap = os.path.join(path, "memory.memsw.limit_in_bytes")  # only with swap accounting
        if os.path.exists(swap):
            _write(swap, str(memory_bytes))
    elif controller == "":
        _write(os.path.join(path, "memory.max"), str(memory_bytes))
        with contextlib.suppress(FileNotFoundError):
            _write(os.path.join(path, "memory.swap.max"), "0")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@cache
def cgroup_problem() -> str | None:
    """None when each process sandbox can get its own memory and pids limits here, else why not."""
    try:
        SandboxCgroup(64 << 20, 16).remove()
    except (OSError, ValueError) as e:
        return f"no cgroup for the process sandbox ({e}); run as root or delegate a cgroup v2 subtree"
    return None
