"""LongTail-v0: a pointer walk whose length is heavy-tailed, like agentic coding episodes.

A task is a trail of k keys. The agent calls `lookup(key)` from the start key; each call answers
"next key: K" until the last key, which answers "value: N"; the agent then replies `\\boxed{N}`.
A perfect player needs exactly k tool calls and one answer turn, k + 1 turns in all. k follows a
truncated Zipf law, P(k) proportional to k^-s on min_hops..max_hops (defaults s = 1.5 on 1..64):
half the tasks take 1-2 hops, one in a hundred takes more than 50, so turns and generated tokens
have p99/p50 above 10. Each turn's output is one short call, so a tiny model can play it; the
long tail of episode lengths is what the tail scheduler has to balance.

Reward: 1 for the right value, else 0 (`hops_done`, the share of the trail walked, is reported as
a reward component but not rewarded).
"""

from __future__ import annotations

import random
import re
from typing import Any, ClassVar

from reflow.env import (
    AssistantTurn,
    Message,
    Observation,
    StepResult,
    Task,
    Tool,
    ToolEnv,
    ToolError,
    format_hermes_call,
)
from reflow.env.answers import extract_boxed, parse_number

SYSTEM_PROMPT = (
    "You follow a trail of keys. Call the lookup tool with a key, one call per turn: it answers with the "
    "next key, or with the value at the end of the trail. Reply with that value as \\boxed{N}."
)
_ALPHABET = "abcdefghijkmnpqrstuvwxyz23456789"  # no l/1/o/0 look-alikes
_NEXT = re.compile(r"^next key: ([a-z0-9]+)$")
_VALUE = re.compile(r"^value: (-?\d+)$")


def hop_weights(min_hops: int, max_hops: int, exponent: float) -> dict[int, float]:
    """The truncated Zipf law of trail lengths: k -> k^-exponent on min_hops..max_hops."""
    return {k: k**-exponent for k in range(min_hops, max_hops + 1)}


class LongTailEnv(ToolEnv):
    required_task_keys = ("id", "trail", "answer")
    # Warm start on short trails: every hop is the same copy-the-key skill, and short demos keep
    # the warm-start batches small; RL then meets the whole tail.
    demo_kwargs: ClassVar[dict[str, Any]] = {"max_hops": 8}

    def __init__(
        self,
        tasks: list[Task] | str | None = None,
        max_hops: int = 64,
        min_hops: int = 1,
        exponent: float = 1.5,
    ) -> None:
        super().__init__(tasks)
        if not 1 <= min_hops <= max_hops:
            raise ValueError(f"need 1 <= min_hops <= max_hops, got min_hops={min_hops}, max_hops={max_hops}")
        if not exponent > 0:
            raise ValueError(f"exponent must be > 0 (larger: lighter tail), got {exponent}")
        self.min_hops, self.max_hops, self.exponent = min_hops, max_hops, exponent
        self.tools = [Tool.from_function(self.lookup)]
        self.walked = 0

    def lookup(self, key: str) -> str:
        """Look a key up: returns the next key of the trail, or the value at its end.

        Args:
            key: a key from the question or from the previous lookup, e.g. "k7qz".
        """
        trail = self.task["trail"]
        key = key.strip()
        if key not in trail:
            # A key is a few characters: a longer one is echoed cut, so a turn cannot make the answer
            # many times its own size (the repr of a megabyte of control characters is four).
            raise ToolError(f"no entry for key {key[:32]!r}" + (" (cut)" if len(key) > 32 else ""))
        i = trail.index(key)
        self.walked = max(self.walked, i + 1)
        return f"value: {self.task['answer']}" if i == len(trail) - 1 else f"next key: {trail[i + 1]}"

    def generate_task(self, rng: random.Random) -> Task:
        weights = hop_weights(self.min_hops, self.max_hops, self.exponent)
        hops = rng.choices(list(weights), weights=list(weights.values()))[0]
        trail: list[str] = []
        while len(trail) < hops:
            key = "".join(rng.choice(_ALPHABET) for _ in range(4))
            if key not in trail:
                trail.append(key)
        return {"id": f"longtail-{rng.getrandbits(48):012x}", "trail": trail, "answer": rng.randint(0, 999)}

    async def _reset(self, task: Task) -> Observation:
        self.walked = 0
        question = f"The trail starts at key {task['trail'][0]}. What value is at its end?"
        messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}]
        return Observation(messages, info={"hops": len(task["trail"])})

    async def answer(self, turn: AssistantTurn) -> StepResult:
        given = parse_number(extract_boxed(turn.content))
        correct = given is not None and given == float(self.task["answer"])
        hops_done = self.walked / len(self.task["trail"])
        return StepResult.final(
            correct,
            termination="answered" if given is not None else "no_answer",
            components={"correct": float(correct), "hops_done": hops_done},
        )

    def demo(self, task: Task, messages: list[Message], rng: random.Random, error_rate: float = 0.0) -> str:
        """Look up the last key seen (the start key first); answer once the value shows. With
        probability `error_rate` per turn, slip: a mistyped key, a malformed call, or a guessed answer."""
        key, value = task["trail"][0], None
        for m in messages:
            if m["role"] != "tool":
                continue
            if match := _NEXT.match(m["content"]):
                key = match.group(1)
            elif match := _VALUE.match(m["content"]):
                value = match.group(1)
        if value is not None:
            return f"The value is \\boxed{{{value}}}."
        if rng.random() < error_rate:
            slip = rng.random()
            if slip < 0.4:
                typo = key[:-1] + rng.choice([c for c in _ALPHABET if c != key[-1]])
                return format_hermes_call("lookup", {"key": typo})
            if slip < 0.7:
                return '<tool_call>\n{"name": "lookup", "arguments": {"key": "' + key + '"}\n</tool_call>'
            return f"The value is \\boxed{{{rng.randint(0, 999)}}}."
        return format_hermes_call("lookup", {"key": key})
