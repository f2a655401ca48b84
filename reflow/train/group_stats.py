"""Per-group importance-weight statistics of a train step, for replay selection.

A step measures, for each group it trains on, how far the group's data is from the trainer's weights:
with w = pi_prox / pi_behav on each loss-mask token (the pre-update weights over the engine's sampling
policy, whatever the mode's loss uses as behaviour), the normalised ESS of w, the share of tokens whose
w is already past PPO's clip in the direction of their advantage, and the k3 estimate of
KL(behaviour || prox). The trainer adds the per-row sums up per group (`GroupSums`) over its
micro-batches and hands `UseStats` per group to the replay store, which keeps the last use's
(`ReplayStore.set_use_stats`); `reflow.policy.replay_selection` reads them.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence

import torch

from reflow.replay import UseStats
from reflow.train.settings import LossConfig

_KEYS = ("w_sum", "w_sq_sum", "clipped", "kl_sum", "n")


def row_sums(
    prox_logp: torch.Tensor,
    engine_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: LossConfig,
) -> dict[str, torch.Tensor]:
    """Per row ([B] each, over its mask tokens): sum w, sum w^2, tokens past the clip, sum of
    w - 1 - log w, and the token count. `advantages` is [B] or [B, T]."""
    mask = mask.bool()
    # float64: a far-off token's w overflows float32 (log w > 88), and the group's ESS would read NaN
    zero = torch.zeros((), dtype=torch.float64, device=prox_logp.device)
    log_w = torch.where(mask, prox_logp.detach().double() - engine_logp.detach().double(), zero)
    w = torch.where(mask, log_w.exp(), zero)
    adv = advantages.detach().double()
    if adv.dim() == 1:
        adv = adv[:, None]
    adv = adv.expand_as(w)
    past = ((adv > 0) & (w > 1.0 + cfg.clip_eps_high)) | ((adv < 0) & (w < 1.0 - cfg.clip_eps))
    return {
        "w_sum": w.sum(-1),
        "w_sq_sum": (w * w).sum(-1),
        "clipped": (past & mask).float().sum(-1),
        "kl_sum": torch.where(mask, w - 1.0 - log_w, zero).sum(-1),
        "n": mask.float().sum(-1),
    }


class GroupSums:
    """The sums of `row_sums` added up per group over a step's micro-batches."""

    def __init__(self) -> None:
        self._sums: dict[str, list[float]] = defaultdict(lambda: [0.0] * len(_KEYS))

    def add(self, group_ids: Sequence[str], sums: dict[str, torch.Tensor]) -> None:
        """Add one micro-batch's rows; rows without a group (padding) are left out."""
        columns = [sums[k].tolist() for k in _KEYS]
        for i, gid in enumerate(group_ids):
            if gid:
                acc = self._sums[gid]
                for j, column in enumerate(columns):
                    acc[j] += column[i]

    def stats(self) -> dict[str, UseStats]:
        """`UseStats` of each group with at least one mask token. A weight past float range (an engine
        log-prob of -inf) reads as the worst case, ESS 0 and KL inf, never NaN: the store keeps NaN
        as NULL, which would read as "not measured" and let the group through the gates."""
        out = {}
        for gid, (w_sum, w_sq_sum, clipped, kl_sum, n) in self._sums.items():
            if n > 0:
                ess = w_sum * w_sum / (n * w_sq_sum) if w_sq_sum > 0 else 1.0
                kl = kl_sum / n
                out[gid] = UseStats(
                    ess=ess if math.isfinite(ess) else 0.0,
                    clip_frac=clipped / n,
                    kl_behav=kl if math.isfinite(kl) else math.inf,
                )
        return out
