"""Gymnasium spaces for chat environments: a list of chat messages, and free assistant text."""

from __future__ import annotations

import string
from typing import Any

import numpy as np
from gymnasium import spaces

ROLES = ("system", "user", "assistant", "tool")


class AssistantText(spaces.Text):
    """Any string up to `max_length` characters; `sample()` draws printable ASCII."""

    def __init__(self, max_length: int = 8192, seed: int | np.random.Generator | None = None) -> None:
        super().__init__(max_length=max_length, min_length=1, charset=string.printable, seed=seed)

    def contains(self, x: Any) -> bool:
        return isinstance(x, str) and len(x) <= self.max_length


class ChatMessages(spaces.Space[list]):
    """A list of chat messages: dicts with a known "role" and a string "content"."""

    def __init__(self, max_messages: int = 64, seed: int | np.random.Generator | None = None) -> None:
        super().__init__(shape=None, dtype=None, seed=seed)
        self.max_messages = max_messages

    @property
    def is_np_flattenable(self) -> bool:
        return False

    def contains(self, x: Any) -> bool:
        return (
            isinstance(x, list)
            and len(x) <= self.max_messages
            and all(
                isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)
                for m in x
            )
        )

    def sample(self, mask: Any = None, probability: Any = None) -> list:
        text = AssistantText(max_length=32, seed=int(self.np_random.integers(2**31)))
        n = int(self.np_random.integers(1, 4))
        return [{"role": str(self.np_random.choice(ROLES)), "content": text.sample()} for _ in range(n)]

    def __repr__(self) -> str:
        return f"ChatMessages(max_messages={self.max_messages})"

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, ChatMessages) and other.max_messages == self.max_messages
