"""A PyCode env that holds a Docker sandbox for every episode (an untrained model never calls a tool),
from a pool whose containers carry a name of the test's choosing: a run's sandboxes can be counted."""

from __future__ import annotations

import os
import threading

from reflow_envs.pycode.env import PyCodeEnv
from sandbox_helpers import LIMITS

from reflow.env import Observation, Task
from reflow.sandbox import SandboxPool, make_sandbox
from reflow.sandbox.code_runner import SandboxCodeRunner

_pools: dict[tuple[str, int], SandboxPool] = {}
_lock = threading.Lock()


def _pool(name: str) -> SandboxPool:
    with _lock:
        key = (name, os.getpid())
        if key not in _pools:
            _pools[key] = SandboxPool(
                lambda: make_sandbox("docker", LIMITS, pool=name), size=1, max_live=8, name=name
            )
        return _pools[key]


class SandboxHoldEnv(PyCodeEnv):
    def __init__(self, tasks=None, pool: str = "tests-hold") -> None:
        super().__init__(tasks, sandbox=SandboxCodeRunner("docker", _pool(pool)))

    async def _reset(self, task: Task) -> Observation:
        obs = await super()._reset(task)
        await self.runner.run_python("pass")  # the episode's sandbox is leased from here on
        return obs


def register() -> None:
    from reflow.env import register

    register("test/SandboxHold-v0", entry_point="sandbox_envs:SandboxHoldEnv", max_turns=2)
