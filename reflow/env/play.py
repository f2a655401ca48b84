"""Play text-level episodes: a policy that writes raw assistant text against any env.

This is the token-free loop used by `reflow envs play`, the env checker and tests. (The training
rollout in `reflow.rollout` keeps token ids as well; it follows the same statuses.)
"""

from __future__ import annotations

import inspect
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from reflow.env.core import Env, EnvError, Message
from reflow.env.parsers import parse_assistant

Policy = Callable[[list[Message], list[dict[str, Any]]], "str | Awaitable[str]"]
"""(chat history so far, tool schemas) -> the raw text of the next assistant turn."""


@dataclass
class PlayedTurn:
    """One turn of a played episode, for the CLI's summaries (the training record is
    `reflow.records.TurnRecord`)."""

    index: int
    raw_text: str
    tool_calls: list[dict[str, Any]]
    env_messages: list[Message]
    reward: float
    policy_s: float
    env_s: float


@dataclass
class EpisodeResult:
    env_id: str | None
    task_id: Any
    seed: int | None
    status: str
    termination: str
    reward: float
    success: bool
    turns: int
    messages: list[Message] = field(default_factory=list)
    records: list[PlayedTurn] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def episode_stats(
    successes: list[bool], rewards: list[float], turns: list[int], statuses: list[str]
) -> dict[str, Any]:
    """Success rate, mean reward, episode length p50/p90/max (turns) and status counts of a batch."""
    lengths = np.array(turns or [0])
    return {
        "episodes": len(successes),
        "success_rate": float(np.mean(successes)) if successes else 0.0,
        "reward_mean": float(np.mean(rewards)) if rewards else 0.0,
        "turns_p50": float(np.percentile(lengths, 50)),
        "turns_p90": float(np.percentile(lengths, 90)),
        "turns_max": int(lengths.max()),
        "statuses": dict(Counter(statuses)),
    }


def has_demo(env: Env) -> bool:
    """Whether the env class overrides `Env.demo` (offers a scripted policy)."""
    return type(env.unwrapped).demo is not Env.demo


def scripted_policy(env: Env, error_rate: float = 0.0, seed: int | None = None) -> Policy:
    """The env's own demonstration policy as a Policy (it reads the env's current task)."""
    rng = random.Random(seed)

    def policy(messages: list[Message], tools: list[dict[str, Any]]) -> str:
        task = env.unwrapped.task
        if task is None:
            raise RuntimeError("scripted policy called before reset")
        return env.demo(task, messages, rng, error_rate)

    return policy


async def play_episode(
    env: Env,
    policy: Policy,
    *,
    task: dict[str, Any] | None = None,
    seed: int | None = None,
    parser: str = "hermes",
    max_steps: int = 1000,
) -> EpisodeResult:
    """Run one episode to its end. Policy failures are infra_error; env failures env_error."""
    start = time.perf_counter()
    env_id = env.unwrapped.spec_id
    try:
        obs = await env.reset(task=task, seed=seed)
    except EnvError as e:
        return EpisodeResult(env_id, None, seed, "env_error", "reset_failed", 0.0, False, 0, error=str(e))
    except TimeoutError as e:
        return EpisodeResult(env_id, None, seed, "timeout", "deadline", 0.0, False, 0, error=str(e))
    history = list(obs.messages)
    result = EpisodeResult(env_id, obs.info.get("task_id"), seed, "truncated", "max_steps", 0.0, False, 0)
    for index in range(max_steps):
        t0 = time.perf_counter()
        try:
            text = policy(history, obs.tools)
            if inspect.isawaitable(text):
                text = await text
        except Exception as e:
            result.status, result.termination, result.error = (
                "infra_error",
                "policy_failed",
                f"{type(e).__name__}: {e}",
            )
            break
        t1 = time.perf_counter()
        turn = parse_assistant(text, parser=parser, tools=env.unwrapped.tools)
        step = await env.step(turn)
        t2 = time.perf_counter()
        history += [turn.to_message(), *step.messages]
        result.reward += step.reward
        result.turns = index + 1
        result.records.append(
            PlayedTurn(
                index,
                text,
                [asdict(c) for c in turn.tool_calls],
                step.messages,
                step.reward,
                t1 - t0,
                t2 - t1,
            )
        )
        if step.done:
            result.status = step.info.get("status", "ok" if step.terminated else "truncated")
            result.termination = step.info.get("termination", "")
            result.success = bool(step.info.get("success", False))
            result.error = step.info.get("error")
            result.info = {k: v for k, v in step.info.items() if k not in ("tool_results",)}
            break
    result.messages = history
    result.seconds = time.perf_counter() - start
    return result
