"""Supervised fine-tuning on token rows with a loss mask (warm-start before RL).

A row is a rollout `Segment`: the loss covers only tokens with mask 1 (what the policy said), so the
model learns to act, not to predict the env's replies. Rows are packed into micro-batches by a token
budget; long runs stop on a wall-clock budget as well as on a step count.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from reflow.records import Segment
from reflow.train.prefix import shared_prefix_len, suffix_logits

RECIPE_VERSION = 2
"""Bump when `sft_train`'s numerics change (2: fp32 on CPU), so that cached warm starts are retrained."""


@dataclass
class SFTConfig:
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.01
    max_steps: int = 400
    """The step budget; the learning rate's cosine decay runs over it."""
    max_seconds: float = 240.0
    """A time cap: training stops after the step during which it ran out (the schedule ignores it)."""
    batch_tokens: int = 4096
    grad_clip: float = 1.0
    seed: int = 0
    log_every: int = 20
    bf16: bool | None = None
    """Autocast matmuls to bfloat16 (None: on GPU only). On CPU the engines decode in fp32, and for the
    tiny model bf16 was no faster even with AMX (docs/results.md, "... SFT in fp32 on CPU")."""
    patience: int = 0
    """Early stopping on the `evaluate` callback's `success_rate` (a dev set): stop once this many
    evaluations in a row found no better one, and end with the best evaluated weights (the final
    ones are evaluated too). 0: train to the step or time budget."""


def use_bf16(device: torch.device, setting: bool | None) -> bool:
    """Whether to autocast to bfloat16: `setting`, or when None, on GPU only (the engines decode in
    fp32 on CPU, and there bf16 was no faster for the tiny model; the RL trainer follows the same rule)."""
    return device.type == "cuda" if setting is None else setting


@dataclass
class SFTReport:
    steps: int = 0
    seconds: float = 0.0
    tokens: int = 0
    losses: list[float] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)
    best_step: int | None = None
    """With `patience`: the step whose weights the model ends with."""
    stopped_early: bool = False


def pack_batches(
    rows: Sequence[Segment], batch_tokens: int, rng: random.Random, shared: int = 0
) -> list[list[Segment]]:
    """Group rows of similar length (little padding) so that the padded tokens of a batch stay within
    `batch_tokens`, counting a `shared` prefix once per batch; the batch order is shuffled."""
    order = sorted(rows, key=lambda r: (len(r.token_ids), rng.random()))
    batches: list[list[Segment]] = []
    current: list[Segment] = []
    for row in order:  # ascending length: the row being added is the longest so far
        if current and shared + (len(row.token_ids) - shared) * (len(current) + 1) > batch_tokens:
            batches.append(current)
            current = []
        current.append(row)
    if current:
        batches.append(current)
    rng.shuffle(batches)
    return batches


def masked_nll(model: torch.nn.Module, batch: list[Segment], pad_id: int) -> tuple[torch.Tensor, int]:
    """Mean next-token loss over the tokens with mask 1, and how many there were (a shared prefix of
    the batch runs once: `reflow.train.prefix`)."""
    logits, ids, mask = suffix_logits(model, batch, pad_id, shared_prefix_len(batch))
    targets, target_mask = ids[:, 1:], mask[:, 1:]
    loss = F.cross_entropy(logits[:, :-1].float()[target_mask], targets[target_mask])
    return loss, int(target_mask.sum())


def sft_train(
    model: torch.nn.Module,
    rows: Sequence[Segment],
    pad_id: int,
    config: SFTConfig | None = None,
    evaluate: Callable[[int], dict[str, Any]] | None = None,
    eval_every: int = 0,
    log: Callable[[str], None] = print,
) -> SFTReport:
    """Train in place; stops at `max_steps`, or after the step during which `max_seconds` ran out."""
    cfg = config or SFTConfig()
    rows = [r for r in rows if r.n_sampled > 0]
    if not rows:
        raise ValueError("no rows with sampled (mask 1) tokens to train on")
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
    )

    def lr_at(step: int) -> float:
        if step < cfg.warmup_steps:
            return cfg.lr * (step + 1) / cfg.warmup_steps
        # Cosine decay over the step budget alone, never the clock: with the elapsed share of
        # `max_seconds` in it, the seconds' share leads for a few steps right after warm-up (how many
        # depends on the machine's speed), so two runs of one seed and step budget ended with different
        # weights on a loaded and an idle machine. A run its time cap stops warns instead.
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps))
        return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))

    device = next(model.parameters()).device
    bf16 = use_bf16(device, cfg.bf16)
    report = SFTReport()
    start = time.monotonic()
    model.train()
    batches: list[list[Segment]] = []
    stopper = _EarlyStop(model) if evaluate and cfg.patience else None

    def run_eval() -> None:
        model.eval()
        point = {"step": report.steps, **evaluate(report.steps)}
        report.evals.append(point)
        model.train()
        if stopper is not None:
            stopper.observe(report.steps, float(point["success_rate"]))

    # The time cap is checked after each step, so a cap always lets the first step through: how many
    # steps a tiny cap gives does not depend on how long the set-up above took on a loaded machine.
    while report.steps < cfg.max_steps:
        if not batches:
            batches = pack_batches(rows, cfg.batch_tokens, rng, shared_prefix_len(rows))
        batch = batches.pop()
        for group in opt.param_groups:
            group["lr"] = lr_at(report.steps)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            loss, n_tokens = masked_nll(model, batch, pad_id)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        report.steps += 1
        report.tokens += n_tokens
        report.losses.append(loss.item())
        if cfg.log_every and report.steps % cfg.log_every == 0:
            recent = report.losses[-cfg.log_every :]
            log(
                f"step {report.steps}: loss {sum(recent) / len(recent):.4f} ({time.monotonic() - start:.0f}s)"
            )
        if evaluate and eval_every and report.steps % eval_every == 0:
            run_eval()
            if stopper is not None and stopper.stale >= cfg.patience:
                report.stopped_early = report.steps < cfg.max_steps
                break
        if time.monotonic() - start >= cfg.max_seconds:
            break
    if stopper is not None:
        if not report.evals or report.evals[-1]["step"] != report.steps:
            run_eval()  # the final weights compete too
        report.best_step = stopper.restore()
    model.eval()
    report.seconds = time.monotonic() - start
    return report


class _EarlyStop:
    """The best evaluated weights so far (a CPU copy) and how many evaluations since they were."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.best: tuple[float, int, dict[str, torch.Tensor]] | None = None
        self.stale = 0

    def observe(self, step: int, score: float) -> None:
        if self.best is None or score > self.best[0]:
            state = {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}
            self.best, self.stale = (score, step, state), 0
        else:
            self.stale += 1

    def restore(self) -> int | None:
        """Load the best weights back; returns their step."""
        if self.best is None:
            return None
        self.model.load_state_dict(self.best[2])
        return self.best[1]
