"""The elastic policy on Ray: at each version boundary, measure, ask `ElasticPolicy`, apply its move.

    runtime = ElasticRuntime(pool, ElasticPolicy(config.elastic.policy_config()), batch_size=B * G)
    event, change = runtime.at_boundary(interval, step=7, version=7, replay_share=0.25,
                                        in_flight={ref: (worker, [group_id]), ...})

The driver (the decoupled loop) keeps cumulative counters (`Totals`: rollout busy slot-seconds, work
generated, trainer busy seconds, work trained); the difference between two boundaries is an
`Interval`, and `observe` turns it into the policy's `ElasticObservation` by plain arithmetic:

    r = generated / rollout busy slot-seconds            work per second per rollout slot, busy
    t = trained / (trainer busy seconds x train slots)   work per second per train slot, busy
    rollout idle = 1 - rollout busy slot-seconds / (rollout slots x interval seconds)
    train idle   = 1 - trainer busy seconds / interval seconds
    u = 1 / (1 - replay share)                           (`reuse_from_share`)

`ElasticRuntime` applies a move through `ResourcePool.move` (the rollout worker with the fewest groups
in flight drains; towards rollout, the last train slot leaves the group), remembers the measured cost
of each direction for the next observations, and returns a metrics event: what, why, the predicted
gain and the measured cost per part.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from reflow.sched.elastic import (
    ElasticDecision,
    ElasticObservation,
    ElasticPolicy,
    RoleChangeCost,
    reuse_from_share,
)
from reflow.sched.role_change import RoleChange


def _ratio(value: float) -> float:
    """Busy time measured across an evaluation pause can exceed the interval a little: clamp to [0, 1]."""
    return min(1.0, max(0.0, value))


@dataclass(frozen=True)
class Totals:
    """The driver's cumulative counters since the run started (work in the policy's unit)."""

    wall_s: float = 0.0
    rollout_busy_s: float = 0.0
    """Summed over rollout workers: time with at least one group in flight (slot-seconds)."""
    generated: float = 0.0
    trainer_busy_s: float = 0.0
    """Time the trainer group spent in train steps."""
    trained: float = 0.0


@dataclass(frozen=True)
class Interval:
    """What happened between two version boundaries: `Totals` now minus `Totals` then."""

    seconds: float
    rollout_busy_s: float
    generated: float
    trainer_busy_s: float
    trained: float

    @classmethod
    def between(cls, then: Totals, now: Totals) -> Interval:
        diff = {name: getattr(now, name) - getattr(then, name) for name in Totals.__dataclass_fields__}
        if any(v < 0 for v in diff.values()):
            raise ValueError(f"counters went backwards between {then} and {now}")
        return cls(
            seconds=diff["wall_s"],
            rollout_busy_s=diff["rollout_busy_s"],
            generated=diff["generated"],
            trainer_busy_s=diff["trainer_busy_s"],
            trained=diff["trained"],
        )


def observe(
    interval: Interval,
    *,
    step: int,
    version: int,
    steps_since_change: int,
    rollout_slots: int,
    train_slots: int,
    batch_size: float,
    replay_share: float = 0.0,
    fresh_waiting: int = 0,
    in_flight: int = 0,
    to_rollout_cost: RoleChangeCost | None = None,
    to_train_cost: RoleChangeCost | None = None,
    unit: Literal["samples", "tokens"] = "samples",
) -> ElasticObservation:
    """The policy's observation from one interval's measurements (see the module docstring); a side
    with no busy time measured gets rate 0 (the policy then holds)."""
    r = interval.generated / interval.rollout_busy_s if interval.rollout_busy_s > 0 else 0.0
    busy_train = interval.trainer_busy_s * train_slots
    t = interval.trained / busy_train if busy_train > 0 else 0.0
    wall = interval.seconds
    return ElasticObservation(
        step=step,
        version=version,
        steps_since_change=steps_since_change,
        rollout_slots=rollout_slots,
        train_slots=train_slots,
        rollout_rate=r,
        train_rate=t,
        batch_size=batch_size,
        reuse=reuse_from_share(replay_share),
        rollout_idle=_ratio(1 - interval.rollout_busy_s / (rollout_slots * wall)) if wall > 0 else 0.0,
        train_idle=_ratio(1 - interval.trainer_busy_s / wall) if wall > 0 else 0.0,
        fresh_waiting=fresh_waiting,
        in_flight=in_flight,
        to_rollout_cost=to_rollout_cost,
        to_train_cost=to_train_cost,
        unit=unit,
    )


def worker_to_drain(in_flight_per_worker: Sequence[int]) -> int:
    """The rollout worker a move to training takes: the one with the fewest groups in flight (the
    shortest drain); ties go to the last one (the highest slot)."""
    if not in_flight_per_worker:
        raise ValueError("no rollout worker to drain")
    return min(reversed(range(len(in_flight_per_worker))), key=in_flight_per_worker.__getitem__)


def decision_event(decision: ElasticDecision, obs: ElasticObservation) -> dict[str, Any]:
    """The metrics event of one decision (a hold too: the reason says why)."""
    return {
        "what": decision.action,
        "why": decision.reason,
        "step": obs.step,
        "version": obs.version,
        "rollout_slots": decision.rollout_slots,
        "train_slots": decision.train_slots,
        "gain_s": decision.gain_s,
        "cost_s": decision.cost_s,
        "throughput_now": decision.throughput_now,
        "throughput_target": decision.throughput_target,
        "rollout_rate": obs.rollout_rate,
        "train_rate": obs.train_rate,
        "rollout_idle": obs.rollout_idle,
        "train_idle": obs.train_idle,
        "reuse": obs.reuse,
        "unit": obs.unit,
    }


class ElasticRuntime:
    """Drives one `ElasticPolicy` on a `ResourcePool` (see the module docstring)."""

    def __init__(
        self,
        pool: Any,
        policy: ElasticPolicy,
        batch_size: float,
        *,
        unit: Literal["samples", "tokens"] = "samples",
        drain_timeout_s: float | None = None,
    ) -> None:
        self.pool, self.policy, self.batch_size, self.unit = pool, policy, batch_size, unit
        self.drain_timeout_s = drain_timeout_s
        self.costs: dict[str, RoleChangeCost | None] = {"to_rollout": None, "to_train": None}
        """The last measured cost of each direction (None until one was made)."""
        self.last_change_step = 0
        self.changes: list[RoleChange] = []

    def at_boundary(
        self,
        interval: Interval,
        *,
        step: int,
        version: int,
        replay_share: float = 0.0,
        fresh_waiting: int = 0,
        in_flight: Mapping[Any, tuple[int, Sequence[str]]] | None = None,
    ) -> tuple[dict[str, Any], RoleChange | None]:
        """Decide at this version boundary (no train step in flight) and apply a move. `in_flight`:
        object ref of each `generate` call in flight -> (its worker's position in `pool.rollout`, the
        group ids registered for it). Returns the metrics event and the applied change (None on
        hold); after a change the driver re-indexes its per-worker state (`pool.rollout` changed),
        drops the drained refs from its own table and counts `change.drained` as arrived."""
        in_flight = dict(in_flight or {})
        obs = observe(
            interval,
            step=step,
            version=version,
            steps_since_change=step - self.last_change_step,
            rollout_slots=len(self.pool.rollout),
            train_slots=len(self.pool.trainers),
            batch_size=self.batch_size,
            replay_share=replay_share,
            fresh_waiting=fresh_waiting,
            in_flight=len(in_flight),
            to_rollout_cost=self.costs["to_rollout"],
            to_train_cost=self.costs["to_train"],
            unit=self.unit,
        )
        decision = self.policy.decide(obs)
        event = decision_event(decision, obs)
        if not decision.moves:
            return event, None
        if decision.action == "to_train":
            counts = [0] * len(self.pool.rollout)
            for worker, _ in in_flight.values():
                counts[worker] += 1
            worker = worker_to_drain(counts)
            slot: int | str = self.pool.rollout_slots[worker].index
            drain = {ref: list(ids) for ref, (w, ids) in in_flight.items() if w == worker}
            change = self.pool.move(slot, "train", drain, self.drain_timeout_s)
        else:
            change = self.pool.move("train", "rollout")
        self.costs[change.direction] = change.cost
        self.last_change_step = step
        self.changes.append(change)
        event.update({k: v for k, v in change.event().items() if k != "what"})
        event["what"] = f"{decision.action}: {change.event()['what']}"
        return event, change
