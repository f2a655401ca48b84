"""The decoupled loop's counters (`reflow.recipes.decoupled`): each rollout worker's busy time
(`BusyClock`, the idle ratios and the elastic policy's rollout rate) and the groups that arrived
(`Arrivals`: reports since the last step, groups with reward spread, durations for the time budget's
estimate and the tail's quantiles), and what a checkpoint keeps of those durations (`saved_durations`,
the sync loop's tail saves the same).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from reflow.policy.tail import QUANTILE_WINDOW
from reflow.runtime.workers import GroupReport


def saved_durations(group_s: list[float], episode_s: list[float]) -> dict[str, list[float]]:
    """The recent group and episode durations a checkpoint keeps (what the tail's quantiles read: a
    window of groups, and up to 8 episodes a group)."""
    return {"group_s": group_s[-QUANTILE_WINDOW:], "episode_s": episode_s[-QUANTILE_WINDOW * 8 :]}


class BusyClock:
    """Busy time of each rollout worker: from its first group in flight to its last one done, and
    while its engine runs episodes a lent engine handed over (`serve`)."""

    def __init__(self, n: int) -> None:
        self.in_flight, self.since, self.busy = [0] * n, [0.0] * n, 0.0
        self.served = [0] * n  # sequences it runs for lent engines (their groups are not its own)

    def _busy(self, worker: int) -> bool:
        return self.in_flight[worker] + self.served[worker] > 0

    def _set(self, worker: int, in_flight: int, served: int) -> None:
        was = self._busy(worker)
        self.in_flight[worker], self.served[worker] = in_flight, served
        if not was and self._busy(worker):
            self.since[worker] = time.monotonic()
        elif was and not self._busy(worker):
            self.busy += time.monotonic() - self.since[worker]

    def start(self, worker: int) -> None:
        self._set(worker, self.in_flight[worker] + 1, self.served[worker])

    def done(self, worker: int) -> None:
        self._set(worker, self.in_flight[worker] - 1, self.served[worker])

    def serve(self, sequences: Sequence[int]) -> None:
        """The sequences each worker's engine runs for lent engines now, by position."""
        for w, n in enumerate(sequences):
            self._set(w, self.in_flight[w], n)

    def total(self) -> float:
        now = time.monotonic()
        return self.busy + sum(now - self.since[w] for w in range(len(self.since)) if self._busy(w))

    def remove(self, worker: int) -> None:
        """The worker left (a role change): its busy time so far stays counted."""
        if self._busy(worker):
            self.busy += time.monotonic() - self.since[worker]
        del self.in_flight[worker], self.since[worker], self.served[worker]

    def insert(self, worker: int) -> None:
        """A worker joined at position `worker`, idle."""
        self.in_flight.insert(worker, 0)
        self.since.insert(worker, 0.0)
        self.served.insert(worker, 0)


@dataclass
class Arrivals:
    """The groups that arrived: reports since the last step, groups with spread so far, durations."""

    accepted: int
    reports: list[GroupReport] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    """How long each group took (the budget's estimate, the tail's quantiles)."""
    episode_seconds: list[float] = field(default_factory=list)
    episodes: int = 0

    def add_durations(self, group_s: list[float], episode_s: list[float]) -> None:
        """Durations measured before a resume (no group arrives with them)."""
        self.seconds += group_s
        self.episode_seconds += episode_s
        self._seconds_sum += sum(group_s)

    def add(self, new: list[GroupReport], timed: bool = True) -> None:
        """Groups arrived; `timed` False keeps their durations out of the estimates (a lent engine's
        groups: their durations include the train steps they waited paused)."""
        self.reports += new
        self.accepted += sum(r.has_spread for r in new)
        self.episodes += sum(len(r.rewards) for r in new)
        if not timed:
            return
        self.seconds += [r.seconds for r in new]
        self.episode_seconds += [s for r in new for s in r.episode_seconds]
        self._seconds_sum += sum(r.seconds for r in new)

    @property
    def mean_seconds(self) -> float:
        """Mean group duration so far (0 before the first), kept as a running sum: the loop asks
        for it before every launch."""
        return self._seconds_sum / len(self.seconds) if self.seconds else 0.0

    def __post_init__(self) -> None:
        self._seconds_sum = sum(self.seconds)
