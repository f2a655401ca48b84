"""EpisodeDeadline: a wall-clock budget for the whole episode, reset included.

A step that would run past the deadline is cancelled and the episode ends with status "timeout"; so
does the first step after the deadline has passed (the time the policy spent counts too).
"""

from __future__ import annotations

import asyncio
import time

from reflow.env.core import AssistantTurn, Env, Observation, StepResult, Task, Wrapper


class EpisodeDeadline(Wrapper):
    def __init__(self, env: Env, deadline_s: float) -> None:
        super().__init__(env)
        if deadline_s <= 0:
            raise ValueError(f"deadline_s must be > 0, got {deadline_s}")
        self.deadline_s = deadline_s
        self.deadline: float | None = None

    async def reset(self, *, task: Task | None = None, seed: int | None = None) -> Observation:
        self.deadline = time.monotonic() + self.deadline_s
        try:
            return await asyncio.wait_for(self.env.reset(task=task, seed=seed), self.deadline_s)
        except asyncio.TimeoutError:
            raise TimeoutError(
                f"{self.unwrapped!r}: reset took longer than the {self.deadline_s}s deadline"
            ) from None

    async def step(self, turn: AssistantTurn) -> StepResult:
        left = (self.deadline or time.monotonic()) - time.monotonic()
        if left > 0:
            try:
                return await asyncio.wait_for(self.env.step(turn), left)
            except asyncio.TimeoutError:
                pass
        return StepResult(
            messages=[],
            truncated=True,
            info={
                "status": "timeout",
                "termination": "deadline",
                "error": f"episode deadline of {self.deadline_s}s passed",
            },
        )
