"""The M2 second-moment trust region on the behaviour weights: the threshold by hand, the loss's
masking, and one threshold per mini-batch in the trainer whatever the packing."""

import math
import random

import pytest
import torch
from test_trainer import _capped_rows, _capture_grads, _config, _model, _rows

from reflow.records import Segment
from reflow.train.losses import LossConfig, policy_loss, second_moment_threshold, sq_log_weights
from reflow.train.trainer import PolicyTrainer, TrainerConfig, TrainRow


def _threshold(values, tau):
    return second_moment_threshold(torch.tensor(values, dtype=torch.float32), tau)


def test_the_threshold_keeps_the_smallest_values_whose_mean_fits_by_hand():
    values = [0.01, 0.02, 0.5, 2.0]  # means of the k smallest: 0.01, 0.015, 0.177, 0.633
    t = _threshold(values, 0.1)
    assert t == pytest.approx(0.02)
    assert (torch.tensor(values) <= t).tolist() == [True, True, False, False]
    assert _threshold(values, 0.2) == pytest.approx(0.5)  # 0.177 fits under 0.2
    assert _threshold([2.0, 0.5, 0.02, 0.01], 0.1) == t  # values, not positions: any order
    # ties are kept or dropped together: with one 0.25 the mean would be 0.156, with both 0.1875
    assert _threshold([0.0625, 0.25, 0.25, 4.0], 0.17) == 0.0625
    assert _threshold([0.0625, 0.25, 0.25, 4.0], 0.1875) == 0.25  # both fit exactly
    assert _threshold([0.125, 0.125, 0.125, 1.0], 0.125) == 0.125


def test_the_threshold_edge_cases():
    assert _threshold([0.01, 0.02, 0.5], 1.0) == math.inf  # the overall mean already fits: all kept
    assert _threshold([0.5], 0.5) == math.inf
    assert _threshold([0.5, 0.7], 0.1) == -math.inf  # even the smallest exceeds tau: none kept
    assert _threshold([], 0.1) == math.inf  # no token, nothing to drop
    assert _threshold([0.0, 0.0, 3.0], 0.0) == 0.0  # tau 0 keeps the exact weights only


def _batch():
    """Two rows of four positions, seven mask tokens; log w per token (prox - behav):
    row 0: 0.1, -0.1, 1.0, 0.0; row 1: 0.2, (padding), -2.0, 0.05. A = +1, -1 per row, u = 1."""
    log_w = torch.tensor([[0.1, -0.1, 1.0, 0.0], [0.2, 0.0, -2.0, 0.05]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 1, 1]], dtype=torch.bool)
    prox = torch.full((2, 4), -1.0)
    logp = prox.clone().requires_grad_(True)
    return logp, prox, prox - log_w, torch.tensor([1.0, -1.0]), mask


@pytest.mark.parametrize("kind", ["decoupled_ppo", "tis"])
def test_the_loss_drops_the_tokens_above_the_threshold_like_capped_ones(kind):
    # (log w)^2 of the mask tokens: 0.01 0.01 1 0 | 0.04 4 0.0025. Sorted, the means of the k smallest
    # are 0, 0.00125, 0.0042, 0.0056, 0.0125, 0.177, 0.72: tau 0.1 keeps five, drops 1 and 4.
    logp, prox, behav, adv, mask = _batch()
    assert sorted(sq_log_weights(prox, behav, mask).tolist()) == pytest.approx(
        [0.0, 0.0025, 0.01, 0.01, 0.04, 1.0, 4.0], abs=1e-6
    )
    dropped = torch.tensor([[0, 0, 1, 0], [0, 0, 1, 0]], dtype=torch.bool)
    off, off_stats = policy_loss(logp, prox, behav, adv, mask, LossConfig(kind=kind))
    (g_off,) = torch.autograd.grad(off, logp)
    for threshold in (None, second_moment_threshold(sq_log_weights(prox, behav, mask), 0.1)):
        on, stats = policy_loss(
            logp, prox, behav, adv, mask, LossConfig(kind=kind, m2_tau=0.1), m2_threshold=threshold
        )
        (g_on,) = torch.autograd.grad(on, logp)
        assert (g_on[dropped] == 0).all() and (g_on[mask & ~dropped] != 0).all()
        # the denominator is unchanged (all seven mask tokens): the kept tokens weigh as before
        assert torch.equal(g_on[mask & ~dropped], g_off[mask & ~dropped])
        kept_terms = sum(
            -a * math.exp(lw) for a, lw in [(1, 0.1), (1, -0.1), (1, 0.0), (-1, 0.2), (-1, 0.05)]
        )
        assert on.item() == pytest.approx(kept_terms / 7, rel=1e-6)
        assert stats["m2_masked_frac"].item() == pytest.approx(2 / 7)
        assert stats["masked_frac"].item() == 0.0 == off_stats["masked_frac"].item()  # w <= e: not capped
        assert stats["n_tokens"].item() == 5
    assert off_stats["m2_masked_frac"].item() == 0.0
    # a threshold given from a larger mini-batch wins over this batch's own: +inf drops nothing
    same, stats = policy_loss(
        logp, prox, behav, adv, mask, LossConfig(kind=kind, m2_tau=0.1), m2_threshold=math.inf
    )
    assert same.item() == off.item() and stats["m2_masked_frac"].item() == 0.0


def test_the_setting_is_checked():
    for bad in (-0.1, math.nan, math.inf):
        with pytest.raises(ValueError, match="m2_tau"):
            LossConfig(m2_tau=bad)
    with pytest.raises(ValueError, match="m2_tau"):  # the threshold needs the exact prox
        TrainerConfig(loss=LossConfig(m2_tau=0.1), prox_logp="loglinear")


def test_the_trainer_takes_one_threshold_per_mini_batch_whatever_the_micro_batches():
    rows = _capped_rows(moderate=True)
    runs = []
    for micro in (1 << 20, 1):  # one micro-batch, one per row
        trainer = PolicyTrainer(_model(), 0, _config(micro, rows="m2"))
        grads = _capture_grads(trainer)
        metrics = trainer.train_step(rows)
        assert len(trainer._micro_batches(rows)) == (1 if micro > 1 else len(rows))
        runs.append((grads, metrics))
    (ref_grads, ref), (grads, metrics) = runs
    # the M2 threshold drops tokens the cap keeps, and not every token
    assert ref["masked_frac"] < ref["m2_masked_frac"] < 0.95
    diff = max(float((grads[k] - ref_grads[k]).abs().max()) for k in ref_grads)
    assert diff <= 1e-6
    assert metrics["m2_masked_frac"] == pytest.approx(ref["m2_masked_frac"], abs=1e-6)
    assert metrics["loss"] == pytest.approx(ref["loss"], abs=1e-6)


def _row(behav_logprob: float, advantage: float, seed: int) -> TrainRow:
    rng = random.Random(seed)
    seg = Segment(0)
    seg.extend_prompt([rng.randrange(1, 64) for _ in range(4)])
    seg.extend_sampled([rng.randrange(1, 64) for _ in range(5)], [behav_logprob] * 5, [0] * 5)
    return TrainRow(seg, advantage)


def test_a_row_of_large_log_weights_leaves_the_update_as_if_it_had_no_advantage():
    # behaviour log-probs -4.2 are near the tiny model's (~ log 1/64): (log w)^2 0.41 at most, 0.03 on
    # average; -5.5 gives w ~ e^1.2 ~ 3.4, under the cap 5, but (log w)^2 >= 1.4: with tau 0.05 the M2
    # threshold drops that whole row, which then adds 0 and stays in the denominator, as a row with
    # advantage 0 does.
    rows = [_row(-4.2, a, seed) for seed, a in enumerate([1.0, -1.0, 0.5, -0.5])]
    far = _row(-5.5, 1.0, seed=9)

    def step(m2_tau: float, far_advantage: float) -> tuple[dict, dict]:
        config = TrainerConfig(lr=1e-2, bf16=False, behaviour_is_prox=False, loss=LossConfig(m2_tau=m2_tau))
        trainer = PolicyTrainer(_model(), 0, config)
        grads = _capture_grads(trainer)
        return grads, trainer.train_step([*rows, TrainRow(far.segment, far_advantage)])

    on_grads, on = step(0.05, 1.0)
    off_grads, off = step(0.0, 1.0)
    zero_grads, _ = step(0.0, 0.0)
    assert on["m2_masked_frac"] == pytest.approx(5 / 25) and on["masked_frac"] == 0.0
    assert off["m2_masked_frac"] == 0.0 == off["masked_frac"]
    for name, grad in on_grads.items():
        assert torch.allclose(grad, zero_grads[name], atol=1e-6), name
    assert any(not torch.allclose(off_grads[k], zero_grads[k], atol=1e-4) for k in off_grads)


def test_sync_mode_spends_no_extra_forward_and_drops_nothing(monkeypatch):
    calls = []
    real = PolicyTrainer._prox_logprobs

    def counted(self, plan):
        calls.append(len(plan))
        return real(self, plan)

    monkeypatch.setattr(PolicyTrainer, "_prox_logprobs", counted)
    m2 = LossConfig(m2_tau=0.01)
    sync = PolicyTrainer(_model(), 0, TrainerConfig(lr=1e-2, bf16=False, loss=m2))
    assert sync.train_step(_rows())["m2_masked_frac"] == 0.0  # w is 1 exactly
    assert calls == []
    stale = PolicyTrainer(_model(), 0, TrainerConfig(lr=1e-2, bf16=False, behaviour_is_prox=False, loss=m2))
    stale.train_step(_rows())  # one update: the prox forward is spent for the threshold
    assert calls == [1]


def test_a_mini_batch_the_rule_drops_entirely_takes_no_optimizer_step():
    """Every token far off (tau below the smallest (log w)^2): no gradient, and no AdamW step either,
    whose weight decay would still move the weights."""
    config = TrainerConfig(
        lr=1e-2, weight_decay=0.1, bf16=False, behaviour_is_prox=False, loss=LossConfig(m2_tau=1e-3)
    )
    trainer = PolicyTrainer(_model(), 0, config)
    before = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    m = trainer.train_step([_row(-9.0, a, seed) for seed, a in enumerate([1.0, -1.0])])
    assert m["m2_masked_frac"] == 1.0 and m["grad_skipped"] == 1.0
    assert all(torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())


def test_truncation_counts_only_the_tokens_the_rule_kept():
    # one row, two tokens: w = e^2 (over the TIS cap 2, and (log w)^2 = 4 over the threshold) and w = 1
    logp = torch.zeros(1, 2, requires_grad=True)
    prox, behav = torch.zeros(1, 2), torch.tensor([[-2.0, 0.0]])
    _, stats = policy_loss(
        logp, prox, behav, torch.ones(1), torch.ones(1, 2), LossConfig(kind="tis"), m2_threshold=1.0
    )
    assert stats["m2_masked_frac"].item() == 0.5 and stats["trunc_frac"].item() == 0.0
