"""Online task selection by learnability: which training task seeds a round samples.

GRPO learns only from groups whose episodes disagree: a task every sample solves, or none does, gives
no gradient however often it is drawn. A task whose recent pass rate is strictly between 0 and 1 is
where the policy is learning (DAPO's dynamic sampling and Polaris-style filtering drop the others;
Foster & Foerster's "learnability" weighs a task by p(1 - p), largest at p = 1/2). This policy keeps
the recent pass rates of the tasks it has seen and, for each round, proposes a share of revisits of
learnable tasks, drawn without replacement with weight p(1 - p); the rest of the round is fresh seeds,
so the training distribution keeps moving and the held-out set (fresh seeds of the full distribution,
never trained on) measures generalisation, not memory.

A task is revisited at most `max_attempts - 1` times and is forgotten as soon as it is not learnable
(pass rate 0 or 1, or out of attempts), so the table stays small. A task with a group in flight is
not proposed again until that group is observed.

A plain object: observations in (`start`: seeds scheduled; `observe`: a group's successes), decisions
out (`pick`). No Ray, no clock, no I/O; randomness only from the `random.Random` passed in. Its state
is a plain dict of plain values (`stats`), so a run can checkpoint it with its run state.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the caller's generator is the only randomness: the module draws none itself
    import random


@dataclass
class LearnabilityConfig:
    revisit_share: float = field(
        default=0.5, metadata={"doc": "at most this share of a round's task seeds revisit learnable tasks"}
    )
    max_attempts: int = field(
        default=3, metadata={"doc": "groups per task in all, the first one included (1: never revisit)"}
    )
    window: int = field(
        default=2, metadata={"doc": "a task's recent pass rate: the mean over its last `window` groups"}
    )

    def __post_init__(self) -> None:
        if not 0.0 <= self.revisit_share <= 1.0:
            raise ValueError(f"revisit_share must be in [0, 1], got {self.revisit_share}")
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")


def learnability(rate: float) -> float:
    """p(1 - p): 0 for a task always or never solved, largest (1/4) at p = 1/2."""
    return rate * (1.0 - rate)


class LearnabilityFilter:
    """Per-task recent pass rates in, the next round's revisits out (see the module docstring).

    `stats` maps str(seed) to {"attempts": groups scheduled so far, "pending": groups in flight,
    "rates": pass rates of its last `window` observed groups}; pass a run state's dict to share it.
    """

    def __init__(self, config: LearnabilityConfig, stats: dict[str, dict[str, Any]] | None = None) -> None:
        self.config = config
        self.stats: dict[str, dict[str, Any]] = {} if stats is None else stats

    def start(self, seeds: Iterable[int]) -> None:
        """Seeds scheduled (fresh or revisited): one more attempt each, in flight until observed."""
        for seed in seeds:
            entry = self.stats.setdefault(str(seed), {"attempts": 0, "pending": 0, "rates": []})
            entry["attempts"] += 1
            entry["pending"] += 1

    def observe(self, seed: int, successes: Sequence[bool]) -> None:
        """A group of `seed` ended with these successes (a group never started is an error)."""
        entry = self.stats.get(str(seed))
        if entry is None or entry["pending"] < 1:
            raise ValueError(f"task seed {seed} has no group in flight (call start() first)")
        if not successes:
            raise ValueError(f"task seed {seed}: a group with no episodes")
        entry["pending"] -= 1
        entry["rates"] = [*entry["rates"], sum(map(bool, successes)) / len(successes)][-self.config.window :]
        if entry["pending"] == 0 and not self.learnable(seed):
            del self.stats[str(seed)]

    def rate(self, seed: int) -> float | None:
        """The task's recent pass rate (None: never observed)."""
        entry = self.stats.get(str(seed))
        if entry is None or not entry["rates"]:
            return None
        return sum(entry["rates"]) / len(entry["rates"])

    def learnable(self, seed: int) -> bool:
        """Observed, pass rate strictly between 0 and 1, and attempts left."""
        rate = self.rate(seed)
        entry = self.stats.get(str(seed))
        return rate is not None and 0.0 < rate < 1.0 and entry["attempts"] < self.config.max_attempts

    def candidates(self) -> list[int]:
        """Learnable tasks with no group in flight, in seed order."""
        return sorted(int(s) for s, e in self.stats.items() if e["pending"] == 0 and self.learnable(int(s)))

    def revisits(self, n: int) -> int:
        """How many of a round of `n` seeds may be revisits: floor(revisit_share * n), at most the
        candidates there are."""
        return min(int(self.config.revisit_share * n + 1e-9), len(self.candidates()))

    def pick(self, n: int, rng: random.Random) -> list[int]:
        """Revisits for a round of `n` seeds: `revisits(n)` distinct candidates, drawn without
        replacement with weight p(1 - p) (the caller fills the round with fresh seeds and calls
        `start` on all of them)."""
        pool = self.candidates()
        k = self.revisits(n)
        chosen: list[int] = []
        weights = [learnability(self.rate(s) or 0.0) for s in pool]
        for _ in range(k):
            i = rng.choices(range(len(pool)), weights=weights)[0]
            chosen.append(pool.pop(i))
            weights.pop(i)
        return chosen


ROUND_SPREAD_FLOOR = 0.25
"""The sync loop sizes a resample round as if at least this share of groups had reward spread."""


def round_size(want: int, missing: int, spread: int, generated: int) -> int:
    """Groups for the next sync-loop round: enough for `missing` groups with reward spread at the
    spread rate so far (`spread` of `generated` groups), at most 2 x `want`. The runtime's sync loop
    and the simulator both call this one."""
    rate = spread / generated if generated else 1.0
    return min(2 * want, math.ceil(missing / max(rate, ROUND_SPREAD_FLOOR)))
