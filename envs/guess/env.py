"""Guess-v0: a multi-turn game with feedback and variable length.

A secret integer lies in [1, N], with N from 8 to 1024 per task, so a perfect player needs 3 to 10
guesses. Each `guess` call answers "too low", "too high" or "correct". Reward: 1 when the number is
found before the turn limit, else 0.
"""

from __future__ import annotations

import random
import re

from reflow.env import (
    AssistantTurn,
    Message,
    Observation,
    StepResult,
    Task,
    Tool,
    ToolEnv,
    ToolError,
    ToolResult,
    format_hermes_call,
)

SYSTEM_PROMPT = (
    "You play a guessing game. Find the secret number with the guess tool, one guess per turn. "
    "Each guess is answered with 'too low', 'too high' or 'correct'."
)
RANGES = [8, 16, 32, 64, 128, 256, 512, 1024]
_FEEDBACK = re.compile(r"^(-?\d+) is (too low|too high|correct)")


class GuessEnv(ToolEnv):
    required_task_keys = ("id", "high", "secret")

    def __init__(self, tasks: list[Task] | str | None = None) -> None:
        super().__init__(tasks)
        self.tools = [Tool.from_function(self.guess)]
        self.found = False
        self.guesses = 0

    def guess(self, number: int) -> str:
        """Guess the secret number.

        Args:
            number: your guess, an integer within the announced range.
        """
        high = self.task["high"]
        if not 1 <= number <= high:
            raise ToolError(f"{number} is outside the range 1 to {high}")
        self.guesses += 1
        secret = self.task["secret"]
        if number == secret:
            self.found = True
            return f"{number} is correct"
        return f"{number} is {'too low' if number < secret else 'too high'}"

    def generate_task(self, rng: random.Random) -> Task:
        high = rng.choice(RANGES)
        return {"id": f"guess-{rng.getrandbits(48):012x}", "high": high, "secret": rng.randint(1, high)}

    async def _reset(self, task: Task) -> Observation:
        self.found, self.guesses = False, 0
        prompt = (
            f"I am thinking of an integer from 1 to {task['high']}. Find it in as few guesses as you can."
        )
        messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": prompt}]
        return Observation(messages)

    async def after_tools(
        self, turn: AssistantTurn, results: list[ToolResult], step: StepResult
    ) -> StepResult:
        if self.found:
            step.reward, step.terminated = 1.0, True
            step.info.update(
                success=True, guesses=self.guesses, termination="found", reward_components={"found": 1.0}
            )
        return step

    async def answer(self, turn: AssistantTurn) -> StepResult:
        # Talking instead of guessing costs a turn; the turn limit ends a stalled game.
        nudge = {"role": "user", "content": "Please make a guess with the guess tool."}
        return StepResult([nudge], info={"success": False})

    def demo(self, task: Task, messages: list[Message], rng: random.Random, error_rate: float = 0.0) -> str:
        """Binary search on the feedback so far; a slip is a malformed call, a random guess in the
        remaining range, or a guess on the wrong side of a hint (a misread hint)."""
        low, high = 1, task["high"]
        for m in messages:
            match = _FEEDBACK.match(m.get("content", "")) if m["role"] == "tool" else None
            if match:
                n, verdict = int(match.group(1)), match.group(2)
                if verdict == "too low":
                    low = max(low, n + 1)
                elif verdict == "too high":
                    high = min(high, n - 1)
        pick = (low + high) // 2
        if rng.random() < error_rate:
            slip = rng.random()
            if slip < 0.2:
                return (
                    '<tool_call>\n{"name": "guess", "arguments": {"number": ' + str(pick) + "}\n</tool_call>"
                )
            if slip < 0.6:
                pick = rng.randint(low, max(low, high))
            else:
                outside = [n for n in (low - 1, high + 1) if 1 <= n <= task["high"]]
                pick = rng.choice(outside) if outside else pick
        return format_hermes_call("guess", {"number": pick})
