"""Per-token RL policy losses for off-policy (stale) trajectories: decoupled PPO and truncated IS.

Three policies meet at each sampled token: behaviour (the weights that sampled it, whose
log-probability the rollout recorded), prox (the current weights before this update, a no-grad
forward pass) and theta (the weights being trained). The PPO ratio u = pi_theta / pi_prox is clipped
around prox, so a step is bounded however stale the data; the behaviour correction
w = pi_prox / pi_behav reweights for the distribution the token was drawn from (DESIGN.md, Losses).

This module owns the loss and its health statistics (clip fraction, weight mean/max, masked
fraction, behaviour-vs-current KL); the log-probabilities come from `reflow.train.logprobs`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch


@dataclass
class LossConfig:
    kind: Literal["decoupled_ppo", "tis"] = "decoupled_ppo"
    clip_eps: float = 0.2
    """Lower clip: u is clipped at 1 - clip_eps."""
    clip_eps_high: float = 0.28
    """Upper clip: u is clipped at 1 + clip_eps_high (DAPO's clip-higher keeps exploration alive)."""
    behav_weight_cap: float = 5.0
    """Decoupled PPO: tokens with w = pi_prox / pi_behav above this are masked out of the loss."""
    tis_cap: float = 2.0
    """Truncated IS: w = min(pi_prox / pi_behav, tis_cap)."""
    agg: Literal["token_mean", "seq_mean_token_mean"] = "token_mean"
    """token_mean: mean over all valid tokens of the batch (long answers weigh more);
    seq_mean_token_mean: mean over each row's valid tokens, then over rows that have any."""

    def __post_init__(self) -> None:
        if self.kind not in ("decoupled_ppo", "tis"):
            raise ValueError(f"unknown loss kind {self.kind!r}")
        if self.agg not in ("token_mean", "seq_mean_token_mean"):
            raise ValueError(f"unknown aggregation {self.agg!r}")
        if not 0.0 <= self.clip_eps < 1.0 or self.clip_eps_high < 0.0:
            raise ValueError("need 0 <= clip_eps < 1 and clip_eps_high >= 0")
        if self.behav_weight_cap <= 0.0 or self.tis_cap <= 0.0:
            raise ValueError("weight caps must be positive")


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `values` where `mask` is set (0.0 when nothing is); masked-out entries may hold
    inf or nan without leaking into the result. For logging entropy and the like."""
    mask = mask.bool()
    picked = torch.where(mask, values.float(), torch.zeros((), dtype=torch.float32, device=values.device))
    return picked.sum() / mask.sum().clamp(min=1)


def _aggregate(per_token: torch.Tensor, valid: torch.Tensor, agg: str) -> torch.Tensor:
    """`per_token` is already 0 wherever `valid` is False."""
    if agg == "token_mean":
        return per_token.sum() / valid.sum().clamp(min=1)
    counts = valid.sum(dim=-1)
    row_means = per_token.sum(dim=-1) / counts.clamp(min=1)
    return row_means.sum() / (counts > 0).sum().clamp(min=1)


def policy_loss(
    logp: torch.Tensor,
    prox_logp: torch.Tensor,
    behav_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: LossConfig | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The policy-gradient loss over the tokens where `mask` is set, and detached scalar statistics.

    All tensors are [B, T] (`advantages` may also be [B], one per row). Gradient flows only through
    `logp`: prox and behaviour log-probabilities are constants here. Per token,
    u = exp(logp - prox_logp), pg = max(-A*u, -A*clip(u, 1 - eps, 1 + eps_high)) and
    w = exp(prox_logp - behav_logp); decoupled PPO drops tokens with w > cap, truncated IS uses
    min(w, cap); the loss aggregates w * pg over the valid tokens (`cfg.agg`).

    Statistics, over the valid tokens (those that enter the loss) unless said otherwise:
    clip_frac (the clipped branch is the max, i.e. the token gives no gradient), w_mean and w_max (the
    weights as applied), masked_frac (share of mask tokens dropped by the decoupled-PPO cap),
    trunc_frac (share of mask tokens whose TIS weight was truncated), kl_behav (k3 estimate of
    KL(behaviour || current) = mean(exp(r) - 1 - r), r = logp - behav_logp, over all mask tokens,
    capped ones included, since they are the divergence it should show) and n_tokens.
    """
    cfg = cfg or LossConfig()
    if advantages.dim() == logp.dim() - 1:
        advantages = advantages.unsqueeze(-1)
    mask = mask.bool()
    logp = logp.float()
    prox_logp = prox_logp.detach().float()
    behav_logp = behav_logp.detach().float()
    advantages = advantages.detach().float().expand_as(logp)
    zero = torch.zeros((), dtype=torch.float32, device=logp.device)

    # Zero the log-ratios off the mask before exp: padding may hold anything, and an inf there would
    # turn into nan gradients even behind a where().
    behav_log_w = torch.where(mask, prox_logp - behav_logp, zero)
    w_raw = behav_log_w.exp()
    if cfg.kind == "decoupled_ppo":
        capped = mask & (w_raw > cfg.behav_weight_cap)
        valid = mask & ~capped
        w = torch.where(valid, w_raw, zero)
        truncated = torch.zeros_like(mask)
    else:
        capped = torch.zeros_like(mask)
        valid = mask
        truncated = mask & (w_raw > cfg.tis_cap)
        w = torch.where(valid, w_raw.clamp(max=cfg.tis_cap), zero)

    u = torch.where(valid, logp - prox_logp, zero).exp()
    pg_plain = -advantages * u
    pg_clipped = -advantages * u.clamp(1.0 - cfg.clip_eps, 1.0 + cfg.clip_eps_high)
    pg = torch.maximum(pg_plain, pg_clipped)
    per_token = torch.where(valid, w * pg, zero)
    loss = _aggregate(per_token, valid, cfg.agg)

    with torch.no_grad():
        n_valid = valid.sum()
        n_mask = mask.sum().clamp(min=1)
        r = torch.where(mask, logp - behav_logp, zero)
        stats = {
            "clip_frac": masked_mean((pg_clipped > pg_plain).float(), valid),
            "w_mean": masked_mean(w, valid),
            "w_max": w.max() if bool(n_valid) else zero.clone(),
            "masked_frac": capped.sum() / n_mask,
            "trunc_frac": truncated.sum() / n_mask,
            "kl_behav": masked_mean(r.exp() - 1.0 - r, mask),
            "n_tokens": n_valid.float(),
        }
    return loss, {k: v.detach().float() for k, v in stats.items()}
