"""Lending as arithmetic: the pipeline model with a lent engine, when the elastic policy lends, reclaims
or moves a slot instead, and when a lent engine yields to a step."""

from dataclasses import replace

import pytest

from reflow.policy.elastic import (
    ElasticConfig,
    ElasticObservation,
    ElasticPolicy,
    Interval,
    RoleChangeCost,
    observe,
)
from reflow.policy.lending import (
    LendWindow,
    hand_over_plan,
    lending_cost,
    lent_engine_yields,
    lent_throughput,
)

COST_4S = RoleChangeCost(actor_start_s=1.0, weight_load_s=2.0, group_reform_s=1.0)


def two_slots(**kw) -> ElasticObservation:
    # 1 rollout slot x 1.0 samples/s, 1 train slot x 2.0 samples/s, 4 samples per step: rollout-bound,
    # the trainer waits half the time. T(1, 1) = 1 -> 4 s a step.
    base = dict(
        step=10,
        version=10,
        steps_since_change=10,
        rollout_slots=1,
        train_slots=1,
        rollout_rate=1.0,
        train_rate=2.0,
        batch_size=4.0,
        rollout_idle=0.0,
        train_idle=0.5,
        lendable_slots=1,
    )
    return ElasticObservation(**{**base, **kw})


def policy(**kw) -> ElasticPolicy:
    cfg = {"horizon_steps": 10, "margin": 2.0, "min_dwell_steps": 5, "lend": True, "lend_overhead": 0.1}
    return ElasticPolicy(ElasticConfig(**{**cfg, **kw}))


def test_a_lent_engine_adds_rollout_in_the_share_of_time_its_trainer_waits():
    # T = u r (n + l) / (1 + u r l / (m t')): 1 x 2 / (1 + 1 / 2) = 4/3; the trainer is busy 2/3 of
    # the time, so the lent engine generates 1/3 of the time at r = 1: 1 + 1/3.
    assert lent_throughput(1, 1, 1, rollout_rate=1.0, train_rate=2.0) == pytest.approx(4 / 3)
    assert lent_throughput(1, 1, 0, rollout_rate=1.0, train_rate=2.0) == 1.0  # no lending: min(n r, m t)
    # beside a lent engine the trainer runs 10% slower: t' = 1.8, T = 2 / (1 + 1 / 1.8)
    assert lent_throughput(1, 1, 1, rollout_rate=1.0, train_rate=2.0, overhead=0.1) == pytest.approx(
        2 / (1 + 1 / 1.8)
    )
    # replay reuse multiplies what each generating second supplies
    assert lent_throughput(1, 1, 1, rollout_rate=1.0, train_rate=2.0, reuse=2.0) == pytest.approx(2.0)
    # a trainer-bound pipeline: lending cannot lift T past m t', and costs the slowdown
    assert lent_throughput(2, 1, 1, rollout_rate=1.0, train_rate=1.0, overhead=0.1) == pytest.approx(0.9)
    assert lent_throughput(2, 1, 0, rollout_rate=1.0, train_rate=1.0, overhead=0.1) == 1.0
    with pytest.raises(ValueError, match="lending slots"):
        lent_throughput(1, 1, 2, rollout_rate=1.0, train_rate=1.0)


def test_the_lend_window_weighs_run_on_steps_and_yields_by_their_time_in_tokens():
    w = LendWindow(steps=20)
    assert w.alone_rate(1) is None and w.slowdown() is None
    # three steps alone of 1000 tokens (16 samples) in 2 s each, the engines' yield 0.06 s before each
    for _ in range(3):
        w.add(2.0, 1000.0, 16, beside=False, yield_s=0.06)
    assert w.alone_rate(1) == pytest.approx(8.0) and w.alone_rate(2) == pytest.approx(4.0)
    assert w.slowdown() == pytest.approx(1 - 3000 / 6.18 / 500)  # the yields: 2.9%
    # a step beside a lent engine running on: 1500 tokens in 4.5 s (1/3 slower a token)
    w.add(4.5, 1500.0, 24, beside=True)
    assert w.alone_rate(1) == pytest.approx(8.0)  # the rate alone is the steps alone's
    assert w.slowdown() == pytest.approx(1 - 4500 / 10.68 / 500)  # 15.7%: its share of the window
    w.add(3.0, 0.0, 16, beside=False, yield_s=0.2)  # a step that trained no sampled token: its yield
    assert w.alone_s == 6.0 and w.yield_s == pytest.approx(0.38)
    restored = LendWindow(steps=20)  # what a checkpoint keeps
    restored.load_state_dict(w.state_dict())
    assert restored.entries == w.entries and restored.slowdown() == w.slowdown()
    w.reset()
    assert w.slowdown() is None and w.alone_s == w.yield_s == 0.0
    with pytest.raises(ValueError, match="at least one step"):
        LendWindow(steps=0)


def test_the_lend_window_keeps_only_its_last_steps():
    # a run-on step long ago no longer counts: lengths and load drift over a run
    w = LendWindow(steps=3)
    w.add(4.5, 1500.0, 24, beside=True)
    assert w.slowdown() is None  # nothing alone yet
    for _ in range(2):
        w.add(2.0, 1000.0, 16, beside=False)
    assert w.slowdown() == pytest.approx(1 - 3500 / 8.5 / 500)
    w.add(2.0, 1000.0, 16, beside=False)  # the run-on step leaves the window
    assert w.beside_s == 0.0 and w.slowdown() == 0.0 and w.alone_rate(1) == pytest.approx(8.0)


def test_lending_costs_what_the_window_measured_the_prior_only_where_nothing_was():
    # engines lend; the window's steps alone trained 2.0 a second, lending cost 10% of its rate
    assert lending_cost(1.8, 1, 0.05, alone_rate=2.0, slowdown=0.1) == (2.0, 0.1)
    # nothing cost (no run-on, no yield time): the prior is not charged
    assert lending_cost(2.0, 1, 0.05, alone_rate=2.0, slowdown=0.0) == (2.0, 0.0)
    # engines lend and every step ran beside one: nothing alone to read, the prior stands in
    assert lending_cost(1.9, 1, 0.05) == (pytest.approx(2.0), 0.05)
    # nothing lends: the rate alone, the prior what lending would cost
    assert lending_cost(1.7, 0, 0.1, alone_rate=1.8, slowdown=0.0) == (1.8, 0.1)
    assert lending_cost(1.8, 0, 0.1) == (1.8, 0.1)


def test_observe_carries_the_lend_window():
    interval = Interval(10.0, 5.0, 5.0, 8.0, 14.0)
    kw = dict(step=5, version=5, steps_since_change=5, rollout_slots=1, train_slots=1, batch_size=4.0)
    w = LendWindow(steps=20)
    w.add(6.0, 600.0, 12, beside=False)
    w.add(2.0, 100.0, 2, beside=True)
    o = observe(interval, **kw, lent_slots=1, lendable_slots=1, lend_window=w)
    assert o.train_rate == pytest.approx(14 / 8) and o.train_rate_alone == pytest.approx(2.0)
    assert o.lend_slowdown == pytest.approx(1 - (700 / 8) / 100)
    assert observe(interval, **kw, lendable_slots=1).train_rate_alone is None  # no window: lending off
    # no slot lends now: the rate alone is read, no slowdown (what lending costs is not being measured)
    idle = observe(interval, **kw, lendable_slots=1, lend_window=w)
    assert idle.train_rate_alone == pytest.approx(2.0) and idle.lend_slowdown is None


def test_the_policy_charges_lending_its_last_measured_slowdown_once_no_slot_lends():
    # measured while lending: 25% (a trainer-bound pipeline): reclaim
    p = policy()
    lent = two_slots(rollout_slots=2, train_rate=1.8, lent_slots=1, rollout_idle=0.3, train_idle=0.0)
    assert p.decide(replace(lent, train_rate_alone=2.4, lend_slowdown=0.25)).action == "reclaim"
    assert p.lend_slowdown == 0.25
    # later, rollout-bound, nothing lends: a lend is weighed at the 25% measured, not the 10% prior:
    # T 1 -> 2 / (1 + 1 / 1.5) = 1.2 (the prior would have said 2 / (1 + 1 / 1.8) = 1.29)
    d = p.decide(two_slots(version=20, step=20))
    assert d.action == "lend" and d.throughput_target == pytest.approx(1.2)


def test_lends_on_two_slots_where_no_move_is_possible():
    d = policy().decide(two_slots())
    # T 1 -> 2 / (1 + 1/1.8) = 1.286 (+29% >= 2%): step 4 s -> 3.11 s, over 10 steps 8.9 s
    assert (d.action, d.rollout_slots, d.train_slots, d.lent_slots) == ("lend", 1, 1, 1)
    assert d.throughput_now == 1.0 and d.throughput_target == pytest.approx(2 / (1 + 1 / 1.8))
    assert d.gain_s == pytest.approx(10 * (4 - 4 / (2 / (1 + 1 / 1.8)))) and d.cost_s == 0.0
    assert "lend (1 of 1 train slots lending)" in d.reason


def test_no_lending_without_an_engine_to_lend_or_when_the_idle_ratios_disagree():
    assert policy().decide(two_slots(lendable_slots=0)).action == "hold"
    # rollout waits more than the trainer: the model's bottleneck is not what was measured
    assert policy().decide(two_slots(rollout_idle=0.3, train_idle=0.1)).action == "hold"


def test_reclaims_when_the_trainer_is_the_bottleneck():
    # lending, measured: rollout 2 x 1.0 supplies more than the trainer's 1.8 (2.0 unlent): the lent
    # engine only slows the trainer. T 1.8 -> 2.0 (+11%)
    o = two_slots(rollout_slots=2, train_rate=1.8, lent_slots=1, rollout_idle=0.3, train_idle=0.0)
    d = policy().decide(o)
    assert (d.action, d.lent_slots) == ("reclaim", 0)
    assert (d.throughput_now, d.throughput_target) == (pytest.approx(1.8), pytest.approx(2.0))


def test_keeps_lending_where_the_trainer_is_the_bottleneck_but_its_steps_ran_alone():
    # the same trainer-bound pipeline, lending, but measured: the steps the engine yielded to ran at
    # the trainer's rate, none ran on beside. Lending costs nothing measured (a trainer that never
    # waits gives its engine no time to fill): no reclaim on an assumed 10% (T 1.8 -> 1.8)
    o = two_slots(rollout_slots=2, train_rate=1.8, lent_slots=1, rollout_idle=0.3, train_idle=0.0)
    assert policy().decide(replace(o, train_rate_alone=1.8, lend_slowdown=0.0)).action == "hold"
    # a window whose run-on steps cost the trainer 25% of its rate: reclaim
    d = policy().decide(replace(o, train_rate_alone=2.4, lend_slowdown=0.25))
    assert (d.action, d.throughput_now, d.throughput_target) == ("reclaim", pytest.approx(1.8), 2.0)
    assert d.reason.startswith("reclaim (0 of 1 train slots lending)")


def test_holds_when_lending_gains_less_than_the_minimum():
    # the trainer barely waits: r = 1.95 against t' = 1.8 (2.0 unlent) is already trainer-bound
    d = policy(lend_overhead=0.0, lend_min_gain=0.05).decide(two_slots(rollout_rate=1.9))
    # T 1.9 -> min(1.9 x 2 / (1 + 1.9 / 2), 2) = 1.949 (+2.6% < 5%)
    assert d.action == "hold"


def four_slots(**kw) -> ElasticObservation:
    # 2 rollout x 1.0 and 2 train x 3.0 samples/s, 6 samples a step: T(2, 2) = 2 -> 3 s a step.
    # A move to (3, 1): T = 3 -> 2 s, gain 10 s over 10 steps against 4 s x margin 2 = 8 s: net 2 s.
    # Lending one slot: t' = 2.7, T = 3 / (1 + 1 / 5.4) = 2.53 -> 2.37 s, gain 6.3 s at no cost.
    base = dict(rollout_slots=2, train_slots=2, rollout_rate=1.0, train_rate=3.0, batch_size=6.0)
    return two_slots(**{**base, "lendable_slots": 2, "to_rollout_cost": COST_4S, **kw})


def test_lending_wins_over_a_move_whose_net_gain_is_smaller():
    d = policy().decide(four_slots())
    assert d.action == "lend" and d.gain_s == pytest.approx(10 * (3 - 6 / (3 / (1 + 1 / 5.4))))


def test_a_cheap_move_wins_over_lending():
    # the same move at 1 s: net 10 - 2 = 8 s > lending's 6.3 s
    cheap = RoleChangeCost(actor_start_s=1.0)
    d = policy().decide(four_slots(to_rollout_cost=cheap))
    assert (d.action, d.rollout_slots, d.train_slots, d.lent_slots) == ("to_rollout", 3, 1, 0)


def test_a_move_that_pays_more_than_lending_first_reclaims_the_lent_engine():
    # one slot lends (t measured 2.7, 3.0 unlent): T(2, 2, l=1) = 2.53, 2.37 s a step. A move to
    # (3, 1): 2 s a step, gain 3.7 s - 0.1 s x 2 = 3.5 s net; lending a second slot: T = 4 / (1 +
    # 2 / 5.4) = 2.92, gain 3.2 s. The move needs no slot lending: the policy reclaims now, moves later
    cheap = RoleChangeCost(actor_start_s=0.1)
    o = four_slots(to_rollout_cost=cheap, lent_slots=1, train_rate=2.7, rollout_idle=0.0, train_idle=0.3)
    p = policy()
    d = p.decide(o)
    assert (d.action, d.lent_slots, d.rollout_slots) == ("reclaim", 0, 2)
    assert d.reason.startswith("reclaim a lent engine first, then to_rollout (3 rollout + 1 train)")
    # next boundary, nothing lending: the move itself (versus lending again, which gains less)
    nxt = p.decide(replace(o, version=11, step=11, lent_slots=0, train_rate=3.0))
    assert (nxt.action, nxt.rollout_slots, nxt.train_slots) == ("to_rollout", 3, 1)


def test_lends_at_most_once_per_version():
    p = policy()
    assert p.decide(two_slots()).action == "lend"
    again = p.decide(two_slots())
    assert again.action == "hold" and "already moved a slot at version 10" in again.reason


def test_observe_counts_a_lent_engines_generating_seconds_as_offered_rollout_time():
    # 10 s: the rollout slot busy 10 s, the lent engine 4 s (its trainer waited), 28 samples made
    interval = Interval(
        seconds=10.0, rollout_busy_s=10.0, generated=28.0, trainer_busy_s=6.0, trained=12.0, lent_busy_s=4.0
    )
    o = observe(
        interval, step=3, version=3, steps_since_change=3, rollout_slots=1, train_slots=1,
        batch_size=4.0, lent_slots=1, lendable_slots=1,
    )  # fmt: skip
    assert o.rollout_rate == pytest.approx(2.0)  # 28 samples / 14 generating seconds
    assert o.rollout_idle == 0.0 and o.train_idle == pytest.approx(0.4)
    assert (o.lent_slots, o.lendable_slots) == (1, 1)
    with pytest.raises(ValueError, match="lent_slots 2 <= lendable_slots 1"):
        replace(o, lent_slots=2)
    # the rollout slot waited 4 of 10 s: a lent engine generating meanwhile does not hide that
    waited = replace(interval, rollout_busy_s=6.0, generated=20.0)
    o = observe(
        waited, step=3, version=3, steps_since_change=3, rollout_slots=1, train_slots=1,
        batch_size=4.0, lent_slots=1, lendable_slots=1,
    )  # fmt: skip
    assert o.rollout_idle == pytest.approx(0.4) and o.rollout_rate == pytest.approx(2.0)


def test_lending_and_reclaiming_wait_the_dwell_after_a_change():
    d = policy().decide(two_slots(steps_since_change=4))
    assert d.action == "hold"
    assert policy().decide(two_slots(steps_since_change=5)).action == "lend"


def test_a_lent_engine_yields_unless_its_oldest_group_is_past_the_staleness_bound():
    assert lent_engine_yields(None, 9, eta=1)  # nothing in flight
    assert lent_engine_yields(9, 9, eta=1) and lent_engine_yields(8, 9, eta=1)
    assert not lent_engine_yields(7, 9, eta=1)  # 2 versions old with eta 1: runs beside the step
    assert lent_engine_yields(5, 5, eta=0) and not lent_engine_yields(4, 5, eta=0)


def test_yielding_lent_engines_hand_over_what_the_rollout_engines_have_room_for():
    # one lent engine of 32 episodes, one rollout engine with 20 free sequences: 20 move, 12 pause
    assert hand_over_plan([32], [20]) == [(0, 20)]
    assert hand_over_plan([8], [20]) == [(0, 8)]  # all of them
    assert hand_over_plan([8], [0]) == [(-1, 0)] and hand_over_plan([8], []) == [(-1, 0)]
    assert hand_over_plan([8], [-3]) == [(-1, 0)]  # a load past its limit: no room
    # two lent engines, two rollout engines: the engine with the most episodes first, each to the
    # rollout engine with the most room, none split over two
    assert hand_over_plan([16, 16], [10, 12]) == [(1, 12), (0, 10)]
    assert hand_over_plan([4, 16], [10, 12]) == [(0, 4), (1, 12)]  # 16 of 20 fit (in order: 14)
    assert hand_over_plan([0, 4], [10]) == [(-1, 0), (0, 4)]


def test_a_hand_over_goes_only_to_rollout_engines_with_weights_no_older_than_the_lent_engines():
    # the lent engine holds version 5; rollout engine 0 (most room) still 4, engine 1 has 5
    assert hand_over_plan([8], [20, 6], versions=[5], target_versions=[4, 5]) == [(1, 6)]
    assert hand_over_plan([8], [20], versions=[5], target_versions=[4]) == [(-1, 0)]  # none: it pauses
    assert hand_over_plan([8], [20], versions=[5], target_versions=[6]) == [(0, 8)]  # newer is fine
    # per lent engine: one at version 3 may go to the older target, one at 5 may not
    assert hand_over_plan([4, 4], [10], versions=[3, 5], target_versions=[4]) == [(0, 4), (-1, 0)]
