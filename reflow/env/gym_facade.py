"""The Gymnasium facade: any ReFlow env as a synchronous `gymnasium.Env`.

`gymnasium.make("reflow/Calc-v0")` returns this. Observations are the new chat messages (a list of
dicts); an action is the model's raw text (or an `AssistantTurn`), parsed with the named tool-call
parser. The async env runs on a private event loop in a background thread, so the facade also works
from code that already runs an event loop (a notebook, a server).

`info` carries everything the async API reports except wall-clock latencies, which would make a seeded
episode non-reproducible; use the async API (`reflow.make`) when you need timings.
"""

from __future__ import annotations

import asyncio
import copy
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

import gymnasium

from reflow.env.core import AssistantTurn, Message
from reflow.env.parsers import parse_assistant
from reflow.env.registration import build_env
from reflow.env.spaces import AssistantText, ChatMessages

T = TypeVar("T")


class _LoopThread:
    """An event loop running in a daemon thread; `run` waits for one coroutine on it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="reflow-gym-facade", daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def stop(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=5)
        if not self.loop.is_running():
            self.loop.close()


def _strip_latency(info: dict[str, Any]) -> dict[str, Any]:
    info = copy.deepcopy(info)
    for result in info.get("tool_results", []):
        result.pop("latency_s", None)
    return info


class GymFacade(gymnasium.Env):
    metadata = {"render_modes": ["ansi"], "render_fps": 1}  # noqa: RUF012  (Gymnasium's convention)

    def __init__(
        self,
        env_entry_point: str,
        env_kwargs: dict[str, Any],
        max_turns: int | None = None,
        deadline_s: float | None = None,
        parser: str = "hermes",
        render_mode: str | None = None,
    ) -> None:
        if render_mode not in (None, "ansi"):
            raise ValueError(f"render_mode must be None or 'ansi', got {render_mode!r}")
        self.render_mode = render_mode
        self.parser = parser
        self.max_turns = max_turns
        self._runner = _LoopThread()
        self.env = build_env(env_entry_point, env_kwargs, max_turns, deadline_s)
        self.observation_space = ChatMessages(max_messages=max(64, 4 * (max_turns or 16)))
        self.action_space = AssistantText()
        self.transcript: list[Message] = []
        self.tools: list[dict[str, Any]] = []
        self._closed = False

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        options = options or {}
        # Without a seed, the next task comes from the seeded np_random, so reset() after
        # reset(seed=s) is reproducible too.
        task_seed = seed if seed is not None else int(self.np_random.integers(2**31 - 1))
        obs = self._runner.run(self.env.reset(task=options.get("task"), seed=task_seed))
        self.tools = obs.tools
        self.transcript = copy.deepcopy(obs.messages)
        info = copy.deepcopy({**obs.info, "tools": obs.tools, "seed": task_seed})
        return copy.deepcopy(obs.messages), info

    def step(self, action: str | AssistantTurn):
        if isinstance(action, str):
            turn = parse_assistant(action, parser=self.parser, tools=self.env.unwrapped.tools)
        elif isinstance(action, AssistantTurn):
            turn = action
        else:
            raise TypeError(
                f"action must be the model's text (str) or an AssistantTurn, got {type(action).__name__}"
            )
        result = self._runner.run(self.env.step(turn))
        self.transcript += [turn.to_message(), *copy.deepcopy(result.messages)]
        return (
            copy.deepcopy(result.messages),
            float(result.reward),
            bool(result.terminated),
            bool(result.truncated),
            _strip_latency(result.info),
        )

    def render(self) -> str | None:
        if self.render_mode != "ansi":
            return None
        lines = []
        for m in self.transcript:
            lines.append(f"[{m['role']}] {m.get('content', '')}")
            for call in m.get("tool_calls", []):
                lines.append(f"  -> {call['function']['name']}({call['function']['arguments']})")
        return "\n".join(lines)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._runner.run(self.env.close())
        finally:
            self._runner.stop()
