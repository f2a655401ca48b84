"""The replay-store actor: the durable store plus the dual-cycle queries the training loop asks of it.

The actor holds a `ReplayStore` and exposes, one method each, what the loops, the workers and the
trainer ranks call on it (`.remote`); anything else about a store is read from the store itself
(`reflow replay`), not through the actor. Batch plans travel back to the driver as group ids and
ages, never as records: the trainer ranks read the records from this actor themselves.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from reflow.config import RunConfig
from reflow.policy.dual_cycle import CycleConfig
from reflow.records import EpisodeRecord
from reflow.replay import GroupInfo, ReplayStore, StoredGroup, UseStats
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


class ReplayService:
    def __init__(self, path: str, run: str, cycle: CycleConfig) -> None:
        self.store = ReplayStore(path, run)
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
                self.store,
                want=want,
                current_version=current_version,
                share=share,
                cfg=self.cycle,
                allow_replay=allow_replay,
            )
            if plan.size < want:
                if plan.skipped:
                    self.store.mark_consumed([g.group_id for g in plan.skipped], step)
                return None
            consume(self.store, plan, step)
        return PlannedBatch(plan.group_ids, plan.staleness(current_version), plan.metrics(current_version))

    def accepted(self) -> int:
        """Groups with reward spread ever stored in this run (what admission control counts)."""
        return accepted_groups(self.store)

    # ---- the store's methods the actor's callers use (see `ReplayStore` for each) ---------------------
    def add_group(
        self, episodes: list[EpisodeRecord], advantages: list[float], *, meta: dict[str, Any] | None = None
    ) -> StoredGroup:
        return self.store.add_group(episodes, advantages, meta=meta)

    def mark_consumed(self, group_ids: list[str], step: int) -> None:
        self.store.mark_consumed(group_ids, step)

    def set_use_stats(self, stats: dict[str, UseStats | None], step: int) -> None:
        self.store.set_use_stats(stats, step)

    def rollback_consumption(self, after_step: int) -> int:
        return self.store.rollback_consumption(after_step)

    def begin_group(self, group_id: str, policy_version: int) -> None:
        self.store.begin_group(group_id, policy_version)

    def end_group(self, group_id: str) -> None:
        self.store.end_group(group_id)

    def in_flight(self) -> int:
        return self.store.in_flight()

    def clear_in_flight(self) -> int:
        return self.store.clear_in_flight()

    def start_lineage(self, fork_version: int, parent: int | None) -> int:
        return self.store.start_lineage(fork_version, parent)

    def latest_lineage(self) -> int:
        return self.store.latest_lineage()

    def quarantine(self) -> int:
        return self.store.quarantine()

    def quarantined(self) -> list[str]:
        return self.store.quarantined()

    def set_cursor(self, key: str, value: Any) -> None:
        self.store.set_cursor(key, value)

    def max_meta(self, key: str) -> Any:
        return self.store.max_meta(key)

    def fresh(self, limit: int | None = None) -> list[GroupInfo]:
        return self.store.fresh(limit)

    def group(self, group_id: str) -> StoredGroup:
        return self.store.group(group_id)

    def groups(self, group_ids: list[str]) -> list[StoredGroup]:
        return self.store.groups(group_ids)

    def group_sizes(self, group_ids: list[str]) -> dict[str, int]:
        return self.store.group_sizes(group_ids)

    def count(self, *, consumed: bool | None = None) -> int:
        return self.store.count(consumed=consumed)

    def reuse_histogram(self, *, spread: bool | None = None) -> dict[int, int]:
        return self.store.reuse_histogram(spread=spread)

    def close(self) -> None:
        self.store.close()

    def __repr__(self) -> str:  # Ray prefixes the actor's log lines with it
        return repr(self.store)
