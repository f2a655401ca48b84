"""Lending: a train slot's idle time generates rollouts, without the slot changing role.

Plain arithmetic, no Ray, no clock. A lending train slot holds a rollout engine beside its trainer rank;
the engine takes groups while the trainer waits for a batch and yields (its requests aborted, their
tokens kept) the moment a step starts; its episodes resume when the step ends, on the weights of then
(per-token versions). It is the fine-grained, cheap counterpart of moving a slot (`ElasticPolicy`
weighs both, from the same observation).

The pipeline model with lending (the elastic policy's units; n rollout slots, m train slots of which
l lend, r and t the per-slot rates, u the reuse):

    a lent engine generates only while its trainer idles: 1 - b of the time, b = T / (m t') the
    trainer's busy share, t' = t (1 - o) with o the trainer's slowdown beside a lent engine (measured:
    the steps it ran on beside cost about a third of the trainer's rate, those it yielded to about
    nothing; `lending_cost` reads o from the steps since the last change, `LendWindow`)
    T = u r (n + l (1 - T / (m t')))   solved for T:
    T_lend(n, m, l) = min(u r (n + l) / (1 + u r l / (m t')), m t')

With l = 0 it is the pool's T(n, m) = min(n r u, m t). Lending never lifts T past the trainer's own
capacity m t'; it pays where rollout is the bottleneck and the trainer idles, and costs o where the
trainer is the bottleneck.

A lent engine yields at every step start, unless its oldest group in flight was started more than
`eta` versions before the step's version (`lent_engine_yields`): a trainer that never waits would
otherwise hold those episodes paused for ever. The bound is looser than admission's: a group started
on version c yields to the steps that train versions c + 1 to c + eta + 1, runs on beside the one
that trains c + eta + 2 and, if it finishes there, is trained by the next from version c + eta + 2:
eta + 2 versions stale (3 at eta 1; a rollout worker's groups in start order: eta). Its per-token
versions and the decoupled loss's weights carry that staleness as any straggler's.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence


class LendWindow:
    """The trainer's last `steps` train steps since the lending level (or the split) last changed, each
    alone (no lent engine generated beside it: its engines yielded or held nothing) or beside (one ran
    on past the staleness bound), with its train seconds (the yield before it not included), trained
    tokens and samples, and the seconds the yield before it took (the engines' pause round trip, a GPU
    hand-over). A driver adds each step and resets it when a change is applied; the policy reads the
    window, not one step (its boundaries come every step, and a step is either alone or beside), and
    not the whole run (lengths drift). Tokens are what each driver counts a step's work in: the
    runtime its sampled tokens (replays counted again), the simulator the same."""

    def __init__(self, steps: int) -> None:
        if steps < 1:
            raise ValueError(f"a lend window holds at least one step, got {steps}")
        self.entries: deque[tuple[float, float, float, bool, float]] = deque(maxlen=steps)

    def add(
        self, seconds: float, tokens: float, samples: float, *, beside: bool, yield_s: float = 0.0
    ) -> None:
        """One step of `seconds` on `tokens` and `samples`, `yield_s` before it; a step that trained
        nothing (no sampled token) counts only its yield."""
        if seconds < 0 or yield_s < 0:
            raise ValueError(f"a step's seconds must be >= 0, got {seconds} and yield {yield_s}")
        if tokens <= 0:
            seconds = tokens = samples = 0.0
        self.entries.append((seconds, tokens, samples, beside, yield_s))

    def _sum(self, field: int, beside: bool | None = None) -> float:
        return sum(e[field] for e in self.entries if beside is None or e[3] is beside)

    @property
    def alone_s(self) -> float:
        return self._sum(0, beside=False)

    @property
    def beside_s(self) -> float:
        return self._sum(0, beside=True)

    @property
    def yield_s(self) -> float:
        return self._sum(4)

    @property
    def alone_tokens(self) -> float:
        return self._sum(1, beside=False)

    @property
    def beside_tokens(self) -> float:
        return self._sum(1, beside=True)

    @property
    def alone_samples(self) -> float:
        return self._sum(2, beside=False)

    def alone_rate(self, train_slots: int) -> float | None:
        """t alone: samples per second and train slot over the steps alone (None: none yet)."""
        busy = self.alone_s * train_slots
        return self.alone_samples / busy if busy > 0 else None

    def slowdown(self) -> float | None:
        """o = 1 - (tokens per second over every step, the yields' seconds added) / (tokens per second
        over the steps alone), at least 0: what the run-on steps and the yields cost the trainer,
        weighted by their share of the window, in tokens (a step's time follows its tokens, not its
        samples). None before a step alone."""
        alone_s, alone_tokens = self.alone_s, self.alone_tokens
        if alone_s <= 0 or alone_tokens <= 0:
            return None
        every = self._sum(1) / (self._sum(0) + self.yield_s)
        return max(0.0, 1.0 - every / (alone_tokens / alone_s))

    def reset(self) -> None:
        self.entries.clear()

    def state_dict(self) -> list[list[float | bool]]:
        return [list(e) for e in self.entries]

    def load_state_dict(self, state: list[list[float | bool]]) -> None:
        self.entries.clear()
        for s, t, n, beside, y in state:
            self.entries.append((float(s), float(t), float(n), bool(beside), float(y)))


def lending_cost(
    train_rate: float,
    lent_now: int,
    prior: float,
    alone_rate: float | None = None,
    slowdown: float | None = None,
) -> tuple[float, float]:
    """(t, o): the trainer's rate without a lent engine beside it and the slowdown lending costs it.
    `train_rate`: t measured over the last interval, every step; `alone_rate` and `slowdown`: over
    the steps since the last change (`LendWindow`); `prior`: the slowdown assumed where none is
    measured.

    - A step alone in the window: t = alone_rate; o = slowdown where engines lend now, else prior
      (nothing lends: what lending would cost is not measured).
    - None: t = train_rate / (1 - prior) where engines lend (every step ran beside one), else
      train_rate; o = prior."""
    if alone_rate is not None and alone_rate > 0:
        return alone_rate, (slowdown or 0.0) if lent_now > 0 else prior
    return (train_rate / (1.0 - prior) if lent_now > 0 else train_rate), prior


def lent_throughput(
    rollout_slots: int,
    train_slots: int,
    lent: int,
    *,
    rollout_rate: float,
    train_rate: float,
    reuse: float = 1.0,
    overhead: float = 0.0,
) -> float:
    """T_lend(n, m, l) of the module docstring; `train_rate` and `overhead`: the trainer's rate without
    a lent engine beside it and its slowdown with one (`lending_cost`)."""
    if not 0 <= lent <= train_slots:
        raise ValueError(f"{lent} lending slots of {train_slots} train slots")
    if not 0.0 <= overhead < 1.0:
        raise ValueError(f"overhead is a slowdown share in [0, 1), got {overhead}")
    capacity = train_slots * train_rate * (1.0 - overhead if lent else 1.0)
    supply = reuse * rollout_rate
    if lent == 0 or capacity <= 0:
        return min(rollout_slots * supply, capacity)
    return min(supply * (rollout_slots + lent) / (1.0 + supply * lent / capacity), capacity)


def lent_engine_yields(oldest_started_version: int | None, version: int, eta: int) -> bool:
    """Whether a lent engine pauses its episodes for the step that trains `version` + 1 (`version`: the
    trainer's now): yes unless its oldest group in flight started (on weights) more than `eta`
    versions ago, which then runs on beside the step. No group in flight: nothing to pause, yes."""
    if eta < 0:
        raise ValueError(f"eta must be >= 0, got {eta}")
    if oldest_started_version is None:
        return True
    return version - oldest_started_version <= eta


def hand_over_plan(
    episodes: Sequence[int],
    free: Sequence[int],
    versions: Sequence[int] = (),
    target_versions: Sequence[int] = (),
) -> list[tuple[int, int]]:
    """Where the episodes of the lent engines yielding at a step's start go instead of pausing: for
    each engine (at most `episodes[i]` of its own), (a rollout engine, how many), from `free` (each
    rollout engine's concurrency limit less its load): the engines with the most episodes first,
    each to the rollout engine with the most room, none split over two; (-1, 0) where none has room.
    With the engines' weight versions (`versions`, `target_versions`; empty: all alike) a target must
    hold weights no older than the lent engine's (the worker also keeps home an episode whose tokens
    are newer than its target's): its group's staleness stays what admission counted. The rest
    pause."""
    left = [max(0, f) for f in free]
    plan = [(-1, 0)] * len(episodes)
    for i in sorted(range(len(episodes)), key=lambda i: (-episodes[i], i)):
        fits = [
            w
            for w in range(len(left))
            if not versions or not target_versions or target_versions[w] >= versions[i]
        ]
        target = max(fits, key=lambda w: (left[w], -w)) if fits else -1
        k = min(episodes[i], left[target]) if target >= 0 else 0
        if k > 0:
            left[target] -= k
            plan[i] = (target, k)
    return plan


def relative_gain(now: float, target: float) -> float:
    """How much faster the target throughput is, as a share of now's (inf from nothing)."""
    if now <= 0:
        return math.inf if target > 0 else 0.0
    return target / now - 1.0
