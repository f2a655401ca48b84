"""One env's use of pooled sandboxes: a lease per episode, taken on the first call and handed back after.

`SandboxSession` is what an env holds. Its first call in an episode acquires a sandbox from a pool;
`end_episode()` (on reset, after grading, on close) releases it for reset; if the sandbox dies in the
middle of an episode (an OOM kill of the tool server, the engine restarting) the session drops it, the
call reports a tool error, and the next call gets a fresh sandbox. A session that is garbage-collected
without `close()` still gives its sandbox back. `code_runner.SandboxCodeRunner` runs an env's Python
through one.
"""

from __future__ import annotations

import weakref
from typing import Any

from reflow.sandbox.base import Sandbox, ToolOutput
from reflow.sandbox.pool import SandboxPool


def _give_back(pool: SandboxPool, holder: list[Sandbox]) -> None:
    while holder:
        pool.release(holder.pop())


class SandboxSession:
    def __init__(self, pool: SandboxPool, *, episode_timeout_s: float | None = None) -> None:
        self.pool = pool
        self.episode_timeout_s = episode_timeout_s
        self._holder: list[Sandbox] = []  # shared with the finalizer, which must not hold self
        self._finalizer = weakref.finalize(self, _give_back, pool, self._holder)

    @property
    def current(self) -> Sandbox | None:
        return self._holder[0] if self._holder else None

    async def sandbox(self) -> Sandbox:
        """The episode's sandbox, acquired on first use."""
        if not self._holder:
            self._holder.append(await self.pool.aacquire(episode_timeout_s=self.episode_timeout_s))
        return self._holder[0]

    async def run_tool(
        self, name: str, args: dict[str, Any] | None = None, *, timeout_s: float | None = None
    ) -> ToolOutput:
        sandbox = await self.sandbox()
        out = await sandbox.run_tool(name, args, timeout_s=timeout_s)
        if not out.ok and not out.timed_out and not await sandbox.is_alive():
            await self.end_episode(discard=True)
            out.error = f"{out.error}; the sandbox was replaced, files written so far are gone"
        return out

    async def end_episode(self, *, discard: bool = False) -> None:
        """Hand the sandbox back (it is reset before anyone else gets it)."""
        while self._holder:
            self.pool.release(self._holder.pop(), discard=discard)

    async def close(self) -> None:
        await self.end_episode()
