"""Owner labels on every sandbox container, and the reaper that removes the orphans.

Each container carries who made it: the owner's pid and that process's start time (so a recycled pid
does not pass for the owner), the kernel's boot id and the host name. A container is an orphan when
its owner is provably dead: same host and boot with the pid gone or started at another time, or same
host after a reboot. Containers of owners on other hosts (a shared engine) are left alone unless asked.
The owner removes its own containers on a normal exit; the reaper covers `kill -9` and crashes, and a
pool runs it when it starts. A driver that starts workers (Ray actors) names its run (`mark_run`); the
workers' containers carry the name, and the driver removes them when it stops (`reap_run`), since
killed workers close nothing.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from functools import cache
from typing import Any

KIND_LABEL = "reflow.sandbox"
PID_LABEL = "reflow.owner.pid"
START_LABEL = "reflow.owner.start"
BOOT_LABEL = "reflow.owner.boot"
HOST_LABEL = "reflow.owner.host"
POOL_LABEL = "reflow.pool"
CREATED_LABEL = "reflow.created"
RUN_LABEL = "reflow.run"
RUN_ENV_VAR = "REFLOW_SANDBOX_RUN"
"""Set by a driver (`mark_run`) and inherited by its workers: their containers carry it as RUN_LABEL."""
RUN_REAP_WAIT_S = 10.0


@cache
def boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return "unknown"


def process_start(pid: int) -> str | None:
    """The start time of `pid` in clock ticks since boot (field 22 of /proc/pid/stat), or None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields[0] in (b"Z", b"X"):
        return None  # a zombie is dead
    return fields[19].decode()


def owner_labels(pool: str = "") -> dict[str, str]:
    """The labels that mark a container as made by this process."""
    pid = os.getpid()
    return {
        KIND_LABEL: "1",
        PID_LABEL: str(pid),
        START_LABEL: process_start(pid) or "",
        BOOT_LABEL: boot_id(),
        HOST_LABEL: socket.gethostname(),
        POOL_LABEL: pool,
        CREATED_LABEL: f"{time.time():.0f}",
        RUN_LABEL: os.environ.get(RUN_ENV_VAR, ""),
    }


def mark_run() -> str:
    """Name this process's run (unless a parent already did) for the workers it starts to inherit."""
    if not os.environ.get(RUN_ENV_VAR):
        pid = os.getpid()
        os.environ[RUN_ENV_VAR] = f"{socket.gethostname()}-{boot_id()[:8]}-{pid}-{process_start(pid)}"
    return os.environ[RUN_ENV_VAR]


def reap_run(client: Any = None, wait_s: float = RUN_REAP_WAIT_S) -> list[ReapedContainer]:
    """Remove the containers of this process's run (`mark_run`): what its workers left when they were
    killed rather than closed (a driver's shutdown, Ctrl-C). Waits up to `wait_s` for their owners on
    this host to exit first, so that none is making another. Best effort: never raises."""
    run = os.environ.get(RUN_ENV_VAR)
    if not run:
        return []
    try:
        if client is None:
            from reflow.sandbox.images import docker_client

            client = docker_client()
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            labels = [c.labels or {} for c in list_sandboxes(client)]
            if not any(owner_status(x) == "alive" for x in labels if x.get(RUN_LABEL) == run):
                break
            time.sleep(0.2)
        return reap(client, run=run)
    except Exception:  # no Docker here (nothing to reap), or the engine refused: `reflow sandbox reap`
        return []


def owner_status(labels: dict[str, str]) -> str:
    """ "alive", "dead" or "unknown" (another host: its pids mean nothing here)."""
    if labels.get(HOST_LABEL) != socket.gethostname():
        return "unknown"
    if labels.get(BOOT_LABEL) != boot_id():
        return "dead"  # made before this host's last reboot
    try:
        pid = int(labels.get(PID_LABEL, ""))
    except ValueError:
        return "dead"
    start = process_start(pid)
    if start is None or start != labels.get(START_LABEL):
        return "dead"
    return "alive"


def is_mine(labels: dict[str, str]) -> bool:
    return (
        labels.get(HOST_LABEL) == socket.gethostname()
        and labels.get(BOOT_LABEL) == boot_id()
        and labels.get(PID_LABEL) == str(os.getpid())
    )


@dataclass
class ReapedContainer:
    id: str
    name: str
    owner_pid: str
    reason: str
    removed: bool
    error: str | None = None


def list_sandboxes(client: Any) -> list[Any]:
    """The sandbox containers on `client`'s engine. One removed between the listing and its inspection
    (a run or the reaper ending it meanwhile) is left out, not raised."""
    return client.containers.list(all=True, filters={"label": f"{KIND_LABEL}=1"}, ignore_removed=True)


def reap(
    client: Any = None,
    *,
    mine: bool = False,
    everything: bool = False,
    other_hosts: bool = False,
    older_than_s: float | None = None,
    run: str | None = None,
    dry_run: bool = False,
) -> list[ReapedContainer]:
    """Remove sandbox containers whose owner is dead (and, when asked, others too).

    Args:
        mine: also remove this process's own containers (what an owner does on exit).
        everything: remove every ReFlow sandbox container, whoever owns it.
        other_hosts: also remove containers made on other hosts (a shared engine; use with care).
        older_than_s: also remove containers older than this, owner alive or not.
        run: also remove the containers of this run (RUN_LABEL), owner alive or not.
        dry_run: report what would go without removing anything.
    """
    if client is None:
        from reflow.sandbox.images import docker_client

        client = docker_client()
    reaped = []
    now = time.time()
    for container in list_sandboxes(client):
        labels = container.labels or {}
        status = owner_status(labels)
        reason = None
        if everything:
            reason = "all"
        elif mine and is_mine(labels):
            reason = "mine"
        elif run and labels.get(RUN_LABEL) == run:
            reason = "run ended"
        elif status == "dead":
            reason = "owner dead"
        elif status == "unknown" and other_hosts:
            reason = "other host"
        elif older_than_s is not None and now - float(labels.get(CREATED_LABEL) or now) > older_than_s:
            reason = "too old"
        if reason is None:
            continue
        item = ReapedContainer(container.id, container.name, labels.get(PID_LABEL, "?"), reason, False)
        if not dry_run:
            try:
                container.remove(force=True, v=True)
                item.removed = True
            except Exception as e:  # already gone, or the engine refused
                item.error = str(e).splitlines()[0][:200]
                item.removed = "No such container" in str(e)
        reaped.append(item)
    return reaped
