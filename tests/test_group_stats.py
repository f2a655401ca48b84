"""The per-group importance-weight statistics a train step writes back for replay selection: by hand on
a made-up batch, and from a real (tiny) model's train step."""

import math
import random

import pytest
import torch
from engine_helpers import small_qwen3

from reflow.records import Segment
from reflow.train.group_stats import GroupSums, row_sums
from reflow.train.settings import LossConfig
from reflow.train.trainer import PolicyTrainer, TrainerConfig, TrainRow


def test_row_sums_and_group_statistics_by_hand():
    # log w = prox - engine per token; row 0: w = 1, 2, e^-1 (A > 0); row 1: w = 0.5, 1 (A < 0), one pad
    prox = torch.tensor([[0.0, math.log(2.0), -1.0], [math.log(0.5), 0.0, 9.0]])
    engine = torch.zeros(2, 3)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    sums = row_sums(
        prox, engine, torch.tensor([1.0, -1.0]), mask, LossConfig(clip_eps=0.2, clip_eps_high=0.28)
    )
    e1 = math.exp(-1.0)
    assert sums["w_sum"].tolist() == pytest.approx([3.0 + e1, 1.5])
    assert sums["w_sq_sum"].tolist() == pytest.approx([5.0 + e1 * e1, 1.25])
    assert sums["clipped"].tolist() == [1.0, 1.0]  # w = 2 > 1.28 with A > 0; w = 0.5 < 0.8 with A < 0
    k3 = lambda w: w - 1 - math.log(w)  # noqa: E731
    assert sums["kl_sum"].tolist() == pytest.approx([k3(2.0) + k3(e1), k3(0.5)])
    assert sums["n"].tolist() == [3.0, 2.0]

    groups = GroupSums()
    groups.add(["a", "b"], sums)
    groups.add(["a", ""], sums)  # a second micro-batch with more of "a"; padding is left out
    stats = groups.stats()
    assert set(stats) == {"a", "b"}
    a = stats["a"]
    assert a.ess == pytest.approx((2 * (3 + e1)) ** 2 / (6 * 2 * (5 + e1 * e1)))
    assert a.clip_frac == pytest.approx(2 / 6) and a.kl_behav == pytest.approx((k3(2.0) + k3(e1)) / 3)
    assert stats["b"].ess == pytest.approx(1.5**2 / (2 * 1.25)) and stats["b"].clip_frac == 0.5


def _rows(gid, logprob, n=3, seed=0):
    rng = random.Random(seed)
    rows = []
    for adv in [1.0, -1.0, 1.0][:n]:
        seg = Segment(0)
        seg.extend_prompt([rng.randrange(1, 64) for _ in range(4)])
        k = rng.randint(3, 6)
        seg.extend_sampled([rng.randrange(1, 64) for _ in range(k)], [logprob] * k, [0] * k)
        rows.append(TrainRow(seg, adv, gid))
    return rows


def test_a_train_step_reports_each_groups_statistics_on_its_own_tokens():
    """Two groups in one batch: "near" recorded log-probs close to the tiny model's (log 1/64), "far"
    ones the model finds far less likely to have sampled: far's ESS is lower and its KL higher."""
    model = small_qwen3(vocab_size=64, seed=0, tie_word_embeddings=True)
    trainer = PolicyTrainer(
        model, 0, TrainerConfig(bf16=False, micro_batch_tokens=24)
    )  # several micro-batches
    rows = _rows("near", -4.16) + _rows("far", -1.0, seed=1) + _rows("far", -9.0, seed=2)
    trainer.train_step(rows)
    stats = trainer.group_stats
    assert set(stats) == {"near", "far"}
    near, far = stats["near"], stats["far"]
    assert near.ess > 0.9 and near.kl_behav < 0.05
    assert far.ess < near.ess and far.kl_behav > near.kl_behav + 0.5
    assert 0.0 <= near.clip_frac <= far.clip_frac <= 1.0
    assert trainer.train_step([]) and trainer.group_stats == {}  # an empty step measures nothing


def test_a_weight_past_float_range_reads_as_the_worst_case_not_as_unmeasured(tmp_path):
    from reflow.replay import ReplayStore

    prox = torch.tensor([[0.0, 0.0]])
    engine = torch.tensor([[0.0, -float("inf")]])  # w = inf on the second token
    groups = GroupSums()
    groups.add(["g"], row_sums(prox, engine, torch.tensor([1.0]), torch.ones(1, 2), LossConfig()))
    use = groups.stats()["g"]
    assert use.ess == 0.0 and use.kl_behav == math.inf  # not NaN: the store would keep NULL
    with ReplayStore(tmp_path / "r.sqlite", "r") as store:
        from replay_helpers import make_group

        store.add_group(*make_group("g", [0.0, 1.0], version=0, n_turns=1, tokens=2))
        store.set_use_stats({"g": use}, step=1)
        assert store.fresh()[0].last_use.ess == 0.0 and store.fresh()[0].last_use.kl_behav == math.inf


def test_groups_trained_without_exact_prox_are_reported_unmeasured():
    """loglinear prox with two mini-batches: the second mini-batch's prox is approximate, so its
    groups come back as None (the store then forgets their previous use's figures)."""
    model = small_qwen3(vocab_size=64, seed=0, tie_word_embeddings=True)
    cfg = TrainerConfig(bf16=False, minibatches=2, prox_logp="loglinear")
    trainer = PolicyTrainer(model, 0, cfg)
    rows = [r for i in range(4) for r in _rows(f"g{i}", -4.16, n=1, seed=i)]
    trainer.train_step(rows)
    stats = trainer.group_stats
    assert set(stats) == {"g0", "g1", "g2", "g3"}
    assert sum(s is None for s in stats.values()) == 2  # one row per group, two rows per mini-batch


def test_an_unmeasured_use_clears_the_previous_figures(tmp_path):
    from replay_helpers import make_group

    from reflow.replay import ReplayStore, UseStats

    with ReplayStore(tmp_path / "r.sqlite", "r") as store:
        store.add_group(*make_group("g", [0.0, 1.0], version=0, n_turns=1, tokens=2))
        store.set_use_stats({"g": UseStats(0.9, 0.0, 0.0)}, step=1)
        store.set_use_stats({"g": None}, step=2)
        assert store.fresh()[0].last_use is None
