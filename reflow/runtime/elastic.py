"""The elastic policy on Ray: at each version boundary, measure, ask `ElasticPolicy`, apply its move.

One decision goes: the decoupled loop (`reflow.recipes.decoupled._elastic_boundary`) ->
`ElasticDriver.at_boundary` (the run's cumulative counters since the last boundary, as an
`Interval`) -> `ElasticRuntime.at_boundary` (the observation, `reflow.policy.elastic.observe`) ->
`ElasticPolicy.decide` -> `RayActuator.move_slot` -> `Cluster.move` ->
`reflow.runtime.role_change.move_slot`.

    driver = ElasticDriver(cluster, config, state, now_s)
    event, change = driver.at_boundary(state, now_s, generated, replay_share=0.25, fresh_waiting=3,
                                       in_flight={ref: GroupInFlight(worker, group_id, started)})

`ElasticRuntime` remembers the measured cost of each direction for the next observations and
returns a metrics event (`reflow.policy.elastic.decision_event`, with the change's measured cost per
part); `moved_positions` says which rollout worker position a change removed or added, so the loop
can re-index what it keys by position (busy clocks, groups in flight, weight pushes). What a resume
restores of it is `ElasticDriver.state_dict`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, Literal

from reflow.config import RunConfig
from reflow.policy.elastic import (
    ElasticPolicy,
    Interval,
    RoleChangeCost,
    Totals,
    decision_event,
    observe,
)
from reflow.policy.lending import LendWindow
from reflow.runtime.actuator import RayActuator

if TYPE_CHECKING:
    from reflow.runtime.lending import LentEngines
    from reflow.runtime.role_change import RoleChange
    from reflow.runtime.tail import GroupInFlight


def moved_positions(before: Sequence[int], after: Sequence[int]) -> tuple[int | None, int | None]:
    """The rollout worker positions a role change removed and added, from the rollout slots' indices
    (in slot order) before and after it: (position in `before` that left, position in `after` that
    joined), None where nothing left or joined."""
    gone = [p for p, s in enumerate(before) if s not in after]
    new = [p for p, s in enumerate(after) if s not in before]
    if len(gone) > 1 or len(new) > 1:
        raise ValueError(f"one role change moves one slot: rollout slots {list(before)} -> {list(after)}")
    return (gone[0] if gone else None), (new[0] if new else None)


class ElasticRuntime:
    """Drives one `ElasticPolicy` on a `Cluster` through a `RayActuator` (module docstring)."""

    def __init__(
        self,
        cluster: Any,
        policy: ElasticPolicy,
        batch_size: float,
        *,
        unit: Literal["samples", "tokens"] = "samples",
        drain_timeout_s: float | None = None,
    ) -> None:
        self.cluster, self.policy, self.batch_size, self.unit = cluster, policy, batch_size, unit
        self.actuator = RayActuator(cluster, drain_timeout_s=drain_timeout_s)
        self.costs: dict[str, RoleChangeCost | None] = {"to_rollout": None, "to_train": None}
        """The last measured cost of each direction (None until one was made)."""
        self.last_change_step = 0

    def at_boundary(
        self,
        interval: Interval,
        *,
        step: int,
        version: int,
        replay_share: float = 0.0,
        fresh_waiting: int = 0,
        in_flight: Mapping[Any, tuple[int, Sequence[str]]] | None = None,
        lend_window: LendWindow | None = None,
    ) -> tuple[dict[str, Any], RoleChange | None]:
        """Decide at this version boundary (no train step in flight) and apply a move. `in_flight`:
        object ref of each `generate` call in flight -> (its worker's position in `cluster.rollout`, the
        group ids registered for it). Returns the metrics event and the applied change (None on
        hold); after a change the driver re-indexes its per-worker state (`cluster.rollout` changed),
        drops the drained refs from its own table and counts `change.drained` as arrived."""
        in_flight = dict(in_flight or {})
        lent = self.actuator.lent
        obs = observe(
            interval,
            step=step,
            version=version,
            steps_since_change=step - self.last_change_step,
            rollout_slots=len(self.cluster.rollout),
            train_slots=len(self.cluster.trainers),
            batch_size=self.batch_size,
            replay_share=replay_share,
            fresh_waiting=fresh_waiting,
            in_flight=len(in_flight),
            to_rollout_cost=self.costs["to_rollout"],
            to_train_cost=self.costs["to_train"],
            unit=self.unit,
            lent_slots=lent.lending if lent is not None else 0,
            lendable_slots=len(self.cluster.lent),
            lend_window=lend_window,
        )
        decision = self.policy.decide(obs)
        event = decision_event(decision, obs)
        if decision.action in ("lend", "reclaim"):
            event.update(self.actuator.lend(decision))
            self.last_change_step = step  # the next change waits its dwell, measured at this split
            return event, None
        if not decision.moves:
            return event, None
        self.actuator.in_flight = in_flight  # what a drain waits for, held for this move only: refs
        try:  # kept past it would pin their results in the object store
            self.costs[decision.action] = self.actuator.move_slot(decision)
        finally:
            self.actuator.in_flight = {}
        self.last_change_step = step
        change = self.actuator.changes[-1]
        event.update({k: v for k, v in change.event().items() if k != "what"})
        event["what"] = f"{decision.action}: {change.event()['what']}"
        return event, change


class ElasticDriver:
    """The loop's side of the elastic pool: counters in, `ElasticRuntime.at_boundary` out."""

    def __init__(
        self, cluster: Any, config: RunConfig, state: Any, now_s: float, lent: LentEngines | None = None
    ) -> None:
        """`state`: the loop's `RunState` at the start, `now_s`: training seconds then; `lent`: the
        loop's lent engines (lending on)."""
        self.group_size = config.rollout.group_size
        batch = config.rollout.groups_per_step * self.group_size
        policy = ElasticPolicy(config.elastic.policy_config())
        self.runtime = ElasticRuntime(
            cluster, policy, batch_size=batch, drain_timeout_s=policy.cfg.drain_timeout_s
        )
        self.runtime.actuator.lent = self.lent = lent
        self.trained = 0.0  # episodes trained on (fresh and replayed; samples, the policy's unit)
        # the trainer's steps since the last change, alone or beside a lent engine (lending on)
        self.window = LendWindow(policy.cfg.lend_window_steps) if lent is not None else None
        self.seen = (state.trainer_busy_s, state.trained_tokens)
        self.then = self._totals(state, now_s, 0.0)

    def stepped(self, groups: int, state: Any) -> None:
        """A step trained `groups` groups (`state`: the loop's `RunState`, the step counted in it).
        With lending, the step goes into the window alone or beside a lent engine, with its yield."""
        work = groups * self.group_size
        self.trained += work
        busy, tokens = state.trainer_busy_s - self.seen[0], state.trained_tokens - self.seen[1]
        self.seen = (state.trainer_busy_s, state.trained_tokens)
        if self.window is not None and self.lent is not None:
            self.window.add(busy, tokens, work, beside=self.lent.beside_step, yield_s=self.lent.yield_s)

    def state_dict(self) -> dict[str, Any]:
        """What a resume restores (saved with checkpoints): the measured cost of each direction, the
        step of the last change (the dwell time), the policy's last move and last lending slowdown,
        and the lending window. The slot layout is the cluster's (`Cluster.roles`), restored when the
        cluster starts."""
        rt, policy = self.runtime, self.runtime.policy
        return {
            "costs": {k: asdict(c) if c is not None else None for k, c in rt.costs.items()},
            "last_change_step": rt.last_change_step,
            "last_move_version": policy.last_move_version,
            "lend_slowdown": policy.lend_slowdown,
            "lend_window": self.window.state_dict() if self.window is not None else None,
            "lent": self.lent.state_dict() if self.lent is not None else None,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        rt = self.runtime
        rt.costs = {k: RoleChangeCost(**c) if c is not None else None for k, c in state["costs"].items()}
        rt.last_change_step = int(state["last_change_step"])
        rt.policy.last_move_version = state["last_move_version"]
        rt.policy.lend_slowdown = state.get("lend_slowdown")
        if self.window is not None and state.get("lend_window"):
            self.window.load_state_dict(state["lend_window"])
        if self.lent is not None and state.get("lent"):
            self.lent.load_state_dict(state["lent"])

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
        now = self._totals(state, now_s, generated)
        interval, self.then = Interval.between(self.then, now), now
        event, change = self.runtime.at_boundary(
            interval,
            step=state.step,
            version=state.version,
            replay_share=replay_share,
            fresh_waiting=fresh_waiting,
            in_flight={ref: (g.worker, [g.group_id]) for ref, g in in_flight.items()},
            lend_window=self.window,
        )
        if self.window is not None and event["what"] != "hold":  # a change: measured afresh from here
            self.window.reset()
        return event, change

    def _totals(self, state: Any, now_s: float, generated: float) -> Totals:
        lent_s = self.lent.busy_s() if self.lent is not None else 0.0
        return Totals(now_s, state.rollout_busy_s, generated, state.trainer_busy_s, self.trained, lent_s)
