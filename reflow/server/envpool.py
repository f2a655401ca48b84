"""Idle envs kept for reuse: an env whose episode ended "ok" is reset for the next session of the same
env id and kwargs, as a local env is reset between episodes, instead of being built again.

Building an env can cost more than its steps (a tool's argument model is made per instance), so the
server keeps up to `size` idle envs per (env id, kwargs). Any other ending (a timeout that cancelled a
step, an env or infra error, truncation) closes the env. Idle envs are closed after `idle_s` and on
shutdown, so whatever they hold (a sandbox lease) is released.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import deque
from typing import Any

from reflow.env import Env, make

log = logging.getLogger(__name__)
CLOSE_TIMEOUT_S = 30.0


def pool_key(env_id: str, kwargs: dict[str, Any]) -> str:
    return env_id + "\n" + json.dumps(kwargs, sort_keys=True, default=str)


async def close_env(env: Env) -> None:
    """Close an env; a failure or a hang is logged, never raised."""
    try:
        await asyncio.wait_for(env.close(), CLOSE_TIMEOUT_S)
    except Exception:
        log.exception("closing %r failed", env)


class EnvPool:
    def __init__(self, size: int, idle_s: float) -> None:
        self.size, self.idle_s = size, idle_s
        self.idle: dict[str, deque[tuple[Env, float]]] = {}

    def take(self, env_id: str, kwargs: dict[str, Any]) -> Env:
        """An idle env for these settings, or a new one from `reflow.env.make`."""
        idle = self.idle.get(pool_key(env_id, kwargs))
        if idle:
            return idle.pop()[0]
        return make(env_id, **kwargs)

    async def give_back(self, env_id: str, kwargs: dict[str, Any], env: Env) -> None:
        idle = self.idle.setdefault(pool_key(env_id, kwargs), deque())
        if len(idle) < self.size:
            idle.append((env, time.monotonic()))
        else:
            await close_env(env)

    async def reap(self) -> int:
        """Close envs idle for longer than `idle_s`; returns how many."""
        cutoff, doomed = time.monotonic() - self.idle_s, []
        for idle in self.idle.values():
            while idle and idle[0][1] < cutoff:
                doomed.append(idle.popleft()[0])
        for env in doomed:
            await close_env(env)
        return len(doomed)

    async def close(self) -> None:
        envs = [env for idle in self.idle.values() for env, _ in idle]
        self.idle.clear()
        for env in envs:
            await close_env(env)

    def __len__(self) -> int:
        return sum(len(idle) for idle in self.idle.values())
