"""The replay store: full-record round trip, the fresh and replay queries, consumption counts,
in-flight groups, the cursor, thread safety, stats, and durability under kill -9."""

import random
import signal
import sqlite3
import subprocess
import sys
import threading
from contextlib import closing
from pathlib import Path

import pytest
from replay_helpers import make_episode, make_group, writer_group

from reflow.replay import ReplayStore
from reflow.replay import store as store_module
from reflow.replay.schema import decode_record, encode_record, record_dict


@pytest.fixture
def store(tmp_path):
    s = ReplayStore(tmp_path / "run" / "replay.sqlite", run="r")
    yield s
    s.close()


def add(store, gid, rewards, version=0, **kwargs):
    return store.add_group(*make_group(gid, rewards, version=version, **kwargs))


@pytest.mark.parametrize("compress", [True, False])
def test_full_records_round_trip(tmp_path, compress):
    path = tmp_path / "deep" / "replay.sqlite"  # parents are created
    episodes, advantages = make_group("g0", [1.0, 0.0, 0.5], n_turns=3, tokens=12)
    episodes[1].status, episodes[1].error = "env_error", "the env crashed"
    with ReplayStore(path, run="r", compress=compress) as s:
        stored = s.add_group(episodes, advantages, meta={"task": "t0", "n": [1, 2]})
    assert (stored.seq, stored.policy_version, stored.consumed, stored.last_step) == (1, 0, 0, None)
    with ReplayStore(path, run="r") as s:  # a fresh connection reads what the first one wrote
        got = s.group("g0")
        assert got.episodes == episodes  # turns, segments, tool calls and results, messages: all equal
        assert got.episodes[0].turns[1].tool_results == episodes[0].turns[1].tool_results
        assert got.advantages == advantages and got.meta == {"task": "t0", "n": [1, 2]}
        assert got.reward_spread == 1.0 and got.run == "r" and got.created_at > 0
        assert list(s.episodes()) == episodes


def test_record_codec_matches_to_dict():
    rec = make_episode("g", 0, n_turns=2)
    assert record_dict(rec) == rec.to_dict()
    for compress in (True, False):
        assert decode_record(*encode_record(rec, compress)) == rec.to_dict()


def test_numpy_values_in_records_are_stored_as_plain_numbers(store):
    np = pytest.importorskip("numpy")
    episodes, advantages = make_group("g0", [1.0, 0.0])
    episodes[0].turns[0].tool_results = [{"value": np.float64(2.5), "shape": np.array([1, 2])}]
    store.add_group(episodes, np.array(advantages))
    got = store.group("g0")
    assert got.episodes[0].turns[0].tool_results == [{"value": 2.5, "shape": [1, 2]}]
    assert got.advantages == advantages


def test_add_group_rejects_bad_groups(store):
    episodes, advantages = make_group("g0", [1.0, 0.0])
    with pytest.raises(ValueError, match="at least one"):
        store.add_group([], [])
    with pytest.raises(ValueError, match="advantages"):
        store.add_group(episodes, [0.0])
    mixed = [episodes[0], make_episode("g1", 1)]
    with pytest.raises(ValueError, match="one group_id"):
        store.add_group(mixed, [0.0, 0.0])
    with pytest.raises(ValueError, match="duplicate episode_id"):
        store.add_group([episodes[0], episodes[0]], [0.0, 0.0])
    store.add_group(episodes, advantages)
    with pytest.raises(ValueError, match="already in the store"):
        store.add_group(episodes, advantages)
    clash = make_episode("g2", 0)
    clash.episode_id = episodes[0].episode_id
    with pytest.raises(ValueError, match="episode_id is already"):
        store.add_group([clash], [0.0])
    assert store.count() == 1  # the failed transactions left nothing behind
    with pytest.raises(KeyError):
        store.group("g2")


def test_group_version_is_its_oldest_token_and_spread_ignores_infra_errors(store):
    episodes, advantages = make_group("g0", [0.0, 1.0, 0.5], version=4)
    episodes[2].turns[-1].token_versions[-1] = 3  # a token an engine still at v3 generated
    episodes[0].turns[0].token_versions[0] = 6
    stored = store.add_group(episodes, advantages)
    assert (stored.policy_version, stored.newest_version) == (3, 6)
    assert [(g.policy_version, g.newest_version) for g in store.fresh()] == [(3, 6)]
    episodes, advantages = make_group("g1", [1.0, 0.0, 1.0])
    episodes[1].status = "infra_error"  # masked by the trainer: its 0.0 is no signal
    assert store.add_group(episodes, advantages).reward_spread == 0.0


def test_fresh_is_arrival_order_and_excludes_consumed(store):
    for gid in ("b", "a", "d", "c"):
        add(store, gid, [0.0, 1.0])
    assert [g.group_id for g in store.fresh()] == ["b", "a", "d", "c"]
    assert [g.seq for g in store.fresh()] == [1, 2, 3, 4]
    assert [g.group_id for g in store.fresh(limit=2)] == ["b", "a"]
    store.mark_consumed(["a"], step=1)
    assert [g.group_id for g in store.fresh()] == ["b", "d", "c"]


def test_replayable_window_reuse_limit_and_spread_preference(store):
    add(store, "old", [0.0, 1.0], version=1)
    add(store, "flat5", [1.0, 1.0], version=5)
    add(store, "spread4", [0.0, 1.0], version=4)
    add(store, "flat6", [0.0, 0.0], version=6)
    add(store, "spread6", [0.0, 1.0], version=6)
    add(store, "never", [0.0, 1.0], version=6)
    assert store.replayable(current_version=6, tau_max=10, max_reuse=3) == []  # nothing consumed yet
    store.mark_consumed(["old", "flat5", "spread4", "flat6", "spread6"], step=1)

    def ids(**kw):
        return [g.group_id for g in store.replayable(current_version=7, **kw)]

    # spread first, then the latest policy version, then the latest arrival; "old" is 6 versions stale
    assert ids(tau_max=3, max_reuse=3) == ["spread6", "spread4", "flat6", "flat5"]
    assert ids(tau_max=3, max_reuse=3, prefer_spread=False) == ["spread6", "flat6", "flat5", "spread4"]
    assert "old" in ids(tau_max=6, max_reuse=3)
    assert ids(tau_max=3, max_reuse=3, limit=1) == ["spread6"]
    assert ids(tau_max=0, max_reuse=3) == []
    store.mark_consumed(["spread6", "flat5"], step=2)  # consumed twice now
    assert ids(tau_max=3, max_reuse=2) == ["spread4", "flat6"]
    assert ids(tau_max=3, max_reuse=1) == []  # max_reuse counts the fresh consumption too


def test_mark_consumed_counts_steps_atomically(store):
    for gid in ("a", "b", "c"):
        add(store, gid, [0.0, 1.0])
    store.mark_consumed(["a", "b", "a"], step=7)  # a group listed twice counts once per step
    store.mark_consumed(["a"], step=9)
    assert (store.group("a").consumed, store.group("a").last_step) == (2, 9)
    assert (store.group("b").consumed, store.group("b").last_step) == (1, 7)
    with pytest.raises(KeyError):
        store.mark_consumed(["c", "missing"], step=10)
    assert store.group("c").consumed == 0  # rolled back with the unknown id
    assert (store.count(), store.count(consumed=True), store.count(consumed=False)) == (3, 2, 1)


def test_in_flight_groups(store, tmp_path):
    store.begin_group("a", 3)
    store.begin_group("b", 4)
    store.begin_group("b", 4)  # idempotent
    assert store.in_flight() == 2 and store.in_flight_groups() == {"a": 3, "b": 4}
    store.end_group("a")
    store.end_group("never-started")
    add(store, "b", [0.0, 1.0])  # storing a group ends it
    assert store.in_flight() == 0
    store.begin_group("c", 5)
    with ReplayStore(store.path, run="other") as other:  # counted per run
        assert other.in_flight() == 0
    with ReplayStore(store.path, run="r") as again:  # visible to another connection
        assert again.in_flight_groups() == {"c": 5}
        assert again.clear_in_flight() == 1
    assert store.in_flight() == 0


def test_cursor_is_json_per_run_and_persists(store):
    assert store.get_cursor("replay", default={"step": 0}) == {"step": 0}
    store.set_cursor("replay", {"step": 3, "seen": ["a", "b"]})
    store.set_cursor("replay", {"step": 4, "seen": ["a"]})
    store.set_cursor("ratio", 0.25)
    with ReplayStore(store.path, run="r") as again:
        assert again.get_cursor("replay") == {"step": 4, "seen": ["a"]}
        assert again.get_cursor("ratio") == 0.25
    with ReplayStore(store.path, run="other") as other:
        assert other.get_cursor("replay") is None


def test_runs_share_a_file_and_episodes_filters(store, monkeypatch):
    monkeypatch.setattr(store_module, "_PAGE", 3)  # several pages of keyset pagination
    for n in range(4):
        add(store, f"g{n}", [0.0, 1.0, 0.5], version=n)
    with ReplayStore(store.path, run="other") as other:
        add(other, "g0", [1.0], version=9)  # the same group id in another run is fine
        assert other.count() == 1 and [g.group_id for g in other.fresh()] == ["g0"]
        assert other.runs() == ["other", "r"]
    mine = [e.episode_id for e in store.episodes(run="r")]
    assert mine == [f"g{n}-e{i}" for n in range(4) for i in range(3)]
    assert len(list(store.episodes())) == 13  # run=None: every run in the file
    assert {e.policy_version_start for e in store.episodes(run="r", min_version=2)} == {2, 3}
    assert store.count() == 4


def test_threads_share_one_store(store):
    errors = []

    def worker(t):
        try:
            for n in range(5):
                add(store, f"t{t}-{n}", [0.0, float(n % 2)], version=n)
                store.fresh(limit=2)
                store.in_flight()
        except Exception as e:
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert store.count() == 20 and len(list(store.episodes())) == 40
    assert [g.seq for g in store.fresh()] == list(range(1, 21))


def test_stats(store):
    add(store, "a", [0.0, 1.0], version=0, n_turns=1, tokens=4)
    add(store, "b", [1.0, 1.0, 1.0], version=1, n_turns=3, tokens=4)
    episodes, advantages = make_group("c", [0.0, 0.0], version=1, status="timeout")
    store.add_group(episodes, advantages)
    store.mark_consumed(["a", "b"], step=1)
    store.mark_consumed(["a"], step=2)
    store.begin_group("d", 2)
    s = store.stats()
    assert (s["groups"], s["groups_consumed"], s["groups_unconsumed"], s["episodes"]) == (3, 2, 1, 7)
    assert (s["groups_zero_spread"], s["in_flight"], s["consumptions"]) == (2, 1, 3)
    assert s["statuses"] == {"ok": 5, "timeout": 2} and s["reward_mean"] == pytest.approx(4 / 7)
    assert s["turns_max"] == 3 and s["generated_tokens"] == 1 * 4 * 2 + 3 * 4 * 3 + 2 * 8 * 2
    assert s["reuse_histogram"] == {0: 1, 1: 1, 2: 1} and s["policy_versions"] == [0, 1]
    v0, v1 = s["by_version"]
    assert (v0["policy_version"], v0["groups"], v0["episodes"], v0["success_rate"]) == (0, 1, 2, 0.5)
    assert (v1["groups"], v1["episodes"], v1["statuses"]) == (2, 5, {"ok": 3, "timeout": 2})
    assert s["oldest_created_at"] <= s["newest_created_at"]


WRITER = Path(__file__).with_name("replay_helpers.py")


def test_acknowledged_groups_survive_kill_9(tmp_path):
    """A writer acknowledges each group after add_group returns; SIGKILL it mid-stream at random
    points: every acknowledged group is there, whole, and nothing half-written is visible."""
    rng = random.Random(20240611)
    for attempt in range(4):
        db = tmp_path / f"kill{attempt}" / "replay.sqlite"
        proc = subprocess.Popen([sys.executable, str(WRITER), str(db)], stdout=subprocess.PIPE, text=True)
        acked = []
        target = rng.randint(1, 40)
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
                acked.append(line.strip())
                if len(acked) == target:
                    break
        finally:
            proc.send_signal(signal.SIGKILL)  # the writer is somewhere inside its next add_group
            proc.wait()
            proc.stdout.close()
        assert proc.returncode == -signal.SIGKILL

        with ReplayStore(db, run="durability") as s:
            assert s.integrity_check() == "ok"
            stored = s.groups([g.group_id for g in s.fresh()])
        ids = [g.group_id for g in stored]
        assert ids[: len(acked)] == acked  # every acknowledged group, in arrival order
        assert ids == [f"g{n}" for n in range(len(ids))]  # plus at most what committed unprinted
        for n, group in enumerate(stored):
            episodes, advantages = writer_group(n)
            assert group.episodes == episodes and group.advantages == advantages  # whole, intact
            assert group.meta == {"n": n}
        with closing(sqlite3.connect(db)) as raw:  # no orphan episode rows from a cut-off transaction
            (n_rows,) = raw.execute("SELECT COUNT(*) FROM episodes").fetchone()
        assert n_rows == sum(len(g.episodes) for g in stored)


def test_groups_and_group_sizes_read_several_groups_at_once(store):
    for gid, tokens in (("a", 4), ("b", 8), ("c", 2)):
        episodes, adv = make_group(gid, [0.0, 1.0, 1.0], tokens=tokens, n_turns=2)
        store.add_group(episodes, adv)
    assert [g.group_id for g in store.groups(["c", "a", "c"])] == ["c", "a", "c"]  # the order asked
    assert [len(g.episodes) for g in store.groups(["b"])] == [3]
    # 3 episodes x 2 turns x tokens: from the index columns, no record decoded
    assert store.group_sizes(["a", "b", "c"]) == {"a": 24, "b": 48, "c": 12}
    with pytest.raises(KeyError, match="'zz'"):
        store.groups(["a", "zz"])
    with pytest.raises(KeyError, match="'zz'"):
        store.group_sizes(["zz"])
