"""The elastic policy as arithmetic: given these rates, idle ratios and costs, this split."""

from dataclasses import replace

import pytest

from reflow.policy.elastic import (
    ElasticConfig,
    ElasticObservation,
    ElasticPolicy,
    RoleChangeCost,
    reuse_from_share,
    step_seconds,
    throughput,
)

COST_4S = RoleChangeCost(actor_start_s=1.0, weight_load_s=2.0, group_reform_s=1.0)


def obs(**kw) -> ElasticObservation:
    # rollout 2 slots x 1.0 samples/s, trainer 2 slots x 3.0 samples/s, 6 samples per step:
    # T(2, 2) = min(2 x 1.0, 2 x 3.0) = 2 samples/s -> 3 s per step; T(3, 1) = min(3, 3) = 3 -> 2 s per step.
    base = dict(
        step=20,
        version=20,
        steps_since_change=20,
        rollout_slots=2,
        train_slots=2,
        rollout_rate=1.0,
        train_rate=3.0,
        batch_size=6.0,
        rollout_idle=0.0,
        train_idle=0.4,
        to_rollout_cost=COST_4S,
        to_train_cost=COST_4S,
    )
    return ElasticObservation(**{**base, **kw})


def policy(**kw) -> ElasticPolicy:
    return ElasticPolicy(ElasticConfig(**{"horizon_steps": 10, "margin": 2.0, "min_dwell_steps": 5, **kw}))


def test_the_model_is_min_of_supply_times_reuse_and_trainer_capacity():
    o = obs()
    assert throughput(o, 2, 2) == 2.0 and throughput(o, 3, 1) == 3.0 and throughput(o, 1, 3) == 1.0
    assert step_seconds(o, 2, 2) == 3.0 and step_seconds(o, 3, 1) == 2.0
    assert step_seconds(replace(o, rollout_rate=0.0), 2, 2) == float("inf")
    assert reuse_from_share(0.5) == 2.0 and reuse_from_share(0.0) == 1.0
    assert throughput(replace(o, reuse=2.0), 2, 2) == 4.0  # replay doubles what rollout supplies


def test_moves_a_train_slot_to_rollout_when_the_gain_beats_cost_times_margin():
    d = policy().decide(obs())
    # gain = 10 steps x (3 s - 2 s) = 10 s > 4 s x margin 2 = 8 s
    assert (d.action, d.rollout_slots, d.train_slots) == ("to_rollout", 3, 1)
    assert d.gain_s == pytest.approx(10.0) and d.cost_s == 4.0
    assert (d.throughput_now, d.throughput_target) == (2.0, 3.0)
    assert "gain 10 s over 10 steps" in d.reason and "cost 4 s x margin 2 = 8 s" in d.reason


def test_holds_when_the_cost_is_too_high():
    d = policy(margin=3.0).decide(obs())  # 10 s < 4 s x 3 = 12 s
    assert not d.moves and (d.rollout_slots, d.train_slots) == (2, 2)
    assert d.gain_s == pytest.approx(10.0) and "not worth it" in d.reason
    slow = RoleChangeCost(actor_start_s=3.0, weight_load_s=2.0)  # 5 s x 2 = 10 s, not > 10 s
    assert not policy().decide(obs(to_rollout_cost=slow)).moves


def test_moves_a_rollout_slot_to_training_the_other_way():
    # rollout 3 x 2.0 = 6/s supplies more than trainer 1 x 2.0 = 2/s; (2, 2) gives min(4, 4) = 4/s.
    # 8 samples per step: 4 s -> 2 s, gain 20 s over 10 steps > 4 s x 2.
    o = obs(rollout_slots=3, train_slots=1, rollout_rate=2.0, train_rate=2.0, batch_size=8.0)
    o = replace(o, rollout_idle=0.5, train_idle=0.0)
    d = policy().decide(o)
    assert (d.action, d.rollout_slots, d.train_slots, d.gain_s) == ("to_train", 2, 2, 20.0)


def test_replay_reuse_can_make_the_move_unnecessary():
    # reuse 1.5: T(2, 2) = min(2 x 1.0 x 1.5, 6) = 3 = T(3, 1) = min(4.5, 3): nothing to gain.
    d = policy().decide(obs(reuse=1.5))
    assert not d.moves and "best the model sees" in d.reason


def test_holds_until_the_minimum_dwell_is_reached():
    p = policy()
    d = p.decide(obs(steps_since_change=4))
    assert not d.moves and "dwell: 4 of 5 steps" in d.reason
    assert d.gain_s == pytest.approx(10.0)  # what the move would have bought is still reported
    assert p.decide(obs(steps_since_change=5, version=21)).moves


def test_never_moves_twice_in_one_version():
    p = policy()
    assert p.decide(obs(version=7)).moves
    # Asked again at the same boundary (even with the split not applied yet): hold.
    again = p.decide(obs(version=7))
    assert not again.moves and "already moved a slot at version 7" in again.reason
    assert p.decide(obs(version=8)).moves
    with pytest.raises(ValueError, match="went backwards"):
        p.decide(obs(version=6))


def test_never_goes_below_the_minimum_slots():
    # 1 + 1 slots: the only split allowed is the current one, however starved rollout is.
    assert not policy().decide(obs(rollout_slots=1, train_slots=1)).moves
    # min_train 2 with 2 + 2: rollout may not take a train slot.
    d = policy(min_train=2).decide(obs())
    assert not d.moves and d.train_slots == 2
    with pytest.raises(ValueError, match="below the minimums"):
        policy(min_rollout=3).decide(obs())


def test_idle_ratios_that_contradict_the_model_hold_the_split():
    # The model says rollout is the bottleneck, but rollout idles more than the trainer does.
    d = policy().decide(obs(rollout_idle=0.3, train_idle=0.1))
    assert not d.moves and "idle ratios disagree" in d.reason


def test_before_any_measurement_the_initial_cost_is_assumed_and_no_rate_means_hold():
    d = policy(initial_change_cost_s=6.0).decide(obs(to_rollout_cost=None))  # 10 s < 6 s x 2
    assert not d.moves and d.cost_s == 6.0 and "assumed cost 6 s" in d.reason
    assert policy(initial_change_cost_s=4.0).decide(obs(to_rollout_cost=None)).moves
    assert "no rate measured" in policy().decide(obs(train_rate=0.0)).reason


def test_repeated_decisions_walk_one_slot_at_a_time_to_the_best_split_and_stay():
    # 8 slots, r = t = 1 sample/s: T(n, 8 - n) = min(n, 8 - n) peaks at n = 4.
    p = policy(min_dwell_steps=2, margin=1.0)
    n, since, path = 1, 10, []
    for version in range(30):
        o = obs(
            version=version,
            step=version,
            steps_since_change=since,
            rollout_slots=n,
            train_slots=8 - n,
            rollout_rate=1.0,
            train_rate=1.0,
            batch_size=8.0,
            to_rollout_cost=RoleChangeCost(actor_start_s=1.0),
        )
        d = p.decide(o)
        since = 1 if d.moves else since + 1
        if d.moves:
            assert abs(d.rollout_slots - n) == 1 and d.rollout_slots + d.train_slots == 8
            path.append(d.rollout_slots)
        n = d.rollout_slots
    assert path == [2, 3, 4] and n == 4


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(reuse=0.5), "reuse"),
        (dict(train_idle=1.5), "ratio"),
        (dict(rollout_rate=float("nan")), "rollout_rate"),
        (dict(rollout_slots=-1), "slot counts"),
    ],
)
def test_bad_observations_are_refused_with_the_field_named(bad, match):
    with pytest.raises(ValueError, match=match):
        obs(**bad)


def test_bad_config_is_refused():
    with pytest.raises(ValueError, match="margin"):
        ElasticConfig(margin=0.5)
    with pytest.raises(ValueError, match="min_rollout"):
        ElasticConfig(min_rollout=0)
    with pytest.raises(ValueError, match="group_reform_s"):
        RoleChangeCost(group_reform_s=-1.0)


def test_the_config_sections_hold_the_policies_own_defaults_and_checks():
    from reflow.config import validate_config
    from reflow.errors import ConfigError
    from reflow.policy.tail import TailConfig

    env = {"id": "reflow/Calc-v0"}
    cfg = validate_config({"env": env})
    assert cfg.elastic.policy_config() == ElasticConfig() and cfg.tail.policy_config() == TailConfig()
    assert not cfg.elastic.active(cfg.mode) and not cfg.tail.active(cfg.mode)  # sync: off
    full = validate_config({"env": env, "mode": "reflow", "elastic": {"margin": 2.5}})
    assert full.elastic.active("reflow") and full.tail.active("reflow")
    assert full.elastic.policy_config().margin == 2.5
    ablated = validate_config({"env": env, "mode": "reflow", "tail": {"enabled": False}})
    assert ablated.elastic.active("reflow") and not ablated.tail.active("reflow")
    with pytest.raises(ConfigError, match=r"elastic: .*margin must be a finite number >= 1"):
        validate_config({"env": env, "elastic": {"margin": 0.5}})
    with pytest.raises(ConfigError, match=r"tail.no_such: unknown key"):
        validate_config({"env": env, "tail": {"no_such": 1}})
