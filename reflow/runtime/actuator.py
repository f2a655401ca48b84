"""The Ray runtime's `Actuator` (`reflow.policy.actuator`): the policies' decisions applied to actors.

- `move_slot`: `Cluster.move` (`reflow.runtime.role_change`). Towards training, the rollout
  worker with the fewest groups in flight drains (`worker_to_drain`; its groups in flight, from
  `in_flight`, are waited for; episodes a lent engine handed over to it count as the groups they
  fill, and fall back to their lent engine when it goes); towards rollout, the last train slot leaves the trainer group. Every
  applied change is kept in `changes` (the loop re-indexes its per-worker state from the last one).
- `lend`: how many of the engines beside the trainer ranks take groups (`LentEngines.lending`,
  `reflow.runtime.lending`); refused when lending is off.
- `migrate`, `free_engine`, `set_concurrency`: through the tail runtime
  (`reflow.runtime.tail.TailRuntime`), which asks the rollout workers; without one (the tail's
  per-episode actions switched off) they are refused, and logged as not applied.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from reflow.policy.elastic import ElasticDecision, RoleChangeCost
from reflow.policy.tail_actions import FreeSlot, Migrate, SetConcurrency

if TYPE_CHECKING:
    from reflow.runtime.role_change import RoleChange


def worker_to_drain(in_flight_per_worker: Sequence[int]) -> int:
    """The rollout worker a move to training takes: the one with the fewest groups in flight (the
    shortest drain); ties go to the last one (the highest slot)."""
    if not in_flight_per_worker:
        raise ValueError("no rollout worker to drain")
    return min(reversed(range(len(in_flight_per_worker))), key=in_flight_per_worker.__getitem__)


class RayActuator:
    """Applies decisions on a `Cluster` (see the module docstring). `tail`: the
    `reflow.runtime.tail.TailRuntime` that applies per-episode actions (None: they are refused; typed
    by its use here, as that module builds its actuator from this one); `drain_timeout_s`: how long
    a move to training waits for the drained worker's groups at most."""

    def __init__(self, cluster: Any, tail: Any = None, drain_timeout_s: float | None = None) -> None:
        self.cluster, self.tail, self.drain_timeout_s = cluster, tail, drain_timeout_s
        self.lent: Any = None
        """The loop's `reflow.runtime.lending.LentEngines` (None: lending is off)."""
        self.in_flight: Mapping[Any, tuple[int, Sequence[str]]] = {}
        """The loop's groups in flight (object ref of a `generate` call -> its worker's position in
        `cluster.rollout`, the group ids registered for it); the elastic runtime sets it before asking."""
        self.changes: list[RoleChange] = []

    def move_slot(self, decision: ElasticDecision) -> RoleChangeCost:
        if decision.action == "to_train":
            counts = [0] * len(self.cluster.rollout)
            for worker, _ in self.in_flight.values():
                counts[worker] += 1
            if self.lent is not None:  # episodes a lent engine handed over, as the groups they fill
                served = self.lent.served_loads()
                counts = [n + -(-k // self.lent.group_size) for n, k in zip(counts, served, strict=True)]
            worker = worker_to_drain(counts)
            slot: int | str = self.cluster.rollout_slots[worker].index
            drain = {ref: list(ids) for ref, (w, ids) in self.in_flight.items() if w == worker}
            change = self.cluster.move(slot, "train", drain, self.drain_timeout_s)
        else:
            change = self.cluster.move("train", "rollout")
        self.changes.append(change)
        return change.cost

    def lend(self, decision: ElasticDecision) -> dict[str, Any]:
        if self.lent is None:
            return {"applied": False, "error": "no engine to lend (elastic.lend is off)"}
        self.lent.lending = decision.lent_slots
        return {"applied": True}

    def migrate(self, action: Migrate) -> dict[str, Any]:
        if self.tail is None:
            return {"applied": False}
        return self.tail.migrate(action)

    def free_engine(self, action: FreeSlot) -> dict[str, Any]:
        return {"applied": self.tail is not None and self.tail.free(action)}

    def set_concurrency(self, action: SetConcurrency) -> dict[str, Any]:
        if self.tail is None:
            return {"applied": False}
        return self.tail.set_concurrency(action)
