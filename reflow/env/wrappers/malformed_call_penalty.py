"""MalformedCallPenalty: each tool call whose text did not parse costs `penalty` reward.

Without it a failed episode that loops on calls the parser rejects scores what a failure of well-formed
calls scores, so a group of failures carries no signal against a broken call format, and the
successes alone hold the format up. Each rejected call (`ToolCall.parse_error`) subtracts `penalty`
from its step's reward; the final step's reward components show the episode's total as
"malformed_calls". Success is unchanged.
"""

from __future__ import annotations

import math

from reflow.env.core import AssistantTurn, Env, Observation, StepResult, Task, Wrapper


class MalformedCallPenalty(Wrapper):
    def __init__(self, env: Env, penalty: float) -> None:
        super().__init__(env)
        if not (math.isfinite(penalty) and penalty > 0):
            raise ValueError(f"penalty must be a finite number > 0, got {penalty}")
        self.penalty = penalty
        self.total = 0.0

    async def reset(self, *, task: Task | None = None, seed: int | None = None) -> Observation:
        self.total = 0.0
        return await self.env.reset(task=task, seed=seed)

    async def step(self, turn: AssistantTurn) -> StepResult:
        result = await self.env.step(turn)
        cost = self.penalty * sum(1 for call in turn.tool_calls if call.parse_error)
        result.reward -= cost
        self.total += cost
        if result.done and self.total:
            result.info.setdefault("reward_components", {})["malformed_calls"] = -self.total
        return result
