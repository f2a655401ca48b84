"""OrderEnforcing: `step` before `reset`, or after the episode ended, is a clear error; `close` is idempotent.

It also fills in `info["status"] = "ok"` on a normal end, so every finished episode carries a status.
"""

from __future__ import annotations

from reflow.env.core import AssistantTurn, Observation, ResetNeeded, StepResult, Task, Wrapper


class OrderEnforcing(Wrapper):
    _state = "new"  # new -> running -> done -> (reset) running ...; closed is final

    async def reset(self, *, task: Task | None = None, seed: int | None = None) -> Observation:
        if self._state == "closed":
            raise ResetNeeded(f"{self.unwrapped!r} is closed")
        obs = await self.env.reset(task=task, seed=seed)
        self._state = "running"
        return obs

    async def step(self, turn: AssistantTurn) -> StepResult:
        if self._state != "running":
            what = {"new": "before reset()", "done": "after the episode ended", "closed": "after close()"}
            raise ResetNeeded(f"step() called {what[self._state]} on {self.unwrapped!r}; call reset() first")
        result = await self.env.step(turn)
        if result.done:
            self._state = "done"
            result.info.setdefault("status", "ok" if result.terminated else "truncated")
            result.info.setdefault("termination", "terminated" if result.terminated else "truncated")
        return result

    async def close(self) -> None:
        if self._state != "closed":
            self._state = "closed"
            await self.env.close()
