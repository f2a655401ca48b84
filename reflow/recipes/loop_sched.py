"""The decoupled loop's two adaptive parts in mode reflow (issue F7): the elastic pool and the tail
scheduler, each a thin driver around its pure policy (`reflow.sched.elastic`, `reflow.sched.tail`).

- `ElasticDriver`: at a version boundary (no train step in flight) it turns the run's cumulative
  counters into an `Interval`, asks `ElasticRuntime.at_boundary` (which decides and applies a move) and
  returns its metrics event and the change. `moved_positions` says, from the rollout slots before and
  after, which rollout worker position left or joined, so the loop can re-index what it keys by
  position (busy clocks, groups in flight, weight pushes).
- `TailGate`: before the loop starts groups it asks `TailPolicy` about the batch being collected (B
  fresh groups; the groups with reward spread waiting count as done) and turns its actions into a
  limit: `OverProvision` lets the loop keep up to B + delta groups started (delta from the tail's
  heaviness p90 / p50 of the group durations seen), `CarryOver` (B done) starts nothing more: the step
  takes the first B and the unfinished groups continue into the next step as they are. Admission
  control still bounds staleness on top. `Migrate` needs an episode's exact token prefix resubmitted
  on another engine, which the rollout workers do not offer yet: it is logged as not applied, as is
  `FreeSlot`; `SetConcurrency` needs a measured (concurrency, tokens/s) curve per engine, which the
  loop does not measure: the gate passes none, so the policy gives none.

Every decision that changes is a metrics event (what, why, the numbers).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from reflow.config import RunConfig
from reflow.sched.elastic import ElasticPolicy
from reflow.sched.elastic_runtime import ElasticRuntime, Interval, Totals
from reflow.sched.role_change import RoleChange
from reflow.sched.tail import (
    CarryOver,
    EngineState,
    FreeSlot,
    InFlightEpisode,
    Migrate,
    OverProvision,
    Quantiles,
    SetConcurrency,
    TailObservation,
    TailPolicy,
)

QUANTILE_WINDOW = 512
"""Group durations the tail gate's quantiles look back over (the recent ones: the policy drifts)."""


def observed_quantiles(seconds: Sequence[float]) -> Quantiles | None:
    """p50, p90, p99 of the recent positive durations (None with fewer than 2)."""
    return Quantiles.observed(seconds, QUANTILE_WINDOW)


def moved_positions(before: Sequence[int], after: Sequence[int]) -> tuple[int | None, int | None]:
    """The rollout worker positions a role change removed and added, from the rollout slots' indices
    (in slot order) before and after it: (position in `before` that left, position in `after` that
    joined), None where nothing left or joined."""
    gone = [p for p, s in enumerate(before) if s not in after]
    new = [p for p, s in enumerate(after) if s not in before]
    if len(gone) > 1 or len(new) > 1:
        raise ValueError(f"one role change moves one slot: rollout slots {list(before)} -> {list(after)}")
    return (gone[0] if gone else None), (new[0] if new else None)


@dataclass
class GroupInFlight:
    """A group the loop started: on which rollout worker (position in `pool.rollout`), since when."""

    worker: int
    group_id: str
    started: float


class ElasticDriver:
    """The loop's side of the elastic pool: counters in, `ElasticRuntime.at_boundary` out."""

    def __init__(self, pool: Any, config: RunConfig, state: Any, now_s: float) -> None:
        """`state`: the loop's `RunState` at the start, `now_s`: training seconds then."""
        self.group_size = config.rollout.group_size
        batch = config.rollout.groups_per_step * self.group_size
        self.runtime = ElasticRuntime(pool, ElasticPolicy(config.elastic.policy_config()), batch_size=batch)
        self.trained = 0.0  # episodes trained on (fresh and replayed; samples, the policy's unit)
        self.then = Totals(now_s, state.rollout_busy_s, 0.0, state.trainer_busy_s, 0.0)

    def stepped(self, groups: int) -> None:
        self.trained += groups * self.group_size

    def at_boundary(
        self,
        state: Any,
        now_s: float,
        generated: float,
        *,
        replay_share: float,
        fresh_waiting: int,
        in_flight: Mapping[Any, GroupInFlight],
    ) -> tuple[dict[str, Any], RoleChange | None]:
        """Decide (and apply) at this boundary from the interval since the last one (`state`: the
        loop's `RunState`; `generated`: episodes arrived since the loop started)."""
        now = Totals(now_s, state.rollout_busy_s, generated, state.trainer_busy_s, self.trained)
        interval, self.then = Interval.between(self.then, now), now
        return self.runtime.at_boundary(
            interval,
            step=state.step,
            version=state.version,
            replay_share=replay_share,
            fresh_waiting=fresh_waiting,
            in_flight={ref: (g.worker, [g.group_id]) for ref, g in in_flight.items()},
        )


@dataclass
class TailLook:
    """What the tail gate allows now."""

    room: int | None
    """Groups the loop may still start for the batch being collected (None: no limit, tail off)."""
    beyond_b: int = 0
    """Of `room`, how many would be started beyond B (over-provisioned)."""
    events: list[dict[str, Any]] = field(default_factory=list)
    """The decisions that changed since the last look (metrics events)."""

    def allows(self) -> bool:
        return self.room is None or self.room > 0

    def take(self) -> bool:
        """One group starts; whether it is one beyond B (over-provisioned)."""
        if self.room is None:
            return False
        over = self.room <= self.beyond_b
        self.room -= 1
        return over


class TailGate:
    """The tail scheduler in the loop (see the module docstring); `policy` None: the tail is off."""

    def __init__(self, policy: TailPolicy | None, batch: int, per_worker: int) -> None:
        self.policy, self.batch, self.per_worker = policy, batch, per_worker
        self._last: dict[str, Any] = {}  # decision kind -> what it said last (events only on change)
        self._quantiles: Quantiles | None = None
        self.observed = 0
        """How many durations the quantiles were computed from."""

    def look(
        self, fresh_waiting: int, in_flight: Sequence[GroupInFlight], loads: Sequence[int], now: float
    ) -> TailLook:
        """`fresh_waiting`: groups with reward spread stored and not yet trained; `loads`: groups in
        flight per rollout worker; `now`: the clock `GroupInFlight.started` was read from."""
        if self.policy is None:
            return TailLook(None)
        engines = tuple(EngineState(f"w{w}", n, self.per_worker) for w, n in enumerate(loads))
        # one entry per group: the workers report no per-episode progress while a group runs
        episodes = tuple(
            InFlightEpisode(g.group_id, g.group_id, f"w{g.worker}", 0, 0, max(0.0, now - g.started))
            for g in in_flight
        )
        obs = TailObservation(
            batch_target=self.batch,
            groups_done=fresh_waiting,
            episodes=episodes,
            engines=engines,
            group_seconds=self._quantiles,
        )
        return self.apply(self.policy.decide(obs), fresh_waiting + len(in_flight))

    def observe(self, group_seconds: Sequence[float]) -> None:
        """Durations of the groups done so far (over-provisioning's tail heaviness)."""
        self._quantiles = observed_quantiles(group_seconds)
        self.observed = len(group_seconds)

    def apply(self, actions: Sequence[Any], started: int) -> TailLook:
        """The limit the actions set (`started`: groups of this batch done or in flight) and the
        events of the decisions that changed."""
        look = TailLook(room=0)
        for action in actions:
            applied = True
            if isinstance(action, OverProvision):
                look.room = action.start
                look.beyond_b = min(action.start, max(0, started + action.start - self.batch))
                key: Any = action.extra
            elif isinstance(action, CarryOver):
                key = True  # an event when B are first done, not one per group arriving after
            elif isinstance(action, (Migrate, FreeSlot, SetConcurrency)):
                applied, key = False, (getattr(action, "engine", None), getattr(action, "episode", None))
            else:
                raise TypeError(f"unknown tail action {action!r}")
            if self._last.get(action.kind) != key:
                self._last[action.kind] = key
                event = {k: v for k, v in vars(action).items() if k not in ("kind", "reason")}
                look.events.append({"what": action.kind, "why": action.reason, "applied": applied, **event})
        for kind in set(self._last) - {a.kind for a in actions}:
            del self._last[kind]  # the decision ended: its next start is an event again
        return look
