"""The policy trainer: one RL optimizer step on a batch of trajectory groups.

    trainer = PolicyTrainer(model, pad_id, TrainerConfig(lr=1e-4))
    metrics = trainer.train_step(rows_from_groups(groups), step=7)

A step packs the rows into micro-batches by padded-token budget, accumulates gradients of the policy
loss (decoupled PPO or truncated IS, `reflow.train.losses`), clips the gradient norm and takes an AdamW
step, once per mini-batch and epoch (`minibatches`, `epochs`; one update by default). The proximal
policy is the weights before the first update; with one update per batch its log-probs are exactly the
detached log-probs of the same forward pass, so no extra forward is spent on them (unless the M2 trust
region is on, below). In sync mode the behaviour policy *is* the proximal one (`behaviour_is_prox`)
for the tokens of the trainer's own version: their IS weight is exactly 1 and nothing is masked (an
older token, a partial rollout carried over a step, keeps the engine's log-prob). Otherwise the behaviour log-probs are the ones the
engine recorded at sampling time. Every step also reports how far the trainer's pre-update log-probs
are from the engine's (`engine_kl`, an estimate of KL(engine || prox), and `engine_gap_max`) and the
effective sample size of the weights between them (`is_ess`): in sync mode that is the engine-trainer
mismatch alone.

Several ranks: `reflow.train.distributed.init_distributed` starts a gloo (CPU) or NCCL process group and
the model is sharded with FSDP2 (`fully_shard`, one unit per decoder layer); each rank trains on its
share of the rows.

LoRA (`TrainerConfig.lora`): peft adapters are injected into the model in place (`reflow.train.lora`),
the base weights are frozen and AdamW holds the adapters alone; `full_state_dict` and the checkpoints
carry the adapters only.

Normalisation: before a mini-batch's first micro-batch the trainer adds up, over every rank, the loss's
denominator (its loss-mask tokens, or its rows for `seq_mean_token_mean`), and each micro-batch's loss
is its sum over that count (`losses.policy_loss`): the gradient is a function of the mini-batch's rows
alone, the same whatever `micro_batch_tokens`, the packing or the rank count. The M2 trust region
(`LossConfig.m2_tau` > 0) is one threshold per mini-batch the same way: from the (log w)^2 of every
loss-mask token of every micro-batch and rank (gathered to every rank), before the first micro-batch.
It needs the prox log-probs before the first update, so off sync mode it costs one extra no-grad
forward over the batch even for a single update; in sync mode w is 1 and nothing is spent.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from reflow.replay import UseStats
from reflow.train.batch import TrainRow, equalize_micro_batches
from reflow.train.distributed import all_gather, shard_model
from reflow.train.group_stats import GroupSums, row_sums
from reflow.train.logprobs import logprobs_from_logits, pad_segments, token_logprobs
from reflow.train.lora import adapter_state_dict, apply_lora, check_adapters, has_adapters, is_adapter
from reflow.train.losses import (
    engine_gap_stats,
    loglinear_prox,
    loss_denominator,
    policy_loss,
    second_moment_threshold,
    sq_log_weights,
)
from reflow.train.prefix import shared_prefix_len, suffix_logits
from reflow.train.settings import TrainerConfig
from reflow.train.sft import pack_batches, use_bf16

__all__ = [
    "EMPTY_STEP_METRICS",
    "PolicyTrainer",
    "TrainRow",
    "TrainerConfig",
    "equalize_micro_batches",
    "loglinear_prox",
]


_VALID_STATS = ("clip_frac", "replay_clip_frac", "w_mean")
"""Loss statistics that are means over the tokens that enter the loss (capped ones excluded)."""
_MASK_STATS = ("masked_frac", "m2_masked_frac", "kl_behav")
"""Loss statistics that are means over every loss-mask token."""

EMPTY_STEP_METRICS: dict[str, float] = {
    **dict.fromkeys(("loss", "entropy", "clip_frac", "replay_clip_frac", "masked_frac", "kl_behav"), 0.0),
    **dict.fromkeys(("grad_norm", "grad_skipped", "updates", "trained_tokens", "new_trained_tokens"), 0.0),
    **dict.fromkeys(("m2_masked_frac", "rows", "train_s", "engine_kl", "engine_gap_max"), 0.0),
    **dict.fromkeys(("w_mean", "w_max", "is_ess"), 1.0),  # no weight differs from 1
}
"""What `train_step` returns for a step with no sampled token: every key of a real step, neutral."""


def _loss_tokens(row: TrainRow) -> int:
    """The row's tokens in the loss mask (`pad_segments` drops position 0: nothing predicts it)."""
    return sum(row.segment.loss_mask[1:])


def _sum_stat(stats: dict[str, Any], key: str) -> float:
    value = stats.get(key, 0.0)
    return float(value.item() if isinstance(value, torch.Tensor) else value)


class PolicyTrainer:
    """Holds the model and AdamW state; `train_step` is one update. Works on one rank or under FSDP2."""

    def __init__(self, model: torch.nn.Module, pad_id: int, config: TrainerConfig | None = None) -> None:
        self.cfg = config or TrainerConfig()
        self.pad_id = pad_id
        self.model = model
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.lora = self.cfg.lora
        self.base_path = str(getattr(model, "name_or_path", "") or "")
        """The base model's folder (where the model was loaded from): LoRA checkpoints name it."""
        if self.lora is not None and not has_adapters(model):
            apply_lora(model, self.lora, seed=self.cfg.seed)  # base frozen: only the adapters train
        if self.world_size > 1:
            shard_model(model)
        trainable = [p for p in model.parameters() if p.requires_grad]
        decay = [p for p in trainable if p.ndim >= 2]
        no_decay = [p for p in trainable if p.ndim < 2]
        self.optimizer = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": self.cfg.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=self.cfg.lr,
        )
        # The loss weighs each token by pi_prox / pi_behav, the behaviour log-prob coming from the engine.
        # On CPU the engine samples in fp32, and bf16 autocast here put the trainer's log-probs up to 0.19
        # nats (p99 0.04) off the engine's on the tiny model: noise in every weight, for no speed-up
        # (measured). So bf16 by default only on GPU, where the engines run in bf16 too.
        self.bf16 = use_bf16(model.device, self.cfg.bf16)
        self.step = 0
        self.version = 0
        self.rng = random.Random(self.cfg.seed + self.rank)
        self.group_stats: dict[str, UseStats | None] = {}
        """What the last `train_step` measured on each of this rank's groups (`reflow.train.group_stats`),
        from the updates whose prox log-probs are exact (all of them by default; with loglinear prox,
        those of the first mini-batch: the others' groups get None)."""

    def _micro_batches(self, rows: Sequence[TrainRow]) -> list[list[TrainRow]]:
        by_segment = {id(r.segment): r for r in rows}
        segments = [r.segment for r in rows]
        shared = shared_prefix_len(segments) if self.world_size == 1 else 0
        batches = pack_batches(segments, self.cfg.micro_batch_tokens, self.rng, shared)
        out = [[by_segment[id(s)] for s in batch] for batch in batches]
        if self.world_size > 1:
            out = equalize_micro_batches(out, int(self._all_reduce(len(out), op="max")), self.pad_id)
        return out

    def _forward(self, batch: list[TrainRow]) -> dict[str, torch.Tensor]:
        """Per-token log-probs, entropy, loss mask, behaviour log-probs and advantages, from the first
        position not shared by the whole batch on (a shared prompt prefix runs once and has no loss)."""
        segments = [r.segment for r in batch]
        ids, attn, mask, behav, versions = pad_segments(segments, self.pad_id)
        # One rank only: under FSDP2 a second forward call before backward is not worth the risk.
        shared = shared_prefix_len(segments) if self.world_size == 1 else 0
        with torch.autocast(self.model.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            if shared:
                logits, suffix_ids, _ = suffix_logits(self.model, segments, self.pad_id, shared)
                lp, ent = logprobs_from_logits(
                    logits[:, :-1], suffix_ids[:, 1:], temperature=self.cfg.temperature
                )
                logp, entropy = F.pad(lp, (1, 0)), F.pad(ent, (1, 0))
            else:
                logp, entropy = token_logprobs(
                    self.model, ids, attn, temperature=self.cfg.temperature, entropy="detached"
                )
        mask, behav, versions = mask[:, shared:].float(), behav[:, shared:], versions[:, shared:]
        adv = torch.tensor([r.advantage for r in batch], dtype=torch.float32)[:, None].expand_as(behav)
        return {
            "logp": logp,
            "entropy": entropy,
            "mask": mask,
            "behav": behav,
            "adv": adv,
            "versions": versions,
            "replayed": torch.tensor([r.replayed for r in batch], dtype=torch.bool),
        }

    def train_step(self, rows: Sequence[TrainRow], step: int | None = None) -> dict[str, float]:
        """`minibatches` x `epochs` optimizer steps on `rows` (this rank's share; one by default).
        Returns loss and IS-health metrics over all the updates, always with the keys of
        `EMPTY_STEP_METRICS`. With no sampled token on any rank it changes nothing (weights,
        optimizer state, step and version stay) and returns those neutral values, `updates` 0."""
        start = time.monotonic()
        rows = [r for r in rows if r.segment.n_sampled > 0]
        self.group_stats = {}
        if not self._all_reduce(float(len(rows))):
            # No rank has a sampled token: an update would be all zero gradients, yet AdamW's momentum
            # and weight decay would still move the weights. Nothing is trained and the version stays.
            return {**EMPTY_STEP_METRICS, "train_s": time.monotonic() - start}
        plan = [self._micro_batches(mb) for mb in self._split_minibatches(rows)]
        updates = len(plan) * self.cfg.epochs
        # Later updates need the log-probs of the weights before the first one (prox); a single update
        # takes them from its own forward pass for free, unless the M2 threshold needs them first.
        m2 = self.cfg.loss.m2_tau > 0 and not self.cfg.behaviour_is_prox  # sync: w is 1, nothing to drop
        recompute = (updates > 1 and self.cfg.prox_logp == "recompute") or m2
        prox, sq_log_w = self._prox_logprobs(plan) if recompute else (None, [])
        # One M2 threshold per mini-batch, over its tokens on every rank (inf: nothing dropped).
        tau = self.cfg.loss.m2_tau
        thresholds = (
            [second_moment_threshold(all_gather(v), tau) for v in sq_log_w] if m2 else [math.inf] * len(plan)
        )
        first = True  # no optimizer step yet: theta is still prox
        # Sums over every update, micro-batch and (after the step) rank; divided at the end.
        totals: dict[str, float] = dict.fromkeys(("loss", "entropy", "n_valid", "n_mask"), 0.0)
        totals.update(dict.fromkeys(_VALID_STATS + _MASK_STATS, 0.0))
        w_max, grad_norms = 0.0, []
        gap: dict[str, float] = dict.fromkeys(("engine_kl_sum", "w_sum", "w_sq_sum", "n"), 0.0)
        gap_max = 0.0
        groups = GroupSums()
        self.model.train()
        for epoch in range(self.cfg.epochs):
            for k, micro_batches in enumerate(plan):
                # The mini-batch's denominator over every rank, before its first micro-batch: each
                # micro-batch's loss is then its exact share of the mini-batch's, however rows pack.
                row_tokens = [_loss_tokens(r) for batch in micro_batches for r in batch]
                denominator = self._all_reduce(loss_denominator(row_tokens, self.cfg.loss.agg))
                self.optimizer.zero_grad(set_to_none=True)
                for j, batch in enumerate(micro_batches):
                    t = self._forward(batch)
                    logp, entropy = t["logp"], t["entropy"]
                    exact = prox is not None or first  # prox_logp is the pre-update policy's own
                    if prox is not None:
                        prox_logp = prox[k][j]
                    elif first:
                        prox_logp = logp.detach()
                    else:
                        prox_logp = loglinear_prox(t["behav"], logp.detach(), t["versions"], self.version)
                    if exact and epoch == 0:  # each row once, exact prox only
                        g = engine_gap_stats(prox_logp, t["behav"], t["mask"])
                        for key in gap:
                            gap[key] += float(g[key])
                        gap_max = max(gap_max, float(g["engine_gap_max"]))
                        sums = row_sums(prox_logp, t["behav"], t["adv"], t["mask"], self.cfg.loss)
                        groups.add([r.group_id for r in batch], sums)
                    behav = t["behav"]
                    if self.cfg.behaviour_is_prox:  # older tokens: partial rollouts carried over a step
                        behav = torch.where(t["versions"] >= self.version, prox_logp, behav)
                    loss, stats = policy_loss(
                        logp,
                        prox_logp,
                        behav,
                        t["adv"],
                        t["mask"],
                        self.cfg.loss,
                        t["replayed"],
                        denominator,
                        thresholds[k],
                    )
                    # FSDP averages gradients over the ranks; the loss is already a share of the sum.
                    (loss * self.world_size).backward()
                    n_valid, n_mask = _sum_stat(stats, "n_tokens"), float(t["mask"].sum())
                    for key in _VALID_STATS:
                        totals[key] += _sum_stat(stats, key) * n_valid
                    for key in _MASK_STATS:
                        totals[key] += _sum_stat(stats, key) * n_mask
                    totals["loss"] += float(loss.detach())
                    totals["entropy"] += float((entropy * t["mask"]).sum())
                    totals["n_valid"] += n_valid
                    totals["n_mask"] += n_mask
                    w_max = max(w_max, _sum_stat(stats, "w_max"))
                grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
                grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
                if thresholds[k] == -math.inf:  # M2 dropped every token: no gradient, so no step
                    grad_norm = math.nan  # (AdamW's momentum and decay would still move the weights)
                if math.isfinite(grad_norm):
                    self.optimizer.step()
                    first = False
                grad_norms.append(grad_norm)
        self.optimizer.zero_grad(set_to_none=True)
        self.model.eval()
        self.step = step if step is not None else self.step + 1
        self.version += 1
        # A group trained by an update without exact prox (loglinear, later mini-batches) gets None:
        # the store forgets its previous use's figures rather than keep stale ones.
        self.group_stats = {**dict.fromkeys(r.group_id for r in rows if r.group_id), **groups.stats()}
        total = {k: self._all_reduce(v) for k, v in totals.items()}
        n_valid, n_mask = max(total.pop("n_valid"), 1.0), max(total.pop("n_mask"), 1.0)
        metrics = {key: total[key] / n_valid for key in _VALID_STATS}
        metrics.update({key: total[key] / n_mask for key in _MASK_STATS})
        finite = [g for g in grad_norms if math.isfinite(g)]
        new_tokens = sum(r.segment.n_sampled for r in rows if not r.replayed)
        metrics.update(
            loss=total["loss"] / len(grad_norms),  # the mean over updates of each mini-batch's loss
            entropy=total["entropy"] / n_mask,
            grad_norm=sum(finite) / len(finite) if finite else float("nan"),
            grad_skipped=float(len(grad_norms) - len(finite)),
            updates=float(len(grad_norms)),
            w_max=self._all_reduce(w_max, op="max"),
            trained_tokens=self._all_reduce(float(sum(r.segment.n_sampled for r in rows))),
            new_trained_tokens=self._all_reduce(float(new_tokens)),
            rows=self._all_reduce(float(len(rows))),
            train_s=time.monotonic() - start,
            **self._engine_gap_metrics(gap, gap_max),
        )
        return metrics

    def _engine_gap_metrics(self, sums: dict[str, float], gap_max: float) -> dict[str, float]:
        """The engine-vs-trainer log-prob gap and the ESS of the weights pi_prox / pi_engine
        (`losses.engine_gap_stats`), over every rank's tokens."""
        total = {k: self._all_reduce(v) for k, v in sums.items()}
        n = total["n"]
        ess = total["w_sum"] ** 2 / (n * total["w_sq_sum"]) if n and total["w_sq_sum"] > 0 else 1.0
        return {
            "engine_kl": total["engine_kl_sum"] / max(n, 1.0),
            "engine_gap_max": self._all_reduce(gap_max, op="max"),
            "is_ess": ess,
        }

    def _split_minibatches(self, rows: list[TrainRow]) -> list[list[TrainRow]]:
        """`cfg.minibatches` shuffled, near-equal shares of the rows (fewer when there are fewer rows;
        under FSDP every rank agrees on the count, since each update is a collective)."""
        n = min(self.cfg.minibatches, len(rows))
        if self.world_size > 1:
            t = torch.tensor([n], dtype=torch.int64)
            dist.all_reduce(t, op=dist.ReduceOp.MIN)
            n = int(t.item())
        if n <= 1:
            return [rows]
        order = list(rows)
        self.rng.shuffle(order)
        return [order[i::n] for i in range(n)]

    @torch.no_grad()
    def _prox_logprobs(
        self, plan: list[list[list[TrainRow]]]
    ) -> tuple[list[list[torch.Tensor]], list[torch.Tensor]]:
        """Log-probs of the current weights for every micro-batch of the plan, before any update, and
        the (log w)^2 of each mini-batch's loss-mask tokens under them (for the M2 threshold)."""
        self.model.eval()
        prox, sq_log_w = [], []
        for micro in plan:
            forwards = [self._forward(batch) for batch in micro]
            prox.append([t["logp"].detach() for t in forwards])
            sq_log_w.append(torch.cat([sq_log_weights(t["logp"], t["behav"], t["mask"]) for t in forwards]))
        return prox, sq_log_w

    def _all_reduce(self, value: float, op: str = "sum") -> float:
        if self.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
        return float(t.item())

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded CPU weights for the engines (collective under FSDP: call on every rank); under
        LoRA the adapters alone (the base never changes: every engine has it)."""
        if self.world_size > 1:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            lora = self.lora is not None
            options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=lora)
            state = get_model_state_dict(self.model, options=options)
            return {k: v for k, v in state.items() if is_adapter(k)} if lora else state
        if self.lora is not None:
            return adapter_state_dict(self.model)
        return {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}

    def optimizer_state(self) -> dict[str, Any]:
        """The full AdamW state keyed by parameter name, whatever the world size, so that a state saved
        by a group of one size loads into a group of another (an elastic role change, a resume with
        another `train` slot count). Collective under FSDP: call on every rank."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=self.world_size > 1)
        return get_optimizer_state_dict(self.model, self.optimizer, options=options)

    def load_state(self, model_state: dict[str, Any], optim_state: dict[str, Any]) -> None:
        """Load full weights and an optimizer state from `optimizer_state` (every rank gets the full
        state). An older single-rank checkpoint keyed the optimizer state by parameter index: that
        still loads on one rank."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        lora = self.lora is not None
        if lora:  # the adapters alone: the base is the trainer's own
            check_adapters(self.model, model_state)
        options = StateDictOptions(full_state_dict=True, strict=not lora)
        if self.world_size > 1:
            set_model_state_dict(self.model, model_state, options=options)
        else:
            self.model.load_state_dict(model_state, strict=not lora)
        by_index = any(isinstance(k, int) for k in optim_state.get("state", {}))
        if by_index and self.world_size == 1:
            self.optimizer.load_state_dict(optim_state)
        else:
            set_optimizer_state_dict(self.model, self.optimizer, optim_state, options=options)
