"""The dual replay data cycle: which groups may start, and which groups a train step uses.

This module owns the data policy on top of `ReplayStore` (which only answers queries):

- `AdmissionControl`, AReaL's staleness bound for async mode: a new group may start only while
  the groups not yet trained plus those in flight stay below (eta + 1) * B, counted from the weights
  the engines confirmed. With eta = 0 that is exactly sync.
- `plan_batch` / `consume`, the dual cycle: fresh groups first, in arrival order, each trained on
  once; when fresh supply is short, replayed groups (age <= tau_max versions, at most K uses in all)
  fill the batch up to the replay share, so the trainer does not idle.
- `ReplayShare`, the adaptive replay share: up while the trainer waits for data and the
  importance weights are healthy, down as soon as they are not (masked fraction, behaviour-vs-current
  KL), always within the configured bounds.

Zero-spread groups (every episode got the same reward) carry no gradient under group-relative
advantages: they are never trained (DAPO dynamic sampling), never replayed, and do not count as
accepted for admission, so rollout generates replacements for them, just as the sync loop resamples.

Plain functions over a store, no threads and no clocks: the caller (the training loop) decides
when to call them, and tests can drive them step by step. Imports only the standard library and
`reflow.replay.store`: no torch, no trainer, no engine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from reflow.replay.store import GroupInfo, ReplayStore

_EPS = 1e-9  # floor(share * want) must not lose a group to float error (0.29 * 100 = 28.999...)


@dataclass
class CycleConfig:
    tau_max: int = 2
    """Max age, in policy versions, of a replayed group (current_version - policy_version, the
    version of its oldest token)."""
    max_reuse: int = 2
    """K: total consumptions of a group, the first (fresh) one included; 1 disables replay."""
    share_init: float = 0.25
    """Replay share at the start: the fraction of the nominal batch (`want`) replay may fill."""
    share_min: float = 0.0
    share_max: float = 0.5
    """Never more than this fraction of a nominal batch is replayed."""
    share_step: float = 0.05
    """How much one `ReplayShare.update` moves the share (0 keeps it fixed at share_init)."""
    wait_high_s: float = 0.5
    """The trainer waited longer than this for data -> share up (if IS health is fine)."""
    masked_frac_max: float = 0.02
    """IS health: a masked-token fraction above this -> share down."""
    kl_max: float = 0.05
    """IS health: a behaviour-vs-current KL above this -> share down."""
    ess_min: float = 0.5
    """IS health: a normalised effective sample size of the weights pi_prox / pi_behav below this
    -> share down (ESS falls before the masked fraction rises when staleness starts to hurt)."""
    prefer_spread: bool = True
    """Rank replay candidates by reward spread (largest first), then newest; False: newest only.
    Zero-spread groups are never replayed either way."""

    def __post_init__(self) -> None:
        if self.tau_max < 0:
            raise ValueError(f"tau_max must be >= 0 (policy versions), got {self.tau_max}")
        if self.max_reuse < 1:
            raise ValueError(f"max_reuse must be >= 1 (it counts the first, fresh use), got {self.max_reuse}")
        if not 0.0 <= self.share_min <= self.share_init <= self.share_max <= 1.0:
            raise ValueError(
                "need 0 <= share_min <= share_init <= share_max <= 1, got "
                f"share_min={self.share_min}, share_init={self.share_init}, share_max={self.share_max}"
            )
        for name in ("share_step", "wait_high_s", "masked_frac_max", "kl_max", "ess_min"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")
        for name in ("share_step", "masked_frac_max", "ess_min"):  # fractions
            if getattr(self, name) > 1:
                raise ValueError(f"{name} must be within [0, 1], got {getattr(self, name)}")


# ---- admission control (async mode)


def accepted_groups(store: ReplayStore, *, count_zero_spread: bool = False) -> int:
    """Groups of this run accepted for training, ever (consumed or not), as admission counts them.
    Zero-spread groups are left out unless count_zero_spread: like AReaL's rejected trajectories
    they free their slot, so rollout replaces them instead of leaving the trainer short."""
    return sum(store.reuse_histogram(spread=None if count_zero_spread else True).values())


class AdmissionControl:
    """AReaL-style staleness bound: a new group may start while accepted + in_flight < (eta + 1) * B +
    trained, i.e. while the groups not yet trained plus those in flight stay below (eta + 1) * B.

    B is the groups per train step, `accepted` the groups ever accepted in this run
    (`accepted_groups`), `in_flight` those started and not yet stored or dropped, and `trained` the
    fresh groups trained by the first v steps, where v is the version the engines have confirmed
    (the oldest weights a new group may be generated with). When every step trains B fresh groups
    (sync and async mode) trained = v * B, the default, and the bound reads accepted + in_flight <
    (eta + v + 1) * B: the n-th accepted group (in start order, from 0) starts with weights of
    version >= n // B - eta. Counting v from the engines' confirmed weights, not the trainer's, keeps
    a group started while new weights are still on their way from being one version staler.

    What it bounds (staleness = the trainer's version at the update - the version that generated
    the group): a group that arrives in start order is trained at most `max_fresh_staleness`
    versions stale: eta when every step trains B fresh groups (async); in reflow mode a step may go
    ahead with as few as B - floor(share_max * B) fresh groups (replay fills the rest, the trainer
    does not wait), so a group still in flight then is trained at a later step. A straggler
    overtaken by later groups can be staler (as in AReaL: the decoupled loss corrects for it and
    the staleness metric shows it). eta = 0 in async mode is sync: B accepted groups per version,
    each generated with the current weights (replacements for zero-spread ones included), nothing in
    flight when the trainer steps, and no group for version v + 1 before it has.

    The bound holds when one place (the driver) checks `room` and registers each start
    (`ReplayStore.begin_group`) before checking again.
    """

    def __init__(self, eta: int, groups_per_step: int, *, count_zero_spread: bool = False) -> None:
        if eta < 0:
            raise ValueError(f"eta (max staleness in policy versions) must be >= 0, got {eta}")
        if groups_per_step < 1:
            raise ValueError(f"groups_per_step must be >= 1, got {groups_per_step}")
        self.eta = eta
        self.groups_per_step = groups_per_step
        self.count_zero_spread = count_zero_spread

    def capacity(self, version: int, trained: int | None = None) -> int:
        """How many groups may have been accepted or be in flight while the engines have `version`:
        (eta + 1) * B + trained (default trained: version * B, each step trained B fresh groups)."""
        if version < 0:
            raise ValueError(f"policy version must be >= 0, got {version}")
        if trained is None:
            trained = version * self.groups_per_step
        if trained < 0:
            raise ValueError(f"trained groups must be >= 0, got {trained}")
        return (self.eta + 1) * self.groups_per_step + trained

    def room(self, version: int, accepted: int, in_flight: int, trained: int | None = None) -> int:
        """How many more groups may start now (>= 0)."""
        return max(0, self.capacity(version, trained) - accepted - in_flight)

    def may_start(self, version: int, accepted: int, in_flight: int, trained: int | None = None) -> bool:
        return self.room(version, accepted, in_flight, trained) > 0

    def max_fresh_staleness(self, share_max: float = 0.0) -> int:
        """The staleness bound of groups arriving in start order, when replay may fill up to
        `share_max` of a batch: ceil((eta + 1) * B / m) - 1 with m = B - floor(share_max * B) the
        fewest fresh groups a full step trains (eta when nothing is replayed)."""
        B = self.groups_per_step
        fewest = B - math.floor(share_max * B + _EPS)
        if fewest < 1:
            raise ValueError(f"share_max {share_max} lets a step train no fresh group: no bound")
        return -(-(self.eta + 1) * B // fewest) - 1

    def room_in(self, store: ReplayStore, version: int) -> int:
        """`room` with accepted and in-flight counts read from the store (so it survives a resume)."""
        accepted = accepted_groups(store, count_zero_spread=self.count_zero_spread)
        return self.room(version, accepted, store.in_flight())

    def __repr__(self) -> str:
        return f"AdmissionControl(eta={self.eta}, groups_per_step={self.groups_per_step})"


# ---- the adaptive replay share


class ReplayShare:
    """The adaptive replay share: up when the trainer waits for data and IS health is fine, down when
    IS health degrades (masked fraction or KL over bounds, ESS under its floor); always within
    [share_min, share_max].

    One `update` per train step, one `share_step` at most:
    - health degraded (masked_frac > masked_frac_max, kl > kl_max or ess < ess_min, or any of them
      not a finite number: a NaN KL means something broke, so be conservative) -> down, even if the
      trainer waited;
    - else the trainer waited more than wait_high_s -> up;
    - else hold. Not drift back to share_init: a trainer that no longer waits may be fed *because*
      of the replay share, and lowering it would bring the wait back (an oscillation); a share that
      hurts shows up in the health signals and is lowered by them.
    """

    def __init__(self, cfg: CycleConfig) -> None:
        self.cfg = cfg
        self.share: float = cfg.share_init
        self.history: list[tuple[int, float]] = []
        """(step, share) after each update."""
        self.last_reason: str = "init"
        """Why the last update moved or held the share: "health", "wait" or "hold"."""

    def update(
        self, step: int, *, trainer_wait_s: float, masked_frac: float, kl: float, ess: float = 1.0
    ) -> float:
        cfg = self.cfg
        # comparisons with NaN are False: a NaN signal counts as unhealthy
        healthy = masked_frac <= cfg.masked_frac_max and kl <= cfg.kl_max and ess >= cfg.ess_min
        if not healthy:
            share, self.last_reason = self.share - cfg.share_step, "health"
        elif trainer_wait_s > cfg.wait_high_s:
            share, self.last_reason = self.share + cfg.share_step, "wait"
        else:
            share, self.last_reason = self.share, "hold"
        # Rounding keeps repeated steps of 0.05 landing on the bounds exactly (no 0.30000000000000004).
        self.share = min(cfg.share_max, max(cfg.share_min, round(share, 12)))
        self.history.append((step, self.share))
        return self.share

    def state_dict(self) -> dict[str, Any]:
        """For checkpoints (e.g. `ReplayStore.set_cursor("replay_share", ...)`)."""
        return {"share": self.share, "history": [list(h) for h in self.history]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        share = float(state["share"])
        self.share = min(self.cfg.share_max, max(self.cfg.share_min, share))  # the bounds may have changed
        self.history = [(int(s), float(v)) for s, v in state.get("history", [])]


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


def _replay_candidates(store: ReplayStore, n: int, current_version: int, cfg: CycleConfig) -> list[GroupInfo]:
    if n <= 0 or cfg.max_reuse <= 1:
        return []
    query = {"current_version": current_version, "tau_max": cfg.tau_max, "max_reuse": cfg.max_reuse}
    # The store ranks the window (largest spread first with prefer_spread, else groups with spread
    # first; then newest: version, then arrival) on its index columns, so the limit alone gives the
    # n candidates: no record is read, however large the window.
    found = store.replayable(**query, limit=n, prefer_spread=True, rank_by_spread=cfg.prefer_spread)
    return [g for g in found if g.reward_spread > 0]


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
        n_replay = min(want - len(fresh), math.floor(share * want + _EPS))
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
