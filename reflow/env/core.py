"""The environment API: message-level, async agent environments.

An environment never sees tokens. It hands out chat messages and tool schemas on `reset`, receives the
model's turn as an `AssistantTurn` (text plus parsed tool calls) on `step`, and answers with new messages,
a reward and the episode flags. Everything here is plain dataclasses so that records stay
JSON-serialisable and the env server can ship them over the wire unchanged.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from reflow.env.tasks import Task, load_tasks
from reflow.env.tools import AnyTool, ToolCall

Message = dict[str, Any]
"""One chat message in OpenAI form: {"role": ..., "content": ..., optional "tool_calls"/"tool_call_id"/"name"}."""


EpisodeStatus = Literal["ok", "truncated", "timeout", "env_error", "infra_error"]
EPISODE_STATUSES: tuple[str, ...] = ("ok", "truncated", "timeout", "env_error", "infra_error")


@dataclass
class AssistantTurn:
    """What the policy said in one turn: visible content, optional reasoning, and its tool calls."""

    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    reasoning: str | None = None
    finish_reason: str = "stop"
    raw_text: str | None = None

    @property
    def parse_errors(self) -> int:
        """Its tool calls the parser (or the env's schema check) rejected: `ToolCall.parse_error` set."""
        return sum(1 for call in self.tool_calls if call.parse_error)

    def to_message(self) -> Message:
        """The assistant message to append to the chat history."""
        msg: Message = {"role": "assistant", "content": self.content}
        if self.reasoning:
            msg["reasoning_content"] = self.reasoning
        if self.tool_calls:
            msg["tool_calls"] = [call.to_message_call() for call in self.tool_calls]
        return msg


@dataclass
class Observation:
    """What `reset` returns: the opening messages, the tools in OpenAI schema form, and info."""

    messages: list[Message]
    tools: list[dict[str, Any]] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class StepResult:
    """What `step` returns. On the last step `info["status"]` holds the episode status."""

    messages: list[Message]
    reward: float = 0.0
    terminated: bool = False
    truncated: bool = False
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def done(self) -> bool:
        return self.terminated or self.truncated

    @classmethod
    def final(
        cls,
        success: bool,
        *,
        termination: str,
        components: dict[str, float],
        messages: list[Message] | None = None,
        **info: Any,
    ) -> StepResult:
        """The last step of a graded episode: reward 1 on success, else 0, with its components."""
        return cls(
            messages=messages or [],
            reward=1.0 if success else 0.0,
            terminated=True,
            info={"success": success, "reward_components": components, "termination": termination, **info},
        )


class EnvError(RuntimeError):
    """The environment itself failed (a bug or a crash in env code); the episode is marked env_error."""


class InfraError(RuntimeError):
    """Infrastructure under the env failed (a sandbox died, a service is unreachable): the episode is
    marked infra_error, which the trainer masks instead of scoring it 0."""


class ResetNeeded(RuntimeError):
    """`step` was called before `reset` or after the episode ended."""


def task_hash(task: Task) -> str:
    """A short stable hash of a task's full content, for the trajectory record."""
    blob = json.dumps(task, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


class Env:
    """Base class of every ReFlow environment.

    Subclasses implement `generate_task` (seeded, offline), `_reset` and `step`; they may offer a
    scripted demonstration policy through `demo`. `reset(task=None, seed=s)` picks the task: an explicit
    task, else one from `tasks` (loaded from JSONL) chosen by the seed, else a generated one. The task
    (hidden answers and tests included) stays on `env.task`; observations carry only its id and hash.
    """

    metadata: ClassVar[dict[str, Any]] = {}
    required_task_keys: ClassVar[tuple[str, ...]] = ("id",)
    demo_kwargs: ClassVar[dict[str, Any]] = {}
    """Constructor kwargs for warm-start demonstrations: a curriculum (e.g. only short tasks) that
    `reflow warmstart` uses unless told otherwise. Evaluation always uses the env as registered."""

    def __init__(self, tasks: list[Task] | str | None = None) -> None:
        self.tasks: list[Task] | None = load_tasks(tasks) if isinstance(tasks, str) else tasks
        if self.tasks is not None:
            for task in self.tasks:
                self.validate_task(task)
        self.tools: list[AnyTool] = []
        self.task: Task | None = None
        self.spec_id: str | None = None
        self.rng = random.Random()

    # ---- the API -------------------------------------------------------------------------------------
    async def reset(self, *, task: Task | None = None, seed: int | None = None) -> Observation:
        self.rng = random.Random(seed)
        if task is None:
            task = self.pick_task(seed)
        self.validate_task(task)
        self.task = task
        obs = await self._reset(task)
        obs.tools = [t.schema for t in self.tools]
        obs.info.setdefault("task_id", task["id"])
        obs.info.setdefault("task_hash", task_hash(task))
        return obs

    async def step(self, turn: AssistantTurn) -> StepResult:
        raise NotImplementedError

    async def close(self) -> None:
        """Release resources. Must be safe to call more than once."""

    # ---- what subclasses provide ---------------------------------------------------------------------
    async def _reset(self, task: Task) -> Observation:
        raise NotImplementedError

    def generate_task(self, rng: random.Random) -> Task:
        """Make one task from the generator's own seeded random stream (no files, no network)."""
        raise NotImplementedError

    def demo(self, task: Task, messages: list[Message], rng: random.Random, error_rate: float = 0.0) -> str:
        """Scripted demonstration policy: the raw assistant text for the next turn."""
        raise NotImplementedError(f"{type(self).__name__} has no scripted policy")

    # ---- helpers -------------------------------------------------------------------------------------
    def pick_task(self, seed: int | None) -> Task:
        if self.tasks:
            index = (seed if seed is not None else random.randrange(len(self.tasks))) % len(self.tasks)
            return self.tasks[index]
        return self.generate_task(random.Random(seed))

    def validate_task(self, task: Task) -> None:
        if not isinstance(task, dict):
            raise ValueError(f"a task must be a dict, got {type(task).__name__}")
        missing = [key for key in self.required_task_keys if key not in task]
        if missing:
            raise ValueError(f"task {task.get('id', '?')!r} lacks required keys {missing}")

    @property
    def unwrapped(self) -> Env:
        return self

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.spec_id or ''}>".replace(" >", ">")


class Wrapper(Env):
    """Wraps an env to change one behaviour; everything else is forwarded."""

    def __init__(self, env: Env) -> None:  # deliberately no super().__init__: state lives in the inner env
        self.env = env

    async def reset(self, *, task: Task | None = None, seed: int | None = None) -> Observation:
        return await self.env.reset(task=task, seed=seed)

    async def step(self, turn: AssistantTurn) -> StepResult:
        return await self.env.step(turn)

    async def close(self) -> None:
        await self.env.close()

    # Methods Env defines must be forwarded by hand; __getattr__ only sees names the class lacks.
    def generate_task(self, rng: random.Random) -> Task:
        return self.env.generate_task(rng)

    def demo(self, task: Task, messages: list[Message], rng: random.Random, error_rate: float = 0.0) -> str:
        return self.env.demo(task, messages, rng, error_rate)

    def pick_task(self, seed: int | None) -> Task:
        return self.env.pick_task(seed)

    def validate_task(self, task: Task) -> None:
        self.env.validate_task(task)

    @property
    def metadata(self) -> dict[str, Any]:  # type: ignore[override]
        return self.env.metadata

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.env, name)

    @property
    def unwrapped(self) -> Env:
        return self.env.unwrapped

    def __repr__(self) -> str:
        return f"<{type(self).__name__}{self.env!r}>"
