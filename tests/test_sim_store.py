"""The simulator's in-memory store answers the dual cycle's queries exactly as the SQLite ReplayStore does:
the same operations on both (adds, plans, consumptions, in-flight marks) give the same answers."""

from __future__ import annotations

import random

from replay_helpers import make_group

from reflow.policy.dual_cycle import AdmissionControl, CycleConfig
from reflow.replay import ReplayStore
from reflow.replay.planning import consume, plan_batch, room_in
from reflow.sim.store import SimStore


def _ids(groups):
    return [g.group_id for g in groups]


def test_sim_store_matches_replay_store_under_the_real_cycle(tmp_path):
    rng = random.Random(7)
    real = ReplayStore(tmp_path / "replay.sqlite", run="r")
    sim = SimStore()
    cfg = CycleConfig(tau_max=2, max_reuse=3, share_init=0.5, share_max=0.5)
    admission = AdmissionControl(eta=1, groups_per_step=3)
    version, step, n = 0, 0, 0
    try:
        for _ in range(14):
            assert room_in(admission, real, version) == room_in(admission, sim, version)
            for _ in range(rng.randrange(0, 4)):
                gid, spread = f"g{n}", rng.choice([0.0, 1.0, 2.0, 0.5])
                n += 1
                for store in (real, sim):
                    store.begin_group(gid, version)
                if rng.random() < 0.2:
                    continue  # stays in flight
                real.add_group(*make_group(gid, [0.0, spread], version=version, n_turns=1, tokens=2))
                sim.add(gid, version, spread, {})
            assert real.in_flight() == sim.in_flight()
            for store in (real, sim):
                for gid in sorted(store.in_flight_groups())[:1]:
                    store.end_group(gid)
            share = rng.choice([0.0, 0.25, 0.5])
            plans = [
                plan_batch(store, want=3, current_version=version, share=share, cfg=cfg)
                for store in (real, sim)
            ]
            assert _ids(plans[0].groups) == _ids(plans[1].groups)
            assert _ids(plans[0].skipped) == _ids(plans[1].skipped)
            if plans[0].size:
                for store, plan in zip((real, sim), plans, strict=True):
                    consume(store, plan, step)
                step += 1
            if rng.random() < 0.6:
                version += 1
            for spread in (None, True, False):
                assert real.reuse_histogram(spread=spread) == sim.reuse_histogram(spread=spread)
            assert _ids(real.fresh()) == _ids(sim.fresh())
            query = {"current_version": version, "tau_max": 2, "max_reuse": 3}
            for prefer in (True, False):
                assert _ids(real.replayable(**query, prefer_spread=prefer)) == _ids(
                    sim.replayable(**query, prefer_spread=prefer)
                )
        assert step > 5  # the sequence exercised the cycle
    finally:
        real.close()


def test_prune_keeps_the_answers_of_later_queries():
    sim = SimStore()
    for i in range(6):
        sim.add(f"g{i}", i, 1.0, {})
    sim.mark_consumed([f"g{i}" for i in range(6)], 0)
    before = _ids(sim.replayable(current_version=6, tau_max=2, max_reuse=2))
    sim.prune(min_version=4, max_reuse=2)
    assert _ids(sim.replayable(current_version=6, tau_max=2, max_reuse=2)) == before == ["g5", "g4"]
    assert sim.reuse_histogram() == {1: 6}
