"""The replay-store actor: the durable store plus the dual-cycle queries the training loop asks of it.

Batch plans travel back to the driver as group ids and ages, never as records: the trainer ranks read
the records from this actor themselves.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from reflow.config import RunConfig
from reflow.policy.dual_cycle import CycleConfig
from reflow.replay import ReplayStore
from reflow.replay.planning import accepted_groups, consume, plan_batch


def cycle_config(config: RunConfig) -> CycleConfig:
    """The dual-cycle settings of `replay:` (every field but the async bound `eta`, which is the
    driver's admission control)."""
    return config.replay.cycle()


@dataclass
class PlannedBatch:
    group_ids: list[str]
    staleness: list[int]
    metrics: dict[str, float]


REPLAY_THREADS = 8
"""Calls the replay actor serves at once (a threaded Ray actor): writers, the planner and trainer
ranks reading their shares do not queue behind one another. The store serialises its SQL under one
lock and decodes records outside it."""


class ReplayService(ReplayStore):
    def __init__(self, path: str, run: str, cycle: CycleConfig) -> None:
        super().__init__(path, run)
        self.cycle = cycle
        self._planning = threading.Lock()  # a plan and its consumption are one step, never interleaved

    def plan_and_consume(
        self, want: int, current_version: int, share: float, allow_replay: bool, step: int
    ) -> PlannedBatch | None:
        """Plan a batch of `want` groups (fresh first, replay to fill when allowed); when it is full,
        mark it consumed by `step` at once (so no other plan takes the same fresh groups) and return
        it, else None (the caller waits for more rollouts). Zero-spread fresh groups passed over are
        retired either way. Marked before the step trains: if the run dies before a checkpoint at
        `step` or later, the resumed run undoes the marks (`rollback_consumption`)."""
        with self._planning:
            plan = plan_batch(
                self,
                want=want,
                current_version=current_version,
                share=share,
                cfg=self.cycle,
                allow_replay=allow_replay,
            )
            if plan.size < want:
                if plan.skipped:
                    self.mark_consumed([g.group_id for g in plan.skipped], step)
                return None
            consume(self, plan, step)
        return PlannedBatch(plan.group_ids, plan.staleness(current_version), plan.metrics(current_version))

    def accepted(self) -> int:
        """Groups with reward spread ever stored in this run (what admission control counts)."""
        return accepted_groups(self)
