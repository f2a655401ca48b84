"""Idle envs kept for reuse: an env whose episode ended "ok" is reset for the next session of the same
env id and kwargs, as a local env is reset between episodes, instead of being built again.

Building an env can cost more than its steps (a tool's argument model is made per instance), so the
server keeps up to `size` idle envs per (env id, kwargs), and `max_total` in all: clients may choose
kwargs values, each distinct one a pool of its own, so past the total the longest idle env is closed
(nothing else counts idle envs: `max_sessions` counts live sessions). Any other ending (a timeout that
cancelled a step, an env or infra error, truncation) closes the env. Idle envs are closed after
`idle_s` and on shutdown, so whatever they hold (a sandbox lease) is released.
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
    def __init__(self, size: int, idle_s: float, max_total: int) -> None:
        self.size, self.idle_s, self.max_total = size, idle_s, max_total
        self.idle: dict[str, deque[tuple[Env, float]]] = {}  # no empty deque: a key per value seen

    def take(self, env_id: str, kwargs: dict[str, Any]) -> Env:
        """An idle env for these settings, or a new one from `reflow.env.make`."""
        key = pool_key(env_id, kwargs)
        idle = self.idle.get(key)
        if idle:
            env = idle.pop()[0]
            if not idle:
                del self.idle[key]
            return env
        return make(env_id, **kwargs)

    async def give_back(self, env_id: str, kwargs: dict[str, Any], env: Env) -> None:
        key = pool_key(env_id, kwargs)
        if len(self.idle.get(key, ())) >= self.size or self.max_total < 1:
            await close_env(env)
            return
        if len(self) >= self.max_total:
            await close_env(self._pop_oldest())
        self.idle.setdefault(key, deque()).append((env, time.monotonic()))

    def _pop_oldest(self) -> Env:
        key = min(self.idle, key=lambda k: self.idle[k][0][1])
        env = self.idle[key].popleft()[0]
        if not self.idle[key]:
            del self.idle[key]
        return env

    async def reap(self) -> int:
        """Close envs idle for longer than `idle_s`; returns how many."""
        cutoff, doomed = time.monotonic() - self.idle_s, []
        for key, idle in list(self.idle.items()):
            while idle and idle[0][1] < cutoff:
                doomed.append(idle.popleft()[0])
            if not idle:
                del self.idle[key]
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
