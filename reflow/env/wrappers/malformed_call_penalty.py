"""MalformedCallPenalty: each tool call the parser rejected costs `penalty` reward.

Without it a failed episode that loops on calls the parser rejects (`ToolCall.parse_error`: text that
does not parse, an unknown tool, arguments off the tool's schema) scores what a failure of well-formed
calls scores, so a group of failures carries no signal against a broken call format, and the
successes alone hold the format up. Each rejected call subtracts `penalty` from its step's reward
(the turn's reward in the records shows it; the episode's reward is the steps' sum). Success is
unchanged. With GRPO's std scaling a group whose only difference is this cost gets advantages of full
size: the penalty's size sets the order of episodes, not the strength of the signal.
"""

from __future__ import annotations

import math

from reflow.env.core import AssistantTurn, Env, StepResult, Wrapper


class MalformedCallPenalty(Wrapper):
    def __init__(self, env: Env, penalty: float) -> None:
        super().__init__(env)
        if not (math.isfinite(penalty) and penalty > 0):
            raise ValueError(f"penalty must be a finite number > 0, got {penalty}")
        self.penalty = penalty

    async def step(self, turn: AssistantTurn) -> StepResult:
        result = await self.env.step(turn)
        result.reward -= self.penalty * turn.parse_errors  # counted after the env's schema check
        return result
