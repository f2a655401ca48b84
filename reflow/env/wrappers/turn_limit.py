"""TurnLimit: truncate the episode after `max_turns` assistant turns (status "truncated")."""

from __future__ import annotations

from reflow.env.core import AssistantTurn, Env, Observation, StepResult, Task, Wrapper


class TurnLimit(Wrapper):
    def __init__(self, env: Env, max_turns: int) -> None:
        super().__init__(env)
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        self.max_turns = max_turns
        self.turns = 0

    async def reset(self, *, task: Task | None = None, seed: int | None = None) -> Observation:
        self.turns = 0
        return await self.env.reset(task=task, seed=seed)

    async def step(self, turn: AssistantTurn) -> StepResult:
        result = await self.env.step(turn)
        self.turns += 1
        if not result.done and self.turns >= self.max_turns:
            result.truncated = True
            result.info.setdefault("status", "truncated")
            result.info.setdefault("termination", "max_turns")
        return result
