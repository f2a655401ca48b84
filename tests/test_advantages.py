"""GRPO advantages, the infra-error training mask and the zero-spread test of a group, on hand values."""

import math

import pytest

from reflow.train.advantages import (
    group_advantages,
    has_spread,
    train_mask,
    valid_for_training,
)

EPS = 1e-6


def test_std_scaled_advantages_by_hand():
    # mean 0.5, population std 0.5
    adv = group_advantages([1.0, 0.0, 0.0, 1.0])
    scale = 0.5 / (0.5 + EPS)
    assert adv == pytest.approx([scale, -scale, -scale, scale], abs=1e-12)

    # mean 2, population std sqrt(2/3) (not the sample std sqrt(1))
    adv = group_advantages([1.0, 2.0, 3.0])
    std = math.sqrt(2 / 3)
    assert adv == pytest.approx([-1 / (std + EPS), 0.0, 1 / (std + EPS)], abs=1e-12)
    assert sum(adv) == pytest.approx(0.0, abs=1e-12)


def test_unscaled_advantages_and_custom_eps():
    assert group_advantages([1.0, 2.0, 3.0], scale="none") == pytest.approx([-1.0, 0.0, 1.0])
    assert group_advantages([0.0, 4.0], eps=1.0) == pytest.approx([-2 / 3, 2 / 3])
    with pytest.raises(ValueError):
        group_advantages([0.0, 1.0], scale="minmax")  # type: ignore[arg-type]


def test_zero_spread_groups_get_exact_zeros():
    # 0.1 * 3 / 3 is not exactly 0.1 in floats: without the spread check this would be noise / eps.
    assert group_advantages([0.1, 0.1, 0.1]) == [0.0, 0.0, 0.0]
    assert group_advantages([1.0]) == [0.0]
    assert group_advantages([]) == []
    assert not has_spread([0.1, 0.1, 0.1])
    assert not has_spread([1.0])
    assert not has_spread([1.0, 1.0 + 1e-12])
    assert has_spread([0.0, 0.0, 1.0])


def test_train_mask_masks_only_infra_errors():
    statuses = ["ok", "truncated", "timeout", "env_error", "infra_error"]
    assert train_mask(statuses) == [True, True, True, True, False]
    assert valid_for_training("ok") and not valid_for_training("infra_error")


def test_infra_error_episodes_are_excluded_from_stats_and_get_zero():
    rewards = [1.0, 0.0, 5.0, 0.0]
    mask = train_mask(["ok", "ok", "infra_error", "ok"])
    adv = group_advantages(rewards, mask=mask)
    # Stats over [1, 0, 0] only: mean 1/3, std sqrt(2/9). The infra_error reward 5.0 never counts.
    mean, std = 1 / 3, math.sqrt(2 / 9)
    expected = [(1 - mean) / (std + EPS), (0 - mean) / (std + EPS), 0.0, (0 - mean) / (std + EPS)]
    assert adv == pytest.approx(expected, abs=1e-12)
    assert adv[2] == 0.0
    assert group_advantages(rewards, mask=mask, scale="none") == pytest.approx([2 / 3, -1 / 3, 0.0, -1 / 3])


def test_masking_can_remove_the_spread():
    # Only the infra_error episode differs: no signal left.
    rewards, mask = [1.0, 0.0, 1.0], [True, False, True]
    assert not has_spread(rewards, mask=mask)
    assert group_advantages(rewards, mask=mask) == [0.0, 0.0, 0.0]
    # One valid episode is nothing to compare with.
    assert group_advantages([1.0, 0.0], mask=[True, False]) == [0.0, 0.0]
    with pytest.raises(ValueError):
        group_advantages([1.0, 0.0], mask=[True])


def test_zero_spread_groups_are_told_apart_with_their_masks():
    # What a rollout worker reports per group (`has_spread`) and the step log's zero-spread share count.
    groups = [[1.0, 0.0], [1.0, 1.0], [0.0, 0.0, 0.0], [1.0, 0.0, 1.0]]
    assert [has_spread(g) for g in groups] == [True, False, False, True]

    # The last group's only differing episode is an infra error: it joins the zero-spread groups.
    masks = [None, None, None, [True, False, True]]
    assert [has_spread(g, mask=m) for g, m in zip(groups, masks, strict=True)] == [True, False, False, False]
