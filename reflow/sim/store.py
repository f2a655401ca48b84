"""An in-memory stand-in for `ReplayStore`'s query surface, which the simulator hands to the real
`reflow.replay.planning` functions (`plan_batch`, `consume`, `room_in`).

Why not a real `ReplayStore` on a temporary SQLite file: the store commits and fsyncs every group
(synchronous=FULL, the durability the runtime needs) and decodes full episode records on every query,
and a 128-GPU scenario stores 10^4-10^5 groups; the simulated groups carry no tokens either. So this
class answers the same queries with the same semantics, over `GroupInfo` objects (index columns, no records):
`fresh`, `replayable`, `mark_consumed`, `reuse_histogram`, `in_flight`, `begin_group`, `end_group`.
It holds no planning logic: which groups a step trains on is decided by `plan_batch`. A test
(tests/test_sim_store.py) drives both stores with the same operations and compares every answer.
"""

from __future__ import annotations

from collections import Counter

from reflow.replay.store import GroupInfo


class SimStore:
    def __init__(self) -> None:
        self._groups: dict[str, GroupInfo] = {}
        self._fresh: dict[str, GroupInfo] = {}  # consumed == 0, in arrival order (dicts keep it)
        self._replay: dict[str, GroupInfo] = {}  # consumed >= 1, pruned of groups too old to matter
        self._in_flight: dict[str, int] = {}
        self._seq = 0
        self._hist: Counter[tuple[int, bool]] = Counter()  # (consumed, has spread) -> groups

    # ---- writing

    def add(self, group_id: str, policy_version: int, reward_spread: float, meta: dict) -> GroupInfo:
        if group_id in self._groups:
            raise ValueError(f"group {group_id!r} is already in the store")
        self._seq += 1
        g = GroupInfo(group_id, self._seq, policy_version, reward_spread, 0, None, meta)
        self._groups[group_id] = self._fresh[group_id] = g
        self._hist[(0, reward_spread > 0)] += 1
        self._in_flight.pop(group_id, None)
        return g

    def mark_consumed(self, group_ids: list[str], step: int) -> None:
        missing = [gid for gid in group_ids if gid not in self._groups]
        if missing:
            raise KeyError(f"no group {missing[0]!r} in the simulated store")
        for gid in dict.fromkeys(group_ids):
            g = self._groups[gid]
            self._hist[(g.consumed, g.reward_spread > 0)] -= 1
            g.consumed += 1
            g.last_step = step
            self._hist[(g.consumed, g.reward_spread > 0)] += 1
            self._fresh.pop(gid, None)
            self._replay[gid] = g

    def begin_group(self, group_id: str, policy_version: int) -> None:
        self._in_flight[group_id] = policy_version

    def end_group(self, group_id: str) -> None:
        self._in_flight.pop(group_id, None)

    def discard_fresh(self) -> None:
        """Forget the fresh groups (the sync loop's spares: a sync step trains only groups of its own
        weights, so the ones it did not need are never trained); they stay in the histogram at 0 uses,
        as they stay unconsumed in a run's store."""
        self._fresh.clear()

    def prune(self, min_version: int, max_reuse: int) -> None:
        """Forget replay candidates that no later query can return (older than min_version or used
        max_reuse times): only to keep queries cheap; the histogram keeps counting them."""
        for gid in [
            g
            for g, grp in self._replay.items()
            if grp.policy_version < min_version or grp.consumed >= max_reuse
        ]:
            del self._replay[gid]

    # ---- the queries reflow.replay.planning makes

    def fresh(self, limit: int | None = None) -> list[GroupInfo]:
        out = []
        for g in self._fresh.values():
            if limit is not None and len(out) >= limit:
                break
            out.append(g)
        return out

    def replayable(
        self,
        *,
        current_version: int,
        tau_max: int,
        max_reuse: int,
        limit: int | None = None,
        prefer_spread: bool = True,
        rank_by_spread: bool = False,
    ) -> list[GroupInfo]:
        found = [
            g
            for g in self._replay.values()
            if 1 <= g.consumed < max_reuse and g.policy_version >= current_version - tau_max
        ]
        if rank_by_spread:
            found.sort(key=lambda g: (g.reward_spread, g.policy_version, g.seq), reverse=True)
        elif prefer_spread:
            found.sort(key=lambda g: (g.reward_spread > 0, g.policy_version, g.seq), reverse=True)
        else:
            found.sort(key=lambda g: (g.policy_version, g.seq), reverse=True)
        return found if limit is None else found[:limit]

    def reuse_histogram(self, *, spread: bool | None = None) -> dict[int, int]:
        out: Counter[int] = Counter()
        for (consumed, has_spread), n in self._hist.items():
            if n and (spread is None or has_spread == spread):
                out[consumed] += n
        return dict(sorted(out.items()))

    def in_flight(self) -> int:
        return len(self._in_flight)

    def in_flight_groups(self) -> dict[str, int]:
        return dict(self._in_flight)

    def group(self, group_id: str) -> GroupInfo:
        return self._groups[group_id]

    def fresh_count(self) -> int:
        return len(self._fresh)
