"""Per-token RL policy losses for off-policy (stale) trajectories: decoupled PPO and truncated IS.

Three policies meet at each sampled token: behaviour (the weights that sampled it, whose
log-probability the rollout recorded), prox (the current weights before this update, a no-grad
forward pass) and theta (the weights being trained). The PPO ratio u = pi_theta / pi_prox is clipped
around prox, so a step is bounded however stale the data; the behaviour correction
w = pi_prox / pi_behav reweights for the distribution the token was drawn from.

This module owns the loss, its second-moment trust region on w (M2PO: `second_moment_threshold`) and
its health statistics (clip fraction, weight mean/max, masked fractions, behaviour-vs-current KL); the
log-probabilities come from `reflow.train.logprobs`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from reflow.train.settings import LossConfig

__all__ = [
    "LossConfig",
    "engine_gap_stats",
    "loss_denominator",
    "masked_mean",
    "policy_loss",
    "second_moment_threshold",
    "sq_log_weights",
]


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `values` where `mask` is set (0.0 when nothing is); masked-out entries may hold
    inf or nan without leaking into the result. For logging entropy and the like."""
    mask = mask.bool()
    picked = torch.where(mask, values.float(), torch.zeros((), dtype=torch.float32, device=values.device))
    return picked.sum() / mask.sum().clamp(min=1)


def loss_denominator(row_tokens: Sequence[int] | torch.Tensor, agg: str) -> float:
    """What `policy_loss` divides its sum by, from the loss-mask token count of each row: the count of
    mask tokens (token_mean) or of rows that have any (seq_mean_token_mean). Capped tokens are mask
    tokens: they count here (see `policy_loss`). The trainer adds it up over a mini-batch's
    micro-batches and ranks before the first of them runs."""
    counts = torch.as_tensor(row_tokens, dtype=torch.float64)
    return float(counts.sum() if agg == "token_mean" else (counts > 0).sum())


def _log_weight(prox_logp: torch.Tensor, behav_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log w = log pi_prox - log pi_behav on the mask, 0 off it (padding may hold anything, and an inf
    there would turn into nan gradients even behind a where())."""
    zero = torch.zeros((), dtype=torch.float32, device=prox_logp.device)
    return torch.where(mask.bool(), prox_logp.detach().float() - behav_logp.detach().float(), zero)


def sq_log_weights(prox_logp: torch.Tensor, behav_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The (log w)^2 of every loss-mask token, 1-D: what `second_moment_threshold` reads, computed as
    `policy_loss` compares it, so a threshold taken from these values drops exactly the tokens above it."""
    log_w = _log_weight(prox_logp, behav_logp, mask)
    return (log_w * log_w)[mask.bool()]


def second_moment_threshold(sq_log_w: torch.Tensor, tau: float) -> float:
    """M2PO's trust region: the largest t such that the mean of the values <= t is <= `tau`, from the
    (log w)^2 of every loss-mask token of a mini-batch (`sq_log_weights`); the tokens kept are those
    with (log w)^2 <= t. A function of the values alone: tied values are kept or dropped together,
    and neither the order nor the packing of the tokens changes it. +inf when every token is kept (the
    mean of all of them is already <= tau, or there is none); -inf when none is (the smallest exceeds
    tau).

    Sorted ascending, the mean of the k smallest values is non-decreasing in k, so one prefix-sum scan
    finds it; a prefix may only end where the next value is larger (ties)."""
    values = sq_log_w.detach().flatten().double().sort().values
    n = values.numel()
    if n == 0:
        return math.inf
    prefix_mean = values.cumsum(0) / torch.arange(1, n + 1, dtype=torch.float64, device=values.device)
    ends = torch.ones(n, dtype=torch.bool, device=values.device)
    ends[:-1] = values[1:] > values[:-1]
    fits = (ends & (prefix_mean <= tau)).nonzero()
    if not len(fits):
        return -math.inf
    k = int(fits.max())
    return math.inf if k == n - 1 else float(values[k])


def _aggregate(per_token: torch.Tensor, mask: torch.Tensor, agg: str, denominator: float) -> torch.Tensor:
    """`per_token` is already 0 wherever a token does not enter the loss (off the mask, or capped)."""
    if agg == "token_mean":
        total = per_token.sum()
    else:
        total = (per_token.sum(dim=-1) / mask.sum(dim=-1).clamp(min=1)).sum()
    return total / max(denominator, 1.0)


def policy_loss(
    logp: torch.Tensor,
    prox_logp: torch.Tensor,
    behav_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: LossConfig | None = None,
    replayed: torch.Tensor | None = None,
    denominator: float | None = None,
    m2_threshold: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The policy-gradient loss over the tokens where `mask` is set, and detached scalar statistics.

    All tensors are [B, T] (`advantages` may also be [B], one per row). Gradient flows only through
    `logp`: prox and behaviour log-probabilities are constants here. Per token,
    u = exp(logp - prox_logp), pg = max(-A*u, -A*clip(u, 1 - eps, 1 + eps_high)) and
    w = exp(prox_logp - behav_logp); decoupled PPO drops tokens with w > cap, truncated IS uses
    min(w, cap); the loss aggregates w * pg over the valid tokens (`cfg.agg`). With `cfg.replay_clip`,
    the tokens of `replayed` rows ([B] or [B, T], True for a replayed row) whose r = pi_theta / pi_behav
    is past the clip in their advantage's direction (A > 0 and r > 1 + eps_high, or A < 0 and
    r < 1 - eps) keep their value in the loss but give no gradient. With `m2_threshold`, tokens with
    (log w)^2 above it are dropped as capped ones are (either kind); None: with `cfg.m2_tau` > 0, the
    threshold of this batch's own mask tokens (`second_moment_threshold`), else none.

    Normalisation: the loss is a sum divided by `denominator`. token_mean sums w * pg over the valid
    tokens; seq_mean_token_mean sums each row's mean, that row's sum over its mask tokens. The
    denominator is the count of mask tokens (token_mean) or of rows with a mask token
    (seq_mean_token_mean) of the whole mini-batch, over every micro-batch and rank
    (`loss_denominator`), so the micro-batch losses add up to the mini-batch's loss and a row weighs
    the same however the rows are packed or sharded. None: this batch's own count. A token capped by
    decoupled PPO counts in the denominators (as the loss mask does in verl and AReaL) and adds 0 to
    the sum: capping a token drops its term without raising the weight of the tokens beside it. So
    does a token the M2 threshold drops.

    Statistics, over the valid tokens (those that enter the loss) unless said otherwise:
    clip_frac (the clipped branch is the max, i.e. the token gives no gradient), replay_clip_frac (tokens
    the replay clip stopped, a share of all valid tokens), w_mean and w_max (the
    weights as applied), masked_frac (share of mask tokens dropped by the decoupled-PPO cap),
    m2_masked_frac (share of mask tokens dropped by the M2 threshold; a token may count in both),
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

    behav_log_w = _log_weight(prox_logp, behav_logp, mask)
    w_raw = behav_log_w.exp()
    sq_log_w = behav_log_w * behav_log_w  # as `sq_log_weights` computes it
    if m2_threshold is None and cfg.m2_tau > 0:
        m2_threshold = second_moment_threshold(sq_log_w[mask], cfg.m2_tau)
    m2_dropped = torch.zeros_like(mask) if m2_threshold is None else mask & (sq_log_w > m2_threshold)
    if cfg.kind == "decoupled_ppo":
        capped = mask & (w_raw > cfg.behav_weight_cap)
        valid = mask & ~capped & ~m2_dropped
        w = torch.where(valid, w_raw, zero)
        truncated = torch.zeros_like(mask)
    else:
        capped = torch.zeros_like(mask)
        valid = mask & ~m2_dropped
        truncated = valid & (w_raw > cfg.tis_cap)
        w = torch.where(valid, w_raw.clamp(max=cfg.tis_cap), zero)

    u = torch.where(valid, logp - prox_logp, zero).exp()
    pg_plain = -advantages * u
    pg_clipped = -advantages * u.clamp(1.0 - cfg.clip_eps, 1.0 + cfg.clip_eps_high)
    pg = torch.maximum(pg_plain, pg_clipped)
    per_token = torch.where(valid, w * pg, zero)
    log_r = torch.where(mask, logp.detach() - behav_logp, zero)  # pi_theta / pi_behav, in logs
    replay_clipped = torch.zeros_like(mask)
    if cfg.replay_clip and replayed is not None:
        if replayed.dim() == logp.dim() - 1:
            replayed = replayed.unsqueeze(-1)
        r_behav = log_r.exp()
        past = ((advantages > 0) & (r_behav > 1.0 + cfg.clip_eps_high)) | (
            (advantages < 0) & (r_behav < 1.0 - cfg.clip_eps)
        )
        replay_clipped = valid & replayed.bool().expand_as(mask) & past
        per_token = torch.where(replay_clipped, per_token.detach(), per_token)
    if denominator is None:
        denominator = loss_denominator(mask.sum(dim=-1), cfg.agg)
    loss = _aggregate(per_token, mask, cfg.agg, denominator)

    with torch.no_grad():
        n_valid = valid.sum()
        n_mask = mask.sum().clamp(min=1)
        stats = {
            "clip_frac": masked_mean((pg_clipped > pg_plain).float(), valid),
            "replay_clip_frac": masked_mean(replay_clipped.float(), valid),
            "w_mean": masked_mean(w, valid),
            "w_max": w.max() if bool(n_valid) else zero.clone(),
            "masked_frac": capped.sum() / n_mask,
            "m2_masked_frac": m2_dropped.sum() / n_mask,
            "trunc_frac": truncated.sum() / n_mask,
            "kl_behav": masked_mean(log_r.exp() - 1.0 - log_r, mask),
            "n_tokens": n_valid.float(),
        }
    return loss, {k: v.detach().float() for k, v in stats.items()}


def engine_gap_stats(
    prox_logp: torch.Tensor, engine_logp: torch.Tensor, mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """How far the trainer's pre-update log-probs are from the ones the engine recorded, on the
    sampled tokens, as sums so micro-batches and ranks can be added up before dividing:

    - engine_kl_sum: sum of k3 = r - 1 - log r with r = pi_prox / pi_engine = exp(-d), d = engine_logp
      - prox_logp, i.e. exp(-d) - 1 + d: each term is >= 0 (0 when they agree, whatever the sign of
      the gap) and its mean over tokens the engine sampled estimates KL(engine || prox) without bias;
    - engine_gap_max: max |prox_logp - engine_logp|;
    - w_sum, w_sq_sum, n: for the effective sample size of the weights w = exp(prox - engine),
      ESS = (sum w)^2 / (n sum w^2), 1 when every weight is equal and towards 1/n when one dominates.

    In sync mode the gap is the engine-trainer mismatch alone (numerics: kernels, bf16); in the
    decoupled modes it adds the staleness of the data, and a falling ESS is the early sign of a
    collapse under staleness.
    """
    mask = mask.bool()
    zero = torch.zeros((), dtype=torch.float32, device=prox_logp.device)
    d = torch.where(mask, engine_logp.detach().float() - prox_logp.detach().float(), zero)
    w = torch.where(mask, (-d).exp(), zero)
    return {
        "engine_kl_sum": torch.where(mask, w - 1.0 + d, zero).sum(),
        "engine_gap_max": d.abs().max() if bool(mask.any()) else zero.clone(),
        "w_sum": w.sum(),
        "w_sq_sum": (w * w).sum(),
        "n": mask.sum().float(),
    }


def loglinear_prox(
    behav_logp: torch.Tensor, theta_logp: torch.Tensor, versions: torch.Tensor, prox_version: int
) -> torch.Tensor:
    """Approximate prox log-probs between the behaviour and current ones, by each token's staleness:
    alpha = (v_prox - v_behav) / (v_prox + 1 - v_behav), 0 for a token sampled by the prox weights
    themselves, towards 1 the staler it is. Off the sampled tokens (versions -1) the value is unused."""
    lag = (prox_version - versions).clamp(min=0).to(theta_logp.dtype)
    alpha = lag / (lag + 1.0)
    return behav_logp + alpha * (theta_logp - behav_logp)
