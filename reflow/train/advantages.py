"""Group-relative (GRPO) advantages, the infra-error training mask, and the zero-spread test of a group.

This module owns the learning signal of one trajectory group: which episodes count (an episode whose
status is `infra_error` failed for reasons outside the policy's control, so it is masked out of
training, never scored 0), the advantage of each episode relative to its group, and whether a group
carries any signal at all (DAPO's dynamic sampling drops groups whose rewards are all equal, since
their GRPO advantages are all zero and they only dilute the batch).

Advantages are fixed per group when the group is created; replay reuses them (docs/architecture.md,
"The idea"). Everything here is plain Python on floats: no torch needed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

from reflow.records import MASKED_STATUSES, reward_spread


def valid_for_training(status: str) -> bool:
    """Whether an episode with this status may be trained on (`infra_error` may not)."""
    return status not in MASKED_STATUSES


def train_mask(episodes_statuses: Sequence[str]) -> list[bool]:
    """Per episode: True where it counts for training, False for `infra_error` episodes."""
    return [valid_for_training(s) for s in episodes_statuses]


def _valid_rewards(rewards: Sequence[float], mask: Sequence[bool] | None) -> list[float]:
    if mask is None:
        return [float(r) for r in rewards]
    if len(mask) != len(rewards):
        raise ValueError(f"mask has {len(mask)} entries for {len(rewards)} rewards")
    return [float(r) for r, keep in zip(rewards, mask, strict=True) if keep]


def has_spread(rewards: Sequence[float], *, mask: Sequence[bool] | None = None) -> bool:
    """Whether the (unmasked) rewards differ by more than `records.SPREAD_TOL`; fewer than two valid
    episodes never have spread, as there is nothing to compare."""
    return reward_spread(_valid_rewards(rewards, mask)) > 0


def group_advantages(
    rewards: Sequence[float],
    *,
    scale: Literal["std", "none"] = "std",
    eps: float = 1e-6,
    mask: Sequence[bool] | None = None,
) -> list[float]:
    """GRPO advantages of one group: (r - mean) / (std + eps) with the population std, or r - mean
    when `scale="none"` (Dr. GRPO's unscaled variant).

    `mask` (e.g. from `train_mask`) excludes episodes: they do not enter the mean or std and get
    advantage 0.0 (the trainer should also drop their tokens). A group without spread (see
    `has_spread`) gets exactly 0.0 everywhere rather than float noise over eps.
    """
    if scale not in ("std", "none"):
        raise ValueError(f"scale must be 'std' or 'none', got {scale!r}")
    keep = [True] * len(rewards) if mask is None else [bool(m) for m in mask]
    valid = _valid_rewards(rewards, keep)
    if not has_spread(valid):
        return [0.0] * len(rewards)
    mean = math.fsum(valid) / len(valid)
    denom = 1.0
    if scale == "std":
        denom = math.sqrt(math.fsum((r - mean) ** 2 for r in valid) / len(valid)) + eps
    return [(float(r) - mean) / denom if k else 0.0 for r, k in zip(rewards, keep, strict=True)]
