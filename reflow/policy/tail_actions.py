"""The tail policy's actions: what `TailPolicy.decide` returns and a driver applies.

Each is a frozen dataclass with its `kind` (the event's `what`), a `reason` with the numbers behind it
(the event's `why`) and a `key`: two looks' actions with the same kind and key are the same decision,
so a driver logs an event only when it changes (`decision_key`). `OverProvision` and `CarryOver` set
how many groups the driver starts; `Migrate`, `FreeSlot` and `SetConcurrency` go to an `Actuator`
(`reflow.policy.actuator.apply_tail`). The rules that produce them: `reflow.policy.tail`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal


@dataclass(frozen=True)
class OverProvision:
    start: int
    """Groups to start now."""
    extra: int
    """delta: groups beyond B this batch runs."""
    reason: str
    kind: Literal["over_provision"] = "over_provision"

    @property
    def key(self) -> Any:
        return self.extra


@dataclass(frozen=True)
class CarryOver:
    groups: tuple[str, ...]
    episodes: tuple[str, ...]
    reason: str
    kind: Literal["carry_over"] = "carry_over"

    @property
    def key(self) -> Any:
        return True  # one decision from B done until a new batch, however many groups arrive after


@dataclass(frozen=True)
class Migrate:
    episode: str
    source: str
    target: str
    tokens: int
    """Tokens the target re-prefills."""
    reason: str
    kind: Literal["migrate"] = "migrate"

    @property
    def key(self) -> Any:
        return (self.episode, self.target)


@dataclass(frozen=True)
class FreeSlot:
    engine: str
    use: Literal["next_batch", "trainer"]
    reason: str
    kind: Literal["free_slot"] = "free_slot"

    @property
    def key(self) -> Any:
        return (self.engine, self.use)


@dataclass(frozen=True)
class SetConcurrency:
    engine: str
    concurrency: int
    reason: str
    kind: Literal["set_concurrency"] = "set_concurrency"

    @property
    def key(self) -> Any:
        return (self.engine, self.concurrency)


TailAction = OverProvision | CarryOver | Migrate | FreeSlot | SetConcurrency
TAIL_ACTIONS = (OverProvision, CarryOver, Migrate, FreeSlot, SetConcurrency)


def decision_key(action: TailAction) -> tuple[str, Any]:
    """What makes two looks' actions the same decision (a driver logs an event when it changes)."""
    if not isinstance(action, TAIL_ACTIONS):
        raise TypeError(f"unknown tail action {action!r}")
    return action.kind, action.key
