"""EpisodeDeadline: a wall-clock budget for the whole episode, reset included.

A step that would run past the deadline is cancelled and the episode ends with status "timeout"; so
does the first step after the deadline has passed (the time the policy spent counts too, but not the
time its generation was paused by the trainer's turn: `extend_deadlines`).
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

    def extend(self, seconds: float) -> None:
        if self.deadline is not None:
            self.deadline += seconds

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


def extend_deadlines(env: Env, seconds: float) -> None:
    """Move every `EpisodeDeadline` in `env`'s wrapper chain `seconds` later (an episode whose generation
    waited that long, paused, did not spend them)."""
    while env is not None:
        if isinstance(env, EpisodeDeadline):
            env.extend(seconds)
        env = getattr(env, "env", None)
