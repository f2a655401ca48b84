"""Replay selection: which stored groups a step replays, scored from what is known about each.

Replay fills a batch up to the replay share (`dual_cycle.ReplayShare` decides how much); the selection
decides which of the replayable groups (consumed fewer than K times, at most tau_max versions old) fill
it (`CycleConfig.selection`). "newest" and "spread" are orders on the store's index columns, which its
query applies (`ReplayStore.replayable`); "scored" is this policy: each candidate gets a score, the
highest first, ties to the newest:

      score = age_decay ** age * spread * (1/2 + 2 p (1 - p)) / uses * ess

  where age is current_version - its version (freshness: prioritised replay without an age decay made
  agentic RL worse, with one it helped), spread its reward spread and p its pass rate (medium
  difficulty first: the factor is 1 at p = 0.5 and 1/2 where every episode passed or failed, which a
  group with spread can be only under graded rewards), uses how many steps trained on it, and ess the normalised effective sample size of the
  importance weights at its last use (1 when none was written back). A group whose last use showed
  the data already off the policy is not replayed at all: ESS under `ess_min`, behaviour KL over
  `kl_max` (the same bounds the replay share's health check applies to a whole batch), or a clip
  fraction over `clip_frac_max` (most of its tokens' weights already past PPO's clip range: the
  policy has moved a trust region's width from it).

Observations in (`Candidate`), decisions out (ids in replay order): no store, no clock, no I/O. The
planner (`reflow.replay.planning`) builds the candidates from the store's index columns.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from reflow.policy.dual_cycle import CycleConfig


@dataclass(frozen=True)
class Candidate:
    """What selection knows about one replayable group (no record)."""

    group_id: str
    version: int
    """Its oldest token's policy version."""
    seq: int
    """Arrival order: the later, the newer among groups of one version."""
    reward_spread: float
    pass_rate: float
    uses: int
    """Steps that trained on it (>= 1 for a replay candidate)."""
    ess: float | None = None
    """Its last use's importance-weight statistics (None: none written back yet)."""
    clip_frac: float | None = None
    kl_behav: float | None = None


class ReplaySelection:
    """The "scored" selection (see the module docstring); its knobs are `CycleConfig`'s."""

    def __init__(self, cfg: CycleConfig) -> None:
        self.cfg = cfg

    def admissible(self, c: Candidate) -> bool:
        """Worth replaying at all: some reward spread and a last use whose importance weights stayed
        healthy (a NaN statistic fails its check: comparisons with NaN are False)."""
        cfg = self.cfg
        return (
            c.reward_spread > 0
            and (c.ess is None or c.ess >= cfg.ess_min)
            and (c.kl_behav is None or c.kl_behav <= cfg.kl_max)
            and (c.clip_frac is None or c.clip_frac <= cfg.clip_frac_max)
        )

    def score(self, c: Candidate, current_version: int) -> float:
        """A candidate's score (0 when not admissible)."""
        if not self.admissible(c):
            return 0.0
        age = max(0, current_version - c.version)
        p = min(1.0, max(0.0, c.pass_rate))
        ess = 1.0 if c.ess is None else min(1.0, c.ess)
        difficulty = 0.5 + 2.0 * p * (1.0 - p)
        return self.cfg.age_decay**age * c.reward_spread * difficulty / max(1, c.uses) * ess

    def select(self, candidates: Sequence[Candidate], n: int, current_version: int) -> list[str]:
        """The ids of up to `n` candidates with a positive score, the highest first (ties: the
        newest version, then the latest arrival): the order they fill the batch."""
        if n <= 0:
            return []
        scored = [(self.score(c, current_version), c) for c in candidates]
        scored = [(s, c) for s, c in scored if s > 0 and math.isfinite(s)]
        scored.sort(key=lambda sc: (sc[0], sc[1].version, sc[1].seq), reverse=True)
        return [c.group_id for _, c in scored[:n]]
