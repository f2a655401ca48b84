"""The dual replay data cycle: admission control (eta = 0 is exactly sync), fresh-first batches
with replay filling the gap (tau_max eviction, reuse cap K, zero-spread groups never trained), and the
adaptive replay share. Real ReplayStore files in tmp_path, hand-built records, no model."""

import heapq
import math
import random

import pytest
from replay_helpers import make_group

from reflow.policy.dual_cycle import AdmissionControl, CycleConfig, ReplayShare
from reflow.replay import ReplayStore
from reflow.replay.planning import (
    BatchPlan,
    accepted_groups,
    consume,
    plan_batch,
    reuse_histogram,
    room_in,
)


@pytest.fixture
def store(tmp_path):
    s = ReplayStore(tmp_path / "replay.sqlite", run="r")
    yield s
    s.close()


def add(store, gid, version=0, spread=1.0):
    """A two-episode group (small, so the fsync per add dominates); spread=0: both rewards equal."""
    return store.add_group(*make_group(gid, [0.0, spread], version=version, n_turns=1, tokens=2))


def has_spread(i):
    return i % 3 != 2  # every third group (by start order) is zero-spread


def ids(groups):
    return [g.group_id for g in groups]


# ---- admission control


def test_admission_arithmetic():
    sync = AdmissionControl(eta=0, groups_per_step=4)
    assert [sync.capacity(v) for v in range(3)] == [4, 8, 12]
    assert sync.room(0, accepted=0, in_flight=0) == 4
    assert sync.room(0, accepted=2, in_flight=2) == 0 and not sync.may_start(0, 2, 2)
    assert sync.room(0, accepted=4, in_flight=3) == 0  # never negative (a resumed run ahead)
    assert sync.may_start(1, accepted=4, in_flight=3)
    ahead = AdmissionControl(eta=2, groups_per_step=4)
    assert ahead.capacity(0) == 12 and ahead.room(5, accepted=30, in_flight=0) == 2
    with pytest.raises(ValueError, match="eta"):
        AdmissionControl(eta=-1, groups_per_step=4)
    with pytest.raises(ValueError, match="groups_per_step"):
        AdmissionControl(eta=0, groups_per_step=0)
    with pytest.raises(ValueError, match="version"):
        sync.capacity(-1)


def test_eta_0_allows_exactly_b_starts_per_version(store):
    B, adm = 3, AdmissionControl(eta=0, groups_per_step=3)
    n = 0
    for version in range(3):
        started = []
        while room_in(adm, store, version) > 0:
            store.begin_group(f"g{n}", version)
            started.append(f"g{n}")
            n += 1
        assert len(started) == B and store.in_flight() == B  # in-flight groups count
        for gid in started:
            add(store, gid, version)
            assert room_in(adm, store, version) == 0  # stored: still no room until the version advances
        plan = plan_batch(store, want=B, current_version=version, share=0.0, cfg=CycleConfig())
        assert ids(plan.fresh) == started
        consume(store, plan, step=version + 1)
    assert accepted_groups(store) == 3 * B


def test_eta_2_runs_three_batches_ahead_and_dropped_or_zero_spread_groups_free_their_slot(store):
    B, adm = 2, AdmissionControl(eta=2, groups_per_step=2)
    assert room_in(adm, store, 0) == 3 * B
    for i in range(3 * B):
        store.begin_group(f"g{i}", 0)
    assert room_in(adm, store, 0) == 0
    store.end_group("g0")  # dropped (an infra failure): its slot is free again
    assert room_in(adm, store, 0) == 1
    add(store, "g1", 0, spread=0.0)  # zero-spread: rejected like AReaL's filtered samples
    assert room_in(adm, store, 0) == 2 and accepted_groups(store) == 0
    assert room_in(AdmissionControl(2, B, count_zero_spread=True), store, 0) == 1
    for i in range(2, 3 * B):
        add(store, f"g{i}", 0)
    assert room_in(adm, store, 0) == 2 and room_in(adm, store, 1) == 4


def _sync_run(store, B, steps):
    """The reference: sync mode with dynamic sampling, by hand on the store: generate with the current
    weights until B groups have spread (resampling only what is missing), train, step the version."""
    n = 0
    for step in range(steps):
        version, generated, usable = step, [], 0
        while usable < B:
            batch = range(n, n + B - usable)
            n += len(batch)
            for i in batch:
                add(store, f"g{i}", version, spread=float(has_spread(i)))
                generated.append(f"g{i}")
                usable += has_spread(i)
        store.mark_consumed(generated, step + 1)


def _async_run(store, B, steps, eta, workers, seed=None):
    """A producer/consumer: up to `workers` groups in flight, each taking a random time (seed) or the
    same time (seed=None: they arrive in start order), admission by AdmissionControl, and a trainer
    that steps as soon as plan_batch has B fresh groups with spread. Returns the start versions."""
    rng, adm, starts = random.Random(seed), AdmissionControl(eta, B), []
    running: list[tuple[float, int, int]] = []  # (finish time, start index, version started with)
    now, n, version = 0.0, 0, 0
    while version < steps:
        while len(running) < workers and room_in(adm, store, version) > 0:
            store.begin_group(f"g{n}", version)
            heapq.heappush(running, (now + (1.0 if seed is None else rng.uniform(0.1, 3.0)), n, version))
            starts.append(version)
            n += 1
        accepted = accepted_groups(store)
        assert accepted + store.in_flight() <= (eta + version + 1) * B
        plan = plan_batch(
            store, want=B, current_version=version, share=0.5, cfg=CycleConfig(), allow_replay=False
        )
        if plan.size == B:
            assert not plan.replay
            consume(store, plan, step=version + 1)
            version += 1
            continue
        assert running, "admission control deadlocked the run"
        now, i, started = heapq.heappop(running)
        add(store, f"g{i}", started, spread=float(has_spread(i)))
    return starts


def _trace(store):
    """group id -> (version it was generated with, times consumed, step that last consumed it)."""
    groups = store.fresh() + store.replayable(current_version=10**6, tau_max=10**6, max_reuse=10**6)
    return {g.group_id: (g.policy_version, g.consumed, g.last_step) for g in groups}


def test_async_at_eta_0_is_exactly_sync(tmp_path):
    B, steps = 3, 5
    with ReplayStore(tmp_path / "sync.sqlite") as sync, ReplayStore(tmp_path / "async.sqlite") as asyn:
        _sync_run(sync, B, steps)
        _async_run(asyn, B, steps, eta=0, workers=4 * B, seed=1)
        expected, got = _trace(sync), _trace(asyn)
        assert got == expected
        assert all(consumed == 1 for _, consumed, _ in got.values())  # async: each consumed once
        arrival = [
            g.group_id
            for g in sorted(asyn.replayable(current_version=99, tau_max=99, max_reuse=9), key=lambda g: g.seq)
        ]
        assert arrival != sorted(arrival, key=lambda gid: int(gid[1:]))  # it really ran out of order
        assert asyn.in_flight() == 0


def test_async_eta_2_runs_ahead_within_the_bound(tmp_path):
    """The bound is on how far generation runs ahead: the n-th group with spread (in start order)
    starts with weights >= n // B - eta. Groups arriving in start order are thus trained at most eta
    versions stale; a straggler that others overtake may be trained later than that."""
    B, eta = 3, 2
    for seed in (None, 3):
        with ReplayStore(tmp_path / f"{seed}.sqlite") as store:
            starts = _async_run(store, B, steps=6, eta=eta, workers=4 * B, seed=seed)
            usable = [v for i, v in enumerate(starts) if has_spread(i)]
            assert all(v >= n // B - eta for n, v in enumerate(usable))
            assert any(v == n // B - eta for n, v in enumerate(usable))  # it does run eta ahead
            trace = _trace(store)
        ages = [(last - 1) - v for v, _, last in trace.values() if last is not None]  # step s: weights s-1
        if seed is None:
            assert max(ages) == eta


# ---- the dual cycle


def test_fresh_first_in_arrival_order_and_replay_only_when_short(store):
    cfg = CycleConfig(share_max=0.5, share_init=0.5)
    for i in range(3):
        add(store, f"old{i}", version=0)
    consume(store, plan_batch(store, want=3, current_version=0, share=0.5, cfg=cfg), step=1)
    for i in (4, 1, 3, 0, 2):  # arrival order is not name order
        add(store, f"new{i}", version=1)
    plan = plan_batch(store, want=4, current_version=1, share=0.5, cfg=cfg)
    assert ids(plan.fresh) == ["new4", "new1", "new3", "new0"] and plan.replay == []  # enough fresh
    consume(store, plan, step=2)
    plan = plan_batch(store, want=4, current_version=2, share=0.5, cfg=cfg)
    assert ids(plan.fresh) == ["new2"] and len(plan.replay) == 2  # min(4 - 1, floor(0.5 * 4))
    assert plan.group_ids[0] == "new2" and plan.size == 3 and plan.replay_fraction == pytest.approx(2 / 3)
    assert all(g.consumed >= 1 for g in plan.replay)
    assert plan.staleness(2) == [1, *(2 - g.policy_version for g in plan.replay)]
    assert plan_batch(store, want=4, current_version=2, share=0.5, cfg=cfg, allow_replay=False).replay == []


def test_share_caps_the_replayed_part_of_the_nominal_batch(store):
    cfg = CycleConfig(share_max=1.0)
    for i in range(40):
        add(store, f"g{i}")
    consume(store, plan_batch(store, want=40, current_version=0, share=0.0, cfg=cfg), step=1)
    for share, want, n in [(0.0, 8, 0), (0.25, 8, 2), (0.3, 8, 2), (0.5, 8, 4), (1.0, 8, 8), (0.58, 50, 29)]:
        plan = plan_batch(store, want=want, current_version=1, share=share, cfg=cfg)
        assert (len(plan.fresh), len(plan.replay)) == (0, n), (share, want)  # 0.58 * 50 = 28.999...
    assert plan.replay_fraction == 1.0  # no fresh data: the step still gets floor(share * want) groups
    assert plan_batch(store, want=0, current_version=1, share=1.0, cfg=cfg).size == 0
    with pytest.raises(ValueError, match="share"):
        plan_batch(store, want=4, current_version=1, share=1.5, cfg=cfg)
    with pytest.raises(ValueError, match="want"):
        plan_batch(store, want=-1, current_version=1, share=0.5, cfg=cfg)


def test_tau_max_evicts_old_groups_from_replay(store):
    cfg = CycleConfig(tau_max=2, max_reuse=100, share_max=1.0)
    for v in range(6):
        add(store, f"v{v}", version=v)
    consume(store, plan_batch(store, want=6, current_version=5, share=0.0, cfg=cfg), step=1)
    plan = plan_batch(store, want=6, current_version=5, share=1.0, cfg=cfg)
    assert ids(plan.replay) == ["v5", "v4", "v3"]  # newest first; v2 and older are too old
    assert max(plan.staleness(5)) == 2
    for version in range(6, 9):  # as the version advances, each group leaves the window at age 3
        plan = plan_batch(store, want=6, current_version=version, share=1.0, cfg=cfg)
        consume(store, plan, step=version)
        assert all(version - g.policy_version <= 2 for g in plan.replay)
    assert plan_batch(store, want=6, current_version=8, share=1.0, cfg=cfg).size == 0
    assert all(g.consumed == 1 for g in store.replayable(current_version=0, tau_max=0, max_reuse=2))  # v0


def test_reuse_cap_counts_the_fresh_use(store):
    cfg = CycleConfig(tau_max=100, max_reuse=3, share_max=1.0)
    for i in range(4):
        add(store, f"g{i}")
    assert reuse_histogram(store) == {0: 4}
    step = 0
    while (plan := plan_batch(store, want=2, current_version=step, share=1.0, cfg=cfg)).size:
        step += 1
        consume(store, plan, step)
        assert step < 20
    assert reuse_histogram(store) == {3: 4} and step == 6  # 4 groups x 3 uses / 2 per step
    assert plan_batch(store, want=2, current_version=step, share=1.0, cfg=CycleConfig(max_reuse=1)).size == 0


def test_zero_spread_groups_are_retired_not_trained_or_replayed(store):
    cfg = CycleConfig(tau_max=10, max_reuse=5, share_max=1.0)
    for i, spread in enumerate([0.0, 1.0, 0.0, 1.0, 0.0, 1.0]):
        add(store, f"g{i}", spread=spread)
    plan = plan_batch(store, want=2, current_version=0, share=1.0, cfg=cfg)
    assert ids(plan.fresh) == ["g1", "g3"] and ids(plan.skipped) == ["g0", "g2"]  # g4 stays fresh
    consume(store, plan, step=1, skipped=["g4"])  # the caller may retire more
    assert ids(store.fresh()) == ["g5"] and store.group("g4").consumed == 1
    plan = plan_batch(store, want=4, current_version=1, share=1.0, cfg=cfg)
    assert ids(plan.fresh) == ["g5"] and ids(plan.replay) == ["g3", "g1"]
    for step in range(2, 8):
        plan = plan_batch(store, want=4, current_version=1, share=1.0, cfg=cfg)
        assert all(g.reward_spread > 0 for g in plan.groups)
        consume(store, plan, step)
    assert {store.group(f"g{i}").consumed for i in (0, 2, 4)} == {1}
    assert accepted_groups(store) == 3 and accepted_groups(store, count_zero_spread=True) == 6
    assert (
        store.reuse_histogram(spread=False) == {1: 3}
        and sum(store.reuse_histogram(spread=True).values()) == 3
    )


def test_replay_prefers_larger_spread_then_newest(store):
    for gid, version, spread in [("a", 0, 1.0), ("b", 1, 0.5), ("c", 2, 0.5), ("d", 2, 1.0)]:
        add(store, gid, version=version, spread=spread)
    consume(store, plan_batch(store, want=4, current_version=2, share=0.0, cfg=CycleConfig()), step=1)
    ranked = CycleConfig(share_max=1.0, tau_max=5, max_reuse=5)
    newest = CycleConfig(share_max=1.0, tau_max=5, max_reuse=5, selection="newest")
    assert ids(plan_batch(store, want=4, current_version=2, share=1.0, cfg=ranked).replay) == [
        "d",
        "a",
        "c",
        "b",
    ]
    assert ids(plan_batch(store, want=4, current_version=2, share=1.0, cfg=newest).replay) == [
        "d",
        "c",
        "b",
        "a",
    ]
    assert ids(plan_batch(store, want=2, current_version=2, share=1.0, cfg=newest).replay) == ["d", "c"]


def test_reflow_loop_keeps_the_trainer_fed_within_the_bounds(store):
    """A trainer twice as fast as rollout: replay fills the gap, never with a group too old or used
    K times, and every group with spread is trained fresh before it is ever replayed."""
    cfg, B = CycleConfig(tau_max=2, max_reuse=3, share_init=0.5, share_max=0.5), 4
    n, first_use = 0, {}
    for step in range(1, 13):
        version = step - 1
        for _ in range(B // 2):  # rollout delivers half a batch per train step
            add(store, f"g{n}", version=version, spread=float(has_spread(n)))
            n += 1
        plan = plan_batch(store, want=B, current_version=version, share=0.5, cfg=cfg)
        for g in plan.fresh:
            assert g.consumed == 0 and first_use.setdefault(g.group_id, step) == step
        for g in plan.replay:
            assert g.group_id in first_use and g.consumed < cfg.max_reuse
            assert version - g.policy_version <= cfg.tau_max
        if step > 1:  # fed: fresh first, then floor(0.5 * B) replayed groups
            assert len(plan.replay) == min(B - len(plan.fresh), 2)
        consume(store, plan, step)
        assert plan.metrics(version)["batch_replay"] == len(plan.replay)
    assert max(reuse_histogram(store)) <= cfg.max_reuse and store.count(consumed=False) == 0


def test_empty_plan_and_metrics():
    plan = BatchPlan()
    assert (plan.size, plan.replay_fraction, plan.group_ids, plan.staleness(3)) == (0, 0.0, [], [])
    assert plan.metrics(3)["staleness_max"] == 0


# ---- the adaptive share


def test_share_moves_up_with_waiting_and_healthy_weights_and_clamps():
    share = ReplayShare(CycleConfig(share_init=0.25, share_max=0.4, share_step=0.05))
    assert share.share == 0.25
    for step in range(1, 6):
        share.update(step, trainer_wait_s=2.0, masked_frac=0.0, kl=0.0)
    assert [s for _, s in share.history] == [0.3, 0.35, 0.4, 0.4, 0.4]
    assert share.last_reason == "wait"
    share.update(6, trainer_wait_s=0.1, masked_frac=0.0, kl=0.0)  # no wait, healthy: hold
    assert share.share == 0.4 and share.last_reason == "hold"


@pytest.mark.parametrize(
    "masked_frac, kl", [(0.1, 0.0), (0.0, 0.2), (0.1, 0.2), (math.nan, 0.0), (0.0, math.inf)]
)
def test_share_moves_down_when_importance_weights_degrade_even_while_waiting(masked_frac, kl):
    share = ReplayShare(CycleConfig(share_init=0.1, share_step=0.05))
    for step in range(1, 4):
        share.update(step, trainer_wait_s=5.0, masked_frac=masked_frac, kl=kl)
    assert share.history == [(1, 0.05), (2, 0.0), (3, 0.0)] and share.last_reason == "health"


@pytest.mark.parametrize("ess, reason", [(0.3, "health"), (math.nan, "health"), (0.6, "wait")])
def test_share_falls_when_the_effective_sample_size_drops_below_its_floor(ess, reason):
    share = ReplayShare(CycleConfig(share_init=0.2, share_step=0.05, ess_min=0.5))
    share.update(1, trainer_wait_s=5.0, masked_frac=0.0, kl=0.0, ess=ess)
    assert share.last_reason == reason
    assert share.share == (0.15 if reason == "health" else 0.25)


def test_share_state_round_trips_and_a_zero_step_keeps_it_fixed():
    cfg = CycleConfig(share_init=0.2, share_step=0.0)
    share = ReplayShare(cfg)
    share.update(1, trainer_wait_s=9.0, masked_frac=0.0, kl=0.0)
    share.update(2, trainer_wait_s=0.0, masked_frac=1.0, kl=1.0)
    assert share.share == 0.2
    moving = ReplayShare(CycleConfig())
    moving.update(1, trainer_wait_s=9.0, masked_frac=0.0, kl=0.0)
    restored = ReplayShare(CycleConfig())
    restored.load_state_dict(moving.state_dict())
    assert (restored.share, restored.history) == (0.3, [(1, 0.3)])
    tighter = ReplayShare(CycleConfig(share_init=0.1, share_max=0.2))
    tighter.load_state_dict({"share": 0.5})
    assert tighter.share == 0.2  # bounds changed on resume: clamp


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"tau_max": -1}, "tau_max"),
        ({"max_reuse": 0}, "max_reuse"),
        ({"share_init": 0.6}, "share_min <= share_init <= share_max"),
        ({"share_min": 0.3}, "share_min <= share_init"),
        ({"share_max": 1.5}, "share_max <= 1"),
        ({"share_min": -0.1}, "0 <= share_min"),
        ({"share_step": -0.1}, "share_step"),
        ({"kl_max": math.nan}, "kl_max"),
        ({"ess_min": -0.5}, "ess_min"),
    ],
)
def test_config_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CycleConfig(**kwargs)


def test_one_definition_of_reward_spread_from_rewards_to_the_plan(store):
    """Float noise is not spread: 0.1 + 0.2 against three 0.3s gives all-zero advantages, so the
    worker's report, the store, the planner and replay all see a group without spread."""
    from reflow.runtime.workers import report_group
    from reflow.train.advantages import group_advantages, has_spread

    rewards = [0.1 + 0.2, 0.3, 0.3, 0.3]
    assert rewards[0] != rewards[1] and group_advantages(rewards) == [0.0] * 4
    assert not has_spread(rewards)
    episodes, advantages = make_group("noise", rewards, n_turns=1, tokens=2)
    assert not report_group(episodes, 1.0).has_spread
    assert store.add_group(episodes, advantages).reward_spread == 0.0
    add(store, "real", spread=1.0)
    plan = plan_batch(store, want=2, current_version=0, share=0.0, cfg=CycleConfig())
    assert ids(plan.fresh) == ["real"] and ids(plan.skipped) == ["noise"]
    consume(store, plan, step=1)
    later = plan_batch(store, want=2, current_version=1, share=1.0, cfg=CycleConfig(max_reuse=3))
    assert ids(later.replay) == ["real"]  # the noise group is never replayed
    assert accepted_groups(store) == 1


def test_planning_reads_no_record(store, monkeypatch):
    """A plan is made from the index columns alone (ids, versions, spreads, uses): no episode record
    is decoded, however many groups are fresh or in the replay window."""
    from reflow.replay import store as store_module

    for i in range(12):
        add(store, f"g{i}", version=i // 4, spread=float(i % 3 != 2))
    consume(store, plan_batch(store, want=4, current_version=2, share=0.0, cfg=CycleConfig()), step=1)

    def no_decoding(*args, **kwargs):
        raise AssertionError("planning decoded a record")

    monkeypatch.setattr(store_module, "decode_record", no_decoding)
    plan = plan_batch(store, want=4, current_version=2, share=0.5, cfg=CycleConfig(max_reuse=3))
    assert len(plan.fresh) == 4 and len(plan.replay) == 0
    plan = plan_batch(store, want=8, current_version=2, share=0.5, cfg=CycleConfig(max_reuse=3))
    assert len(plan.fresh) == 4 and len(plan.replay) == 4  # 4 fresh with spread left, replay fills
