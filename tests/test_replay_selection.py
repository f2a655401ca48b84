"""Replay selection as arithmetic: the "scored" policy's score, its gates on the last use's importance
weights, and its order; then the same through a real ReplayStore (pass rates stored, use statistics
written back and read by the planner). Hand-built records, no model."""

import math

import pytest
from replay_helpers import make_group

from reflow.policy.dual_cycle import CycleConfig
from reflow.policy.replay_selection import Candidate, ReplaySelection
from reflow.replay import ReplayStore, UseStats
from reflow.replay.planning import plan_batch

SCORED = CycleConfig(selection="scored", age_decay=0.5, ess_min=0.5, kl_max=0.05, clip_frac_max=0.5)


def cand(gid="g", version=10, seq=1, spread=1.0, p=0.5, uses=1, ess=None, clip=None, kl=None):
    return Candidate(gid, version, seq, spread, p, uses, ess, clip, kl)


def test_the_score_by_hand():
    s = ReplaySelection(SCORED)
    # age 0, spread 1, p 0.5 (difficulty 1), one use, no statistics yet: 1
    assert s.score(cand(), current_version=10) == 1.0
    # age 2 (0.25) * spread 0.5 * difficulty (0.5 + 2 * 0.25 * 0.75 = 0.875) / 2 uses * ESS 0.8
    assert s.score(cand(version=8, spread=0.5, p=0.25, uses=2, ess=0.8), 10) == pytest.approx(
        0.25 * 0.5 * 0.875 / 2 * 0.8
    )
    # every episode passed (possible only with graded rewards): difficulty 1/2, never 0
    assert s.score(cand(p=1.0), 10) == 0.5
    # a version newer than the trainer's (cannot happen, but no bonus for it) counts as age 0
    assert s.score(cand(version=12), 10) == 1.0


@pytest.mark.parametrize(
    "bad",
    [
        {"spread": 0.0},
        {"ess": 0.49},
        {"kl": 0.051},
        {"clip": 0.51},
        {"ess": math.nan},
        {"kl": math.nan},
    ],
)
def test_a_group_whose_last_use_was_off_policy_is_not_replayed(bad):
    s = ReplaySelection(SCORED)
    assert not s.admissible(cand(**bad)) and s.score(cand(**bad), 10) == 0.0
    assert s.select([cand(**bad)], 1, 10) == []


def test_at_the_bounds_a_group_is_still_replayed():
    s = ReplaySelection(SCORED)
    edge = cand(ess=0.5, kl=0.05, clip=0.5)
    assert s.admissible(edge) and s.select([edge], 1, 10) == ["g"]


def test_select_orders_by_score_then_newest_and_takes_n():
    s = ReplaySelection(SCORED)
    found = [
        cand("old", version=8, seq=1),  # 0.25
        cand("easy", version=10, seq=2, p=0.9),  # 0.5 + 2 * 0.09 = 0.68
        cand("best", version=10, seq=3),  # 1
        cand("tie_old", version=9, seq=9, spread=2.0, p=0.0),  # 0.5 * 2 * 0.5 = 0.5
        cand("tie_new", version=9, seq=10, spread=2.0, p=0.0),  # 0.5, later arrival first
        cand("dead", version=10, seq=4, ess=0.1),
    ]
    assert s.select(found, 10, 10) == ["best", "easy", "tie_new", "tie_old", "old"]
    assert s.select(found, 2, 10) == ["best", "easy"] and s.select(found, 0, 10) == []


def test_a_stronger_age_decay_prefers_fresher_over_wider_spread():
    wide_old, narrow_new = cand("wide", version=8, spread=1.0), cand("narrow", version=10, spread=0.4)
    assert ReplaySelection(CycleConfig(selection="scored", age_decay=0.9)).select(
        [wide_old, narrow_new], 1, 10
    ) == ["wide"]  # 0.81 > 0.4
    assert ReplaySelection(CycleConfig(selection="scored", age_decay=0.5)).select(
        [wide_old, narrow_new], 1, 10
    ) == ["narrow"]  # 0.25 < 0.4


def test_the_config_refuses_what_the_policy_cannot_use():
    with pytest.raises(ValueError, match="selection"):
        CycleConfig(selection="best")
    with pytest.raises(ValueError, match="age_decay"):
        CycleConfig(age_decay=0.0)
    with pytest.raises(ValueError, match="clip_frac_max"):
        CycleConfig(clip_frac_max=1.5)


# ---- through the store


@pytest.fixture
def store(tmp_path):
    s = ReplayStore(tmp_path / "replay.sqlite", run="r")
    yield s
    s.close()


def add(store, gid, rewards, version):
    return store.add_group(*make_group(gid, rewards, version=version, n_turns=1, tokens=2))


def test_the_store_keeps_pass_rates_and_the_last_uses_statistics(store):
    add(store, "half", [0.0, 1.0], 3)  # make_episode: success = reward > 0.5
    add(store, "most", [1.0, 1.0, 1.0, 0.0], 3)
    assert [g.pass_rate for g in store.fresh()] == [0.5, 0.75]
    assert all(g.last_use is None for g in store.fresh())
    store.set_use_stats({"half": UseStats(0.9, 0.1, 0.01), "unknown": UseStats(1.0, 0.0, 0.0)}, step=1)
    store.set_use_stats({"half": UseStats(0.7, 0.2, 0.02)}, step=2)  # the last use replaces the one before
    half, most = store.groups(["half", "most"])
    assert half.last_use == UseStats(0.7, 0.2, 0.02) and most.last_use is None
    store.set_use_stats({"most": UseStats(0.8, 0.0, 0.0)}, step=1)
    store.rollback_consumption(after_step=1)  # a resume from step 1's checkpoint: step 2 never happened
    half, most = store.groups(["half", "most"])
    assert half.last_use is None and most.last_use == UseStats(0.8, 0.0, 0.0)


def test_the_planner_replays_by_score_and_skips_a_group_the_trainer_found_off_policy(store):
    for gid, rewards, version in [
        ("old", [0.0, 1.0], 3),
        ("easy", [1.0, 1.0, 1.0, 0.0], 5),
        ("best", [0.0, 1.0], 5),
        ("drifted", [0.0, 1.0], 5),
    ]:
        add(store, gid, rewards, version)
    store.mark_consumed(["old", "easy", "best", "drifted"], 1)
    store.set_use_stats({"drifted": UseStats(0.2, 0.0, 0.0), "best": UseStats(1.0, 0.0, 0.0)}, step=1)
    cfg = CycleConfig(selection="scored", tau_max=2, max_reuse=2, share_max=1.0)
    plan = plan_batch(store, want=4, current_version=5, share=1.0, cfg=cfg)
    # best 1.0; easy 0.5 + 2 * 0.1875 = 0.875; old 0.25 (age 2); drifted gated (ESS 0.2 < 0.5)
    assert [g.group_id for g in plan.replay] == ["best", "easy", "old"]
    spread = plan_batch(
        store, want=4, current_version=5, share=1.0, cfg=CycleConfig(tau_max=2, share_max=1.0)
    )
    assert "drifted" in [g.group_id for g in spread.replay]  # the default ranking ignores the statistics


def test_a_store_of_schema_3_opens_with_pass_rates_from_its_episodes(tmp_path):
    import sqlite3
    from contextlib import closing

    from reflow.replay.schema import SCHEMA_VERSION

    path = tmp_path / "replay.sqlite"
    with ReplayStore(path, run="r") as s:
        add(s, "g", [1.0, 1.0, 0.0, 0.0], 2)
    with closing(sqlite3.connect(path)) as db:  # what schema 3 wrote: no selection columns
        for column in ("pass_rate", "last_ess", "last_clip_frac", "last_kl_behav", "last_use_step"):
            db.execute(f"ALTER TABLE groups DROP COLUMN {column}")
        db.execute("UPDATE episodes SET status = 'infra_error' WHERE idx = 3")  # masked: not counted
        db.execute("PRAGMA user_version=3")
        db.commit()
    with ReplayStore(path, run="r") as s:
        (g,) = s.fresh()
        assert g.pass_rate == pytest.approx(2 / 3) and g.last_use is None
        s.set_use_stats({"g": UseStats(0.9, 0.0, 0.01)}, step=1)
        assert s.fresh()[0].last_use == UseStats(0.9, 0.0, 0.01)
    with closing(sqlite3.connect(path)) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 4


def test_a_run_saved_with_prefer_spread_still_loads():
    from reflow.config import load_config, renamed_replay_keys

    assert (
        load_config(None, ["env.id=reflow/Calc-v0", "replay.prefer_spread=false"]).replay.selection
        == "newest"
    )
    assert (
        load_config(None, ["env.id=reflow/Calc-v0", "replay.prefer_spread=true"]).replay.selection == "spread"
    )
    assert renamed_replay_keys({"prefer_spread": False, "tau_max": 3}) == {
        "selection": "newest",
        "tau_max": 3,
    }
