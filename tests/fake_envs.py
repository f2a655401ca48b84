"""Small envs used by the tests to drive failure paths (crashes, slow steps) through `reflow.make`."""

from __future__ import annotations

import asyncio
import random

from reflow.env import AssistantTurn, Env, Observation, StepResult, Task, Tool, ToolEnv

BUILTIN_ENVS = [
    "reflow/Calc-v0",
    "reflow/Guess-v0",
    "reflow/LongTail-v0",
    "reflow/Math-v0",
    "reflow/PyCode-v0",
]

TEST_ENVS = {
    "test/Crashy-v0": ("fake_envs:CrashyEnv", {}),
    "test/Slow-v0": ("fake_envs:SlowEnv", {}),
    "test/Echo-v0": ("fake_envs:EchoEnv", {}),
    "test/Parity-v0": ("fake_envs:ParityEnv", {}),
}


def register_test_envs() -> None:
    from reflow.env import register

    for env_id, (entry_point, kwargs) in TEST_ENVS.items():
        register(env_id, entry_point=entry_point, max_turns=5, kwargs=kwargs)


class EchoEnv(ToolEnv):
    """Never ends by itself: each turn gets an echo tool; `answer` echoes back."""

    def __init__(self, tasks=None, greeting: str = "hello") -> None:
        super().__init__(tasks)
        self.greeting = greeting
        self.tools = [Tool.from_function(self.echo)]
        self.closed = 0

    def echo(self, text: str, times: int = 1) -> str:
        """Echo text back.

        Args:
            text: what to echo.
            times: how many times.
        """
        return text * times

    def generate_task(self, rng: random.Random) -> Task:
        return {"id": f"echo-{rng.randint(0, 10**9)}"}

    async def _reset(self, task: Task) -> Observation:
        return Observation([{"role": "user", "content": self.greeting}])

    async def answer(self, turn: AssistantTurn) -> StepResult:
        return StepResult([{"role": "user", "content": f"you said: {turn.content}"}])

    async def close(self) -> None:
        self.closed += 1


class CrashyEnv(EchoEnv):
    """Raises inside step on the turn named by the task (or on every turn with crash_on=0); with
    `leak_path`, an error whose text names a file of this host, as a failed read of task data would."""

    def __init__(
        self, tasks=None, crash_on: int = 2, crash_reset: bool = False, leak_path: bool = False
    ) -> None:
        super().__init__(tasks)
        self.crash_on, self.crash_reset, self.leak_path, self.turn = crash_on, crash_reset, leak_path, 0

    async def _reset(self, task: Task) -> Observation:
        if self.crash_reset == "infra":
            from reflow.env import InfraError

            raise InfraError("sandbox failed to start")
        if self.crash_reset:
            raise KeyError("database of tasks is gone")
        self.turn = 0
        return await super()._reset(task)

    async def step(self, turn: AssistantTurn) -> StepResult:
        self.turn += 1
        if self.turn >= self.crash_on and self.leak_path:
            raise FileNotFoundError(2, "No such file or directory", __file__ + ".missing")
        if self.turn >= self.crash_on:
            raise ZeroDivisionError("the env divided by zero")
        return await super().step(turn)


class SlowEnv(Env):
    """Each step sleeps `step_s` seconds."""

    def __init__(self, tasks=None, step_s: float = 0.0, reset_s: float = 0.0) -> None:
        super().__init__(tasks)
        self.step_s, self.reset_s = step_s, reset_s

    def generate_task(self, rng: random.Random) -> Task:
        return {"id": "slow"}

    async def _reset(self, task: Task) -> Observation:
        await asyncio.sleep(self.reset_s)
        return Observation([{"role": "user", "content": "wait"}])

    async def step(self, turn: AssistantTurn) -> StepResult:
        await asyncio.sleep(self.step_s)
        return StepResult([{"role": "user", "content": "ok"}])


class ParityEnv(Env):
    """One turn; reward 1 when the reply has an even number of characters. Even an untrained model
    gets both rewards within a group, so RL tests have a learning signal without a warm start."""

    async def reset(self, *, task: Task | None = None, seed: int | None = None) -> Observation:
        self.task = task or self.pick_task(seed)
        return Observation([{"role": "user", "content": "Say something."}])

    def generate_task(self, rng: random.Random) -> Task:
        return {"id": f"parity-{rng.randint(0, 10**9)}"}

    async def step(self, turn: AssistantTurn) -> StepResult:
        even = len(turn.content) % 2 == 0
        return StepResult.final(even, termination="answered", components={"even": float(even)})
