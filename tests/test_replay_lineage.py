"""Which weights made a group, across resumes: the replay store's lineages and quarantine, and a file of
schema 2 (versions from episode starts, no lineage) opening under schema 3. Real ReplayStore files in
tmp_path, hand-built records, no model."""

import sqlite3
from contextlib import closing

import pytest
from replay_helpers import make_group

from reflow.policy.dual_cycle import CycleConfig
from reflow.replay import ReplayStore
from reflow.replay.planning import accepted_groups, plan_batch
from reflow.replay.schema import SCHEMA_VERSION


@pytest.fixture
def store(tmp_path):
    s = ReplayStore(tmp_path / "replay.sqlite", run="r")
    yield s
    s.close()


def add(store, gid, version, spread=1.0):
    return store.add_group(*make_group(gid, [0.0, spread], version=version, n_turns=1, tokens=2))


def ids(groups):
    return [g.group_id for g in groups]


def test_a_resume_quarantines_the_groups_of_weights_that_died(store):
    """Lineage 0 ran to v6 and crashed; its checkpoint held v4. The resumed lineage forks at v4: the
    groups v5 and v6 made are never trained, replayed or counted, and v5, v6 name new weights."""
    assert store.start_lineage(0, None) == 0
    for v in range(7):
        add(store, f"a{v}", v)
    store.mark_consumed(["a0", "a1"], 1)
    assert store.start_lineage(4, parent=0) == 1
    assert store.quarantine() == 2
    assert store.quarantined() == ["a5", "a6"]
    assert ids(store.fresh()) == ["a2", "a3", "a4"]
    assert accepted_groups(store) == 5
    add(store, "b5", 5)  # the resumed run's own v5: another weight set, its own lineage
    assert store.group("b5").lineage == 1 and store.group("a5").lineage == 0
    plan = plan_batch(store, want=10, current_version=6, share=0.0, cfg=CycleConfig())
    assert ids(plan.fresh) == ["a2", "a3", "a4", "b5"]
    store.mark_consumed(["a5"], 9)  # the mark is data; the planner still never hands it out
    replay = plan_batch(store, want=4, current_version=6, share=1.0, cfg=CycleConfig(tau_max=9, max_reuse=5))
    assert "a5" not in ids(replay.replay)


def test_a_second_crash_bounds_the_first_lineage_by_every_fork(store):
    store.start_lineage(0, None)
    for v in range(6):
        add(store, f"a{v}", v)
    store.start_lineage(4, parent=0)  # a first resume from v4 ...
    store.quarantine()
    for v in (4, 5, 6):
        add(store, f"b{v}", v)
    store.start_lineage(2, parent=0)  # ... and a second from an older checkpoint of lineage 0
    assert store.ancestors() == [(2, None), (0, 2)]
    store.quarantine()
    assert store.quarantined() == ["a3", "a4", "a5", "b4", "b5", "b6"]
    store.start_lineage(2, parent=2)  # resumed again before its first step: nothing new quarantined
    assert store.quarantine() == 0 and store.ancestors() == [(3, None), (2, 2), (0, 2)]


def test_a_group_with_a_token_past_the_fork_is_quarantined(store):
    store.start_lineage(0, None)
    episodes, advantages = make_group("mixed", [0.0, 1.0], version=3, n_turns=1, tokens=2)
    episodes[1].turns[0].token_versions[-1] = 4  # its last token came from v4 weights
    store.add_group(episodes, advantages)
    store.start_lineage(3, parent=0)
    assert store.quarantine() == 1 and store.quarantined() == ["mixed"]


def test_a_store_of_schema_2_opens_and_reads_token_versions(tmp_path):
    path = tmp_path / "replay.sqlite"
    with ReplayStore(path, run="r") as s:
        episodes, advantages = make_group("g", [0.1 + 0.2, 0.3], version=5, n_turns=1, tokens=2)
        episodes[0].turns[0].token_versions[0] = 3  # migrated onto older weights
        s.add_group(episodes, advantages)
    with closing(sqlite3.connect(path)) as db:  # what schema 2 wrote: starts, raw spreads, no lineage
        for index in ("groups_by_consumed",):
            db.execute(f"DROP INDEX {index}")
        for column in ("newest_version", "lineage", "quarantined"):
            db.execute(f"ALTER TABLE groups DROP COLUMN {column}")
        db.execute("DROP TABLE lineages")
        db.execute("CREATE INDEX groups_by_consumed ON groups (run, consumed, seq)")  # schema 2's
        db.execute("UPDATE groups SET policy_version = 5, reward_spread = 5.551115123125783e-17")
        db.execute("PRAGMA user_version=2")
        db.commit()
    with ReplayStore(path, run="r") as s:
        (g,) = s.groups(["g"])
        assert (g.policy_version, g.newest_version, g.lineage, g.quarantined) == (3, 5, 0, False)
        assert g.reward_spread == 0.0
        assert s.start_lineage(5, parent=0) == 1 and s.quarantine() == 0
    with closing(sqlite3.connect(path)) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        # the planner's index of fresh groups leaves quarantined ones out on a migrated file too
        columns = [row[2] for row in db.execute("PRAGMA index_info(groups_by_consumed)")]
        assert columns == ["run", "quarantined", "consumed", "seq"]


def test_a_dead_branch_keeps_what_it_made_before_its_first_update(store):
    """Lineage 1 resumed from lineage 0's v3 and crashed before its next checkpoint; lineage 2 resumes
    from the same v3. Lineage 1's v3 groups were made by the checkpoint's weights (an ancestor), its
    v4 groups by weights that died."""
    store.start_lineage(0, None)
    for v in range(5):
        add(store, f"a{v}", v)
    store.start_lineage(3, parent=0)
    store.quarantine()
    add(store, "b3", 3)
    add(store, "b4", 4)
    store.start_lineage(3, parent=0)
    assert store.quarantine() == 1
    assert store.quarantined() == ["a4", "b4"]
    assert ids(store.fresh()) == ["a0", "a1", "a2", "a3", "b3"]
