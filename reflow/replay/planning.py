"""Batch planning for the dual replay cycle: which groups a train step uses, over the store's queries.

- `plan_batch` / `consume`: fresh groups first, in arrival order, each trained on once; when fresh
  supply is short, replayed groups (age <= tau_max versions, at most K uses in all) fill the batch up
  to the replay share (`reflow.policy.dual_cycle.ReplayShare`), so the trainer does not idle.
- `accepted_groups` / `room_in`: admission control's counts read from the store.

Zero-spread groups (every episode got the same reward) carry no gradient under group-relative
advantages: they are never trained (DAPO dynamic sampling), never replayed, and do not count as
accepted for admission, so rollout generates replacements for them, just as the sync loop resamples.

Plain functions over a store (`ReplayStore`, or the simulator's `SimStore` with the same queries),
no threads and no clocks: the caller (the training loop) decides when to call them, and tests can
drive them step by step. The replay candidates come from the store's ranked query on its index columns
("spread" and "newest" are that order; "scored" re-ranks the newest of them with the pure policy
`reflow.policy.replay_selection`), which is why planning lives here and not in `reflow.policy`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from reflow.policy.dual_cycle import SHARE_EPS, AdmissionControl, CycleConfig
from reflow.policy.replay_selection import Candidate, ReplaySelection
from reflow.replay.store import GroupInfo, ReplayStore

# ---- admission control's counts


def accepted_groups(store: ReplayStore, *, count_zero_spread: bool = False) -> int:
    """Groups of this run accepted for training, ever (consumed or not), as admission counts them.
    Zero-spread groups are left out unless count_zero_spread: like AReaL's rejected trajectories
    they free their slot, so rollout replaces them instead of leaving the trainer short."""
    return sum(store.reuse_histogram(spread=None if count_zero_spread else True).values())


def room_in(admission: AdmissionControl, store: ReplayStore, version: int) -> int:
    """`admission.room` with accepted and in-flight counts read from the store (so it survives a
    resume)."""
    accepted = accepted_groups(store, count_zero_spread=admission.count_zero_spread)
    return admission.room(version, accepted, store.in_flight())


# ---- batch planning


@dataclass
class BatchPlan:
    """The groups one train step uses: fresh ones (arrival order), then replayed ones."""

    fresh: list[GroupInfo] = field(default_factory=list)
    replay: list[GroupInfo] = field(default_factory=list)
    skipped: list[GroupInfo] = field(default_factory=list)
    """Zero-spread fresh groups passed over: not trained, but `consume` retires them."""

    @property
    def groups(self) -> list[GroupInfo]:
        return [*self.fresh, *self.replay]

    @property
    def group_ids(self) -> list[str]:
        return [g.group_id for g in self.groups]

    @property
    def size(self) -> int:
        return len(self.fresh) + len(self.replay)

    @property
    def replay_fraction(self) -> float:
        """Replayed groups / groups in this batch (0.0 for an empty batch)."""
        return len(self.replay) / self.size if self.size else 0.0

    def staleness(self, current_version: int) -> list[int]:
        """Per group, in `group_ids` order: current_version - policy_version, with current_version the
        trainer's version at the update (the weights the step's gradient is taken at)."""
        return [current_version - g.policy_version for g in self.groups]

    def metrics(self, current_version: int) -> dict[str, float]:
        """Per-step figures for the run log."""
        ages = self.staleness(current_version)
        return {
            "batch_fresh": len(self.fresh),
            "batch_replay": len(self.replay),
            "batch_skipped_zero_spread": len(self.skipped),
            "replay_fraction": self.replay_fraction,
            "staleness_mean": sum(ages) / len(ages) if ages else 0.0,
            "staleness_max": max(ages, default=0),
        }


def _fresh_with_spread(store: ReplayStore, want: int) -> tuple[list[GroupInfo], list[GroupInfo]]:
    """The first `want` fresh groups with spread in arrival order, and the zero-spread fresh groups
    that arrived before the last of them (all of them if fresh supply is short). Reads the store's
    index columns in growing pages: a backlog of fresh groups (a resumed run) is not read all at once."""
    limit = 2 * want + 8
    while True:
        page = store.fresh(limit)
        picked: list[GroupInfo] = []
        skipped: list[GroupInfo] = []
        for g in page:
            if len(picked) == want:
                break
            (picked if g.reward_spread > 0 else skipped).append(g)
        if len(picked) == want or len(page) < limit:
            return picked, skipped
        limit *= 4


SCORED_CANDIDATES = 1024
"""The "scored" selection scores at most this many of the window's groups (those with spread, newest
first): the bound on a plan's work however large the window grows (p50 27 ms with a window of
10,000 beside two CPU-bound processes, `benchmarks/bench_replay.py --plan-only`). The default age
decay halves a score per version, so a group behind a thousand newer ones is a poor pick anyway."""


def _replay_candidates(store: ReplayStore, n: int, current_version: int, cfg: CycleConfig) -> list[GroupInfo]:
    if n <= 0 or cfg.max_reuse <= 1:
        return []
    query = {"current_version": current_version, "tau_max": cfg.tau_max, "max_reuse": cfg.max_reuse}
    if cfg.selection != "scored":
        # The store ranks the window ("spread": the largest spread first; "newest": groups with
        # spread first; then newest: version, then arrival) on its index columns, so the limit alone
        # gives the n candidates: no record is read, however large the window.
        found = store.replayable(**query, limit=n, rank_by_spread=cfg.selection == "spread")
        return [g for g in found if g.reward_spread > 0]
    found = store.replayable(**query, limit=max(n, SCORED_CANDIDATES))
    by_id = {g.group_id: g for g in found}
    picked = ReplaySelection(cfg).select([candidate(g) for g in found], n, current_version)
    return [by_id[gid] for gid in picked]


def candidate(g: GroupInfo) -> Candidate:
    """What replay selection reads of a stored group."""
    use = g.last_use
    return Candidate(
        g.group_id, g.policy_version, g.seq, g.reward_spread, g.pass_rate, g.consumed,
        *((use.ess, use.clip_frac, use.kl_behav) if use else ()),
    )  # fmt: skip


def plan_batch(
    store: ReplayStore,
    *,
    want: int,
    current_version: int,
    share: float,
    cfg: CycleConfig,
    allow_replay: bool = True,
) -> BatchPlan:
    """Plan one train step of up to `want` groups.

    Fresh groups first (never consumed, arrival order, up to `want`), whatever their age: every
    group is trained on at least once. If fewer than `want`, replayed groups fill up to
    min(want - len(fresh), floor(share * want)) from the groups consumed fewer than max_reuse times
    and at most tau_max versions old. The share is a fraction of the nominal batch `want`, not of
    the planned one: with no fresh data at all a step gets floor(share * want) replayed groups
    (replay_fraction 1.0) rather than none, which is what keeps the trainer busy.

    Groups with zero reward spread carry no gradient: they are never replayed, and zero-spread fresh
    groups are passed over (`BatchPlan.skipped`) and retired by `consume`, so they never come back
    as fresh. allow_replay=False (sync and async modes): fresh groups only, each consumed once.
    The plan may be short or empty; whether to train on it or wait is the caller's choice.
    """
    if want < 0:
        raise ValueError(f"want must be >= 0, got {want}")
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"share must be within [0, 1], got {share}")
    fresh, skipped = _fresh_with_spread(store, want)
    n_replay = 0
    if allow_replay:
        n_replay = min(want - len(fresh), math.floor(share * want + SHARE_EPS))
    replay = _replay_candidates(store, n_replay, current_version, cfg)
    return BatchPlan(fresh=fresh, replay=replay, skipped=skipped)


def consume(
    store: ReplayStore, plan: BatchPlan, step: int, skipped: list[str] | tuple[str, ...] = ()
) -> None:
    """Mark a trained plan consumed by `step` (one transaction): its fresh and replayed groups, the
    zero-spread fresh groups it passed over, and any further `skipped` ids the caller retires."""
    ids = [*plan.group_ids, *(g.group_id for g in plan.skipped), *skipped]
    if ids:
        store.mark_consumed(ids, step)


def reuse_histogram(store: ReplayStore) -> dict[int, int]:
    """Consumption count -> number of groups (0: not consumed yet), for the per-step metrics.
    Retired zero-spread groups count as consumed once."""
    return store.reuse_histogram()
