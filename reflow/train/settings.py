"""The trainer's and the loss's settings: plain dataclasses with no torch, so that the run config
(`reflow.config`) builds its `train:` and `train.loss:` sections from their fields without importing
torch: each default and check is defined once, here. `reflow.train.trainer` and `reflow.train.losses`
use them."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal


@dataclass
class LossConfig:
    kind: Literal["decoupled_ppo", "tis"] = "decoupled_ppo"
    """Both clip u = pi_theta / pi_prox and weight a token by w = pi_prox / pi_behav: decoupled_ppo
    drops tokens with w above `behav_weight_cap`, tis (truncated IS) uses min(w, `tis_cap`)."""
    clip_eps: float = 0.2
    """Lower clip: u is clipped at 1 - clip_eps."""
    clip_eps_high: float = 0.28
    """Upper clip: u is clipped at 1 + clip_eps_high (DAPO's clip-higher keeps exploration alive)."""
    behav_weight_cap: float = 5.0
    """Decoupled PPO: tokens with w = pi_prox / pi_behav above this are masked out of the loss."""
    tis_cap: float = 2.0
    """Truncated IS: w = min(pi_prox / pi_behav, tis_cap)."""
    replay_clip: bool = False
    """Replayed rows (groups a step before this one trained on) also get PPO's later-epoch clip against
    the policy that sampled them: a token gives no gradient once pi_theta / pi_behav is past
    1 + clip_eps_high with a positive advantage, or under 1 - clip_eps with a negative one. The
    decoupled clip is around prox, which each step moves, so without this a replayed token is pushed
    again however far its first use already moved it. Fresh rows are unchanged."""
    agg: Literal["token_mean", "seq_mean_token_mean"] = "token_mean"
    """token_mean: mean over all loss-mask tokens of the mini-batch (long answers weigh more);
    seq_mean_token_mean: mean over each row's mask tokens, then over the mini-batch's rows that have
    any. Over the whole mini-batch, whatever the micro-batches and ranks; a token the decoupled-PPO
    cap drops counts in both means and adds 0 (`losses.policy_loss`)."""
    m2_tau: float = 0.0
    """> 0: a second-moment trust region on the behaviour weights w = pi_prox / pi_behav (M2PO), for
    both kinds: the loss-mask tokens with the largest (log w)^2 are dropped until the mean of (log w)^2
    over the tokens kept is <= m2_tau, over the whole mini-batch (`losses.second_moment_threshold`). A
    dropped token is treated as a capped one: it stays in the denominator, adds 0 and gives no gradient.
    Costs one no-grad forward per batch (the exact prox log-probs before the first update); nothing is
    dropped in sync mode, where w is 1. 0: off."""

    def __post_init__(self) -> None:
        if self.kind not in ("decoupled_ppo", "tis"):
            raise ValueError(f"unknown loss kind {self.kind!r}")
        if self.agg not in ("token_mean", "seq_mean_token_mean"):
            raise ValueError(f"unknown aggregation {self.agg!r}")
        if not 0.0 <= self.clip_eps < 1.0 or self.clip_eps_high < 0.0:
            raise ValueError("need 0 <= clip_eps < 1 and clip_eps_high >= 0")
        if self.behav_weight_cap <= 0.0 or self.tis_cap <= 0.0:
            raise ValueError("weight caps must be positive")
        if not (math.isfinite(self.m2_tau) and self.m2_tau >= 0.0):
            raise ValueError(f"m2_tau must be finite and >= 0, got {self.m2_tau}")


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""Every linear projection of a Llama/Qwen-style decoder layer, attention and MLP (the default targets)."""


@dataclass
class LoraSettings:
    """LoRA on the policy (`model.lora:`): the trainer trains low-rank adapters on the frozen base
    weights through peft (`reflow.train.lora`), and the engines receive the adapters alone."""

    r: int = 16
    """The adapters' rank."""
    alpha: float = 32.0
    """The adapters' scale: a layer computes W x + (alpha / r) B A x."""
    dropout: float = 0.0
    """Dropout on the adapters' input while training. Above 0 the trainer's log-probs are not the
    engine's (which runs without dropout), so the importance weights carry that noise too."""
    target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    """Names (last component) of the linear layers that get adapters."""

    def __post_init__(self) -> None:
        if self.r < 1:
            raise ValueError(f"r must be >= 1, got {self.r}")
        if not (math.isfinite(self.alpha) and self.alpha > 0):
            raise ValueError(f"alpha must be > 0, got {self.alpha}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        if not self.target_modules or not all(isinstance(m, str) and m for m in self.target_modules):
            raise ValueError(
                f"target_modules must be a non-empty list of module names, got {self.target_modules}"
            )


@dataclass
class TrainerConfig:
    lr: float = 1e-4
    """AdamW's learning rate."""
    weight_decay: float = 0.0
    """AdamW's decoupled weight decay."""
    grad_clip: float = 1.0
    """The largest gradient norm; larger ones are scaled down to it."""
    micro_batch_tokens: int = 16384
    """Padded tokens per forward/backward."""
    loss: LossConfig = field(default_factory=LossConfig)
    behaviour_is_prox: bool = True
    """Sync mode: the sampling policy is the pre-update policy, so the IS weight is exactly 1 and the
    engine's log-probs are not used, for every token of the trainer's own version; an older token (a
    partial rollout carried over a step, sync mode's tail handling) keeps the engine's. False: behaviour log-probs are the engine's, so the weight
    pi_prox / pi_behav corrects staleness and the engine-trainer mismatch (capped or truncated by the
    loss). The gap is logged either way (engine_kl, engine_gap_max, is_ess)."""
    temperature: float = 1.0
    """The sampling temperature: log-probs are taken under the same tempered distribution."""
    bf16: bool | None = None
    """bf16 autocast; None: on GPU only (see PolicyTrainer.__init__): on CPU the engine samples in fp32,
    and bf16 log-probs would drift from the engine's."""
    seed: int = 0
    minibatches: int = 1
    """Optimizer steps per batch: the rows are split into this many shuffled mini-batches (verl's
    ppo_mini_batch_size). With more than one, prox is the weights before the first step (see
    `prox_logp`), and the PPO clip keeps the later steps near it."""
    epochs: int = 1
    """Passes over the batch's mini-batches (PPO epochs)."""
    lora: LoraSettings | None = None
    """LoRA adapters on a frozen base (`model.lora`); None: every weight trains."""
    prox_logp: Literal["recompute", "loglinear"] = "recompute"
    """How later updates get prox log-probs: "recompute" (a no-grad forward before the first update) or
    "loglinear" (no extra forward: per token, log pi_prox ~ log pi_behav + alpha (log pi_theta -
    log pi_behav) with alpha = (v_prox - v_behav) / (v_prox + 1 - v_behav), AReaL's approximation).
    The first update uses the exact, free detached log-probs of its own forward pass, unless
    `loss.m2_tau` > 0 off sync mode: its threshold needs them before the first update, so they are
    recomputed (and "loglinear" is refused)."""

    def __post_init__(self) -> None:
        for name in ("lr", "grad_clip", "micro_batch_tokens"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not self.weight_decay >= 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay}")
        for name in ("minibatches", "epochs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.prox_logp not in ("recompute", "loglinear"):
            raise ValueError(f"prox_logp must be 'recompute' or 'loglinear', got {self.prox_logp!r}")
        if self.loss.m2_tau > 0 and self.prox_logp == "loglinear":
            raise ValueError("loss.m2_tau > 0 needs the exact prox log-probs: prox_logp must be 'recompute'")
