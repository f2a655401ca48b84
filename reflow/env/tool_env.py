"""`ToolEnv`: the common shape of a tool-using agent environment.

A turn with tool calls gets one tool message per call (an error message for a malformed call, an
unknown tool or bad arguments) and the episode goes on; a turn without tool calls is the agent's answer,
which the subclass grades in `answer`. Subclasses can end an episode from a tool (a game won) by
overriding `after_tools`.
"""

from __future__ import annotations

from dataclasses import asdict

from reflow.env.core import AssistantTurn, Env, Message, StepResult
from reflow.env.tools import ToolResult, validate_calls


def tool_message(result: ToolResult) -> Message:
    return {
        "role": "tool",
        "tool_call_id": result.call_id,
        "name": result.name or "invalid_tool_call",
        "content": result.content,
    }


class ToolEnv(Env):
    """An env whose actions are tool calls, ending with an answer the env grades."""

    async def step(self, turn: AssistantTurn) -> StepResult:
        if not turn.tool_calls:
            return await self.answer(turn)
        results = await self.call_tools(turn)
        info = {
            "tool_results": [asdict(r) for r in results],
            "parse_errors": turn.parse_errors,
        }
        return await self.after_tools(
            turn, results, StepResult([tool_message(r) for r in results], info=info)
        )

    async def call_tools(self, turn: AssistantTurn) -> list[ToolResult]:
        validate_calls(turn.tool_calls, self.tools)
        by_name = {t.name: t for t in self.tools}
        results = []
        for call in turn.tool_calls:  # in order: later calls may depend on the effects of earlier ones
            if call.parse_error:
                results.append(ToolResult(call.id, call.name, f"Error: {call.parse_error}", ok=False))
            else:
                results.append(await by_name[call.name](call))
        return results

    async def after_tools(
        self, turn: AssistantTurn, results: list[ToolResult], step: StepResult
    ) -> StepResult:
        """Hook after the tool messages are built; the default goes on with the episode."""
        return step

    async def answer(self, turn: AssistantTurn) -> StepResult:
        """Grade a turn without tool calls (the agent's final answer)."""
        raise NotImplementedError
