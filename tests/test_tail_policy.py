"""The tail policy as arithmetic: given these episodes, engines and quantiles, these actions."""

import math

import pytest

from reflow.policy.tail import (
    CarryOver,
    EngineState,
    FreeSlot,
    InFlightEpisode,
    Migrate,
    OverProvision,
    Quantiles,
    SetConcurrency,
    TailConfig,
    TailObservation,
    TailPolicy,
    concurrency_knee,
    remaining_seconds,
)

EPISODES_S = Quantiles(p50=10.0, p90=40.0, p99=100.0, count=200)
GROUPS_S = Quantiles(p50=10.0, p90=20.0, p99=60.0, count=50)  # h = p90 / p50 = 2
KNEE = TailConfig(set_concurrency=True)  # the concurrency limits are opt-in


def ep(id, engine, seconds=30.0, tokens=1000, group=None, turns=5):
    return InFlightEpisode(id, group or f"g-{id}", engine, turns, tokens, seconds)


def kinds(actions):
    return [a.kind for a in actions]


def test_concurrency_knee_is_where_tokens_per_s_saturate():
    curve = [(16, 500.0), (1, 100.0), (4, 350.0), (2, 190.0), (8, 480.0), (32, 505.0)]
    # max 505; (1 - 0.05) x 505 = 479.75: 8 reaches it (480), 4 does not (350).
    assert concurrency_knee(curve, 0.05) == 8
    assert concurrency_knee(curve, 0.0) == 32
    assert concurrency_knee(curve, 0.5) == 4  # 350 >= 252.5, 190 is not
    eng = EngineState("e0", running=3, max_running=32, curve=tuple(curve))
    (act,) = TailPolicy(KNEE).decide(TailObservation(8, 8, (), (eng,)))
    assert act == SetConcurrency("e0", 8, act.reason) and "480 tokens/s at concurrency 8" in act.reason
    # already at the knee, or no curve to read: no advice
    at_knee = EngineState("e0", running=3, max_running=8, curve=tuple(curve))
    assert TailPolicy(KNEE).decide(TailObservation(8, 8, (), (at_knee, EngineState("e1", 0, 8)))) == []


def test_a_limit_is_lowered_only_where_the_curve_was_seen_to_saturate():
    # still rising at its highest measured point (20): nothing says 64 sequences would not help, and
    # a limit of 20 could never measure more; the limit stays
    rising = ((4, 300.0), (12, 560.0), (20, 656.0))
    eng = EngineState("e0", running=20, max_running=64, curve=rising)
    assert TailPolicy(KNEE).decide(TailObservation(8, 8, (), (eng,))) == []
    # one point above the knee that adds under 5%: saturated, the limit moves to the knee
    flat = (*rising, (28, 670.0))
    (act,) = TailPolicy(KNEE).decide(TailObservation(8, 8, (), (EngineState("e0", 20, 64, curve=flat),)))
    assert act == SetConcurrency("e0", 20, act.reason)  # 656 >= 0.95 x 670
    # a limit below the knee (points measured before it was lowered) is raised to it
    (up,) = TailPolicy(KNEE).decide(TailObservation(8, 8, (), (EngineState("e0", 4, 12, curve=flat),)))
    assert up == SetConcurrency("e0", 20, up.reason)


@pytest.mark.parametrize(
    "p90, count, delta",
    [
        (20.0, 50, 4),  # h = 2: ceil(8 x 0.5) = 4, the cap floor(8 x 0.5) = 4
        (12.5, 50, 2),  # h = 1.25: ceil(8 x 0.2) = 2
        (100.0, 50, 4),  # h = 10: ceil(8 x 0.9) = 8, capped at 4
        (10.0, 50, 0),  # h = 1: no tail, no extra groups
        (20.0, 7, 0),  # only 7 of the 8 groups needed to trust the quantiles
    ],
)
def test_over_provision_delta_follows_the_tail_heaviness(p90, count, delta):
    got, reason = TailPolicy().extra_groups(8, Quantiles(10.0, p90, max(p90, 60.0), count))
    assert got == delta, reason
    assert TailPolicy().extra_groups(8, None)[0] == 0


def test_over_provision_starts_the_missing_groups():
    # B = 8, delta = 4: 2 done + 3 in flight + 1 queued = 6 started -> start 6 more.
    episodes = (
        ep("a", "e0", group="g1"),
        ep("b", "e0", group="g1"),
        ep("c", "e0", group="g2"),
        ep("d", "e0", group="g3"),
    )
    o = TailObservation(8, 2, episodes, (EngineState("e0", 4, 8),), group_seconds=GROUPS_S, groups_queued=1)
    (act,) = TailPolicy().decide(o)
    assert isinstance(act, OverProvision) and (act.start, act.extra) == (6, 4)
    assert "6 of 8 + 4 started" in act.reason
    assert TailPolicy(TailConfig(over_provision_max=0.0)).decide(o)[0].start == 2  # B only
    # 2 groups more finishing (their episodes ended, results on the way): started, so 4 more, not 6
    done_soon = TailObservation(
        8,
        2,
        episodes,
        (EngineState("e0", 4, 8),),
        group_seconds=GROUPS_S,
        groups_queued=1,
        groups_finishing=2,
    )
    (act,) = TailPolicy().decide(done_soon)
    assert isinstance(act, OverProvision) and act.start == 4 and "8 of 8 + 4 started" in act.reason


def test_once_b_groups_are_done_the_rest_carry_over():
    episodes = (ep("x1", "e0", group="g9"), ep("x2", "e1", group="g9"), ep("y", "e1", group="g10"))
    engines = (EngineState("e0", 1, 8), EngineState("e1", 2, 8))
    (act,) = TailPolicy().decide(TailObservation(8, 8, episodes, engines, group_seconds=GROUPS_S))
    assert act == CarryOver(("g10", "g9"), ("x1", "x2", "y"), act.reason)
    assert "8 of 8 groups done: 2 unfinished groups (3 episodes)" in act.reason
    assert TailPolicy(TailConfig(carry_over=False)).decide(TailObservation(8, 8, episodes, engines)) == []


def tail_obs(**kw):
    # 4 done + 4 groups in flight = 8 = B + delta (delta 0: no group_seconds): what is left is the tail.
    # e0 runs 6 of its 8, e1 runs 1 of 8, e2 nothing: the 7 sequences fit on e0 alone.
    stragglers = [ep(f"a{i}", "e0", group=f"g{i % 3}") for i in range(6)]
    episodes = (*stragglers, ep("s", "e1", seconds=30.0, tokens=1000, group="g3"))
    engines = (EngineState("e0", 6, 8), EngineState("e1", 1, 8), EngineState("e2", 0, 8))
    base = dict(
        batch_target=8,
        groups_done=4,
        episodes=episodes,
        engines=engines,
        episode_seconds=EPISODES_S,
        prefill_tokens_per_s=1000.0,
    )
    return TailObservation(**{**base, **kw})


def test_remaining_time_reads_the_quantiles():
    assert remaining_seconds(5.0, EPISODES_S) == 5.0  # until p50 = 10
    assert remaining_seconds(30.0, EPISODES_S) == 10.0  # until p90 = 40
    assert remaining_seconds(60.0, EPISODES_S) == 40.0  # until p99 = 100
    # past p99: Pareto through p90 and p99, alpha = ln 10 / ln(100/40); median remaining s(2^(1/alpha) - 1)
    alpha = math.log(10) / math.log(2.5)
    assert remaining_seconds(200.0, EPISODES_S) == pytest.approx(200.0 * (2 ** (1 / alpha) - 1))
    assert remaining_seconds(200.0, Quantiles(10.0, 20.0, 20.0, 5)) == 0.0


def test_stragglers_consolidate_when_re_prefill_is_cheaper_than_waiting():
    actions = TailPolicy().decide(tail_obs())
    # e1's straggler: 1000 tokens / 1000 tokens/s = 1 s x margin 1.5 < 10 s left (30 s old, p90 = 40 s)
    assert kinds(actions) == ["free_slot", "migrate", "free_slot"]
    free_e2, move, free_e1 = actions
    assert free_e2 == FreeSlot("e2", "trainer", free_e2.reason)
    assert move == Migrate("s", "e1", "e0", 1000, move.reason)
    assert "fits on 1 engines" in move.reason and "= 1 s x margin 1.5 vs 10 s" in move.reason
    assert free_e1.engine == "e1" and free_e1.use == "trainer"
    # room for the next batch's groups: the freed engines go to it instead
    assert {a.use for a in TailPolicy().decide(tail_obs(next_batch_room=2)) if a.kind == "free_slot"} == {
        "next_batch"
    }


def test_no_migration_when_waiting_is_cheaper():
    def migrations(o):
        return [a for a in TailPolicy().decide(o) if a.kind == "migrate"]

    base = tail_obs()
    # 39 s old: 1 s left until p90, less than 1 s x 1.5 of re-prefill
    near_end = tail_obs(episodes=(*base.episodes[:6], ep("s", "e1", seconds=39.0, group="g3")))
    assert migrations(near_end) == []
    # 10000 tokens: 10 s x 1.5 = 15 s > 10 s left
    long_prefix = tail_obs(episodes=(*base.episodes[:6], ep("s", "e1", tokens=10_000, group="g3")))
    assert migrations(long_prefix) == []
    assert migrations(tail_obs(prefill_tokens_per_s=0.0)) == []  # no price, no move


def test_no_consolidation_before_the_tail_or_when_it_does_not_fit():
    assert TailPolicy().decide(tail_obs(groups_queued=1)) == []  # groups still wait for an engine
    full = tail_obs(engines=(EngineState("e0", 6, 6), EngineState("e1", 1, 8), EngineState("e2", 0, 8)))
    # 7 sequences need e0 (6) + e1: nothing moves, only the empty engine is freed
    assert kinds(TailPolicy().decide(full)) == ["free_slot"]
    over_limit = tail_obs(engines=(EngineState("e0", 6, 4), EngineState("e1", 1, 2), EngineState("e2", 0, 8)))
    assert kinds(TailPolicy().decide(over_limit)) == ["free_slot"]  # 7 running > limits 4 + 2: keep both
    released = tail_obs(
        engines=(EngineState("e0", 6, 8), EngineState("e1", 1, 8), EngineState("e2", 0, 8, released=True))
    )
    assert [a.engine for a in TailPolicy().decide(released) if a.kind == "free_slot"] == ["e1"]


def test_bad_observations_are_refused():
    with pytest.raises(ValueError, match="engines not observed"):
        TailObservation(8, 0, (ep("a", "nope"),), (EngineState("e0", 1, 8),))
    with pytest.raises(ValueError, match="p50 <= p90 <= p99"):
        Quantiles(10.0, 5.0, 20.0, 3)
    with pytest.raises(ValueError, match="unique"):
        TailObservation(8, 0, (), (EngineState("e0", 1, 8), EngineState("e0", 0, 8)))
    with pytest.raises(ValueError, match="over_provision_max"):
        TailConfig(over_provision_max=2.0)


def test_the_migrate_and_set_concurrency_switches_turn_those_actions_off():
    # migrate off: the stragglers stay put; the engine already empty is still freed
    assert kinds(TailPolicy(TailConfig(migrate=False)).decide(tail_obs())) == ["free_slot"]
    curve = ((1, 100.0), (4, 350.0), (8, 480.0), (16, 500.0))
    eng = EngineState("e0", running=3, max_running=16, curve=curve)
    assert kinds(TailPolicy(KNEE).decide(TailObservation(8, 8, (), (eng,)))) == ["set_concurrency"]
    assert TailPolicy(TailConfig(set_concurrency=False)).decide(TailObservation(8, 8, (), (eng,))) == []
    assert TailPolicy().decide(TailObservation(8, 8, (), (eng,))) == []  # off unless asked for


def test_a_migration_never_targets_older_weights_than_the_episodes_newest_token():
    """Two engines with equal room, at v3 and v5: an episode whose newest token is v5 goes to v5 (on
    v3 its later tokens would be older than the group's version says), whichever id sorts higher."""
    for old, new in (("e0", "e2"), ("e2", "e0")):
        straggler = InFlightEpisode("s", "g9", "e1", 5, 1000, 30.0, version=5)
        obs = TailObservation(
            batch_target=8,
            groups_done=4,
            episodes=(straggler, *(ep(f"{e}-{i}", e) for e in (old, new) for i in range(2))),
            engines=(
                EngineState(old, 2, 4, version=3),
                EngineState("e1", 1, 4, version=5),
                EngineState(new, 2, 4, version=5),
            ),
            episode_seconds=EPISODES_S,
            prefill_tokens_per_s=1000.0,
        )
        (move,) = [a for a in TailPolicy().decide(obs) if a.kind == "migrate"]
        assert move.target == new
    # every engine with room older than the episode: the newest of them
    obs = TailObservation(
        batch_target=8,
        groups_done=4,
        episodes=(
            InFlightEpisode("s", "g9", "e1", 5, 1000, 30.0, version=7),
            *(ep(f"{e}-{i}", e) for e in ("e0", "e2") for i in range(2)),
        ),
        engines=(
            EngineState("e0", 2, 4, version=4),
            EngineState("e1", 1, 4, version=7),
            EngineState("e2", 2, 4, version=6),
        ),
        episode_seconds=EPISODES_S,
        prefill_tokens_per_s=1000.0,
    )
    assert [a.target for a in TailPolicy().decide(obs) if a.kind == "migrate"] == ["e2"]
