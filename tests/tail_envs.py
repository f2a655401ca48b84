"""A multi-turn env with a long tail for the tail scheduler's run tests: LongParity-v0 plays a task's
number of turns (1 to 8, most tasks short) whatever the model says, then rewards an even-length last
reply, so an untrained tiny model gets reward spread and episodes that last several turns; `step_s`
is each step's latency (a tool call's), so episodes stay in flight long enough to be moved."""

from __future__ import annotations

import asyncio
import random

from reflow.env import AssistantTurn, Env, Observation, StepResult, Task

TURNS = [1, 1, 1, 2, 2, 3, 5, 8]
"""Turns per task, drawn uniformly: p50 2, max 8 (a tail on a small scale)."""


class LongParityEnv(Env):
    def __init__(self, step_s: float = 0.0) -> None:
        super().__init__()
        self.step_s = step_s

    async def reset(self, *, task: Task | None = None, seed: int | None = None) -> Observation:
        self.task = task or self.pick_task(seed)
        self.turn = 0
        return Observation([{"role": "user", "content": "Say something."}])

    def generate_task(self, rng: random.Random) -> Task:
        return {"id": f"long-parity-{rng.randint(0, 10**9)}", "turns": rng.choice(TURNS)}

    async def step(self, turn: AssistantTurn) -> StepResult:
        self.turn += 1
        await asyncio.sleep(self.step_s)
        if self.turn < self.task["turns"]:
            return StepResult([{"role": "user", "content": "Go on."}])
        even = len(turn.content) % 2 == 0
        return StepResult.final(even, termination="answered", components={"even": float(even)})


def register_tail_envs() -> None:
    from reflow.env import register

    register("test/LongParity-v0", entry_point="tail_envs:LongParityEnv", max_turns=10)
