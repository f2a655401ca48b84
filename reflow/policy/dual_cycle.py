"""The dual replay cycle's policies: which groups may start, and how much of a batch replay may fill.

- `AdmissionControl`, AReaL's staleness bound for async mode: a new group may start only while
  the groups not yet trained plus those in flight stay below (eta + 1) * B, counted from the weights
  the engines confirmed. With eta = 0 that is exactly sync.
- `ReplayShare`, the adaptive replay share: up while the trainer waits for data and the
  importance weights are healthy, down as soon as they are not (masked fraction, behaviour-vs-current
  KL), always within the configured bounds.
- `CycleConfig`, the cycle's knobs (`reflow.config` builds its `replay:` section from them).

Which groups a step trains (fresh first, replay filling up to the share) is planned over the store's
ranked queries in `reflow.replay.planning`: the ranking is the store's SQL, so the planning lives
beside it. Counters in, decisions out: no store, no clock, no I/O here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

SHARE_EPS = 1e-9
"""floor(share * n) must not lose a group to float error (0.29 * 100 = 28.999...)."""


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
    """IS health: a behaviour-vs-current KL above this -> share down (and, with selection "scored",
    a group whose last use measured more is not replayed)."""
    ess_min: float = 0.5
    """IS health: a normalised effective sample size of the weights pi_prox / pi_behav below this
    -> share down (ESS falls before the masked fraction rises when staleness starts to hurt; with
    selection "scored", a group whose last use measured less is not replayed)."""
    selection: Literal["spread", "newest", "scored"] = "spread"
    """Which replayable groups fill the replay share first (`reflow.policy.replay_selection`): the
    largest reward spread, then the newest ("spread"); the newest ("newest"); or the highest score
    from age, spread, pass rate, uses and the last use's importance weights ("scored"). Zero-spread
    groups are never replayed."""
    age_decay: float = 0.5
    """"scored": a candidate's score is multiplied by this per policy version of age."""
    clip_frac_max: float = 0.5
    """"scored": a group whose last use found more than this share of its tokens' weights pi_prox /
    pi_behav past PPO's clip range is not replayed (ess_min and kl_max gate each group's last use the
    same way)."""

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
        for name in ("share_step", "wait_high_s", "masked_frac_max", "kl_max", "ess_min", "clip_frac_max"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")
        if self.selection not in ("spread", "newest", "scored"):
            raise ValueError(f"selection must be 'spread', 'newest' or 'scored', got {self.selection!r}")
        if not 0.0 < self.age_decay <= 1.0:
            raise ValueError(f"age_decay must be within (0, 1], got {self.age_decay}")
        for name in ("share_step", "masked_frac_max", "ess_min", "clip_frac_max"):  # fractions
            if getattr(self, name) > 1:
                raise ValueError(f"{name} must be within [0, 1], got {getattr(self, name)}")


# ---- admission control (async mode)


class AdmissionControl:
    """AReaL-style staleness bound: a new group may start while accepted + in_flight < (eta + 1) * B +
    trained, i.e. while the groups not yet trained plus those in flight stay below (eta + 1) * B.

    B is the groups per train step, `accepted` the groups ever accepted in this run
    (`accepted_groups`), `in_flight` those started and not yet stored or dropped, and `trained` the
    fresh groups trained by the first v steps, where v is the version the engines have confirmed
    (the oldest weights a new group may be generated with; the loop asks per start, with the
    confirmed version of the engines it starts on: the rollout workers' oldest, or a lent engine's
    own, so the bound holds group by group). When every step trains B fresh groups
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
    (`ReplayStore.begin_group`) before checking again. `reflow.replay.planning.room_in` reads the
    counts from a store.
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
        fewest = B - math.floor(share_max * B + SHARE_EPS)
        if fewest < 1:
            raise ValueError(f"share_max {share_max} lets a step train no fresh group: no bound")
        return -(-(self.eta + 1) * B // fewest) - 1

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
