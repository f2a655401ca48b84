"""Resume keeps consumption in step with the checkpoint: the store logs every consumption
per (group, step), a resumed run undoes those of steps after its checkpoint, and the dual cycle then
hands those groups out again, with admission neither stalling nor running unbounded. The kill and
resume benchmark (benchmarks/kill_resume.py) runs it end to end: `test_kill_resume_benchmark`."""

import heapq
import os
import random
import sqlite3
import subprocess
import sys
from contextlib import closing
from itertools import count
from pathlib import Path

import pytest
from replay_helpers import make_group

from reflow.policy.dual_cycle import AdmissionControl, CycleConfig
from reflow.replay import ReplayStore
from reflow.replay.planning import accepted_groups, consume, plan_batch
from reflow.replay.schema import SCHEMA_VERSION

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def store(tmp_path):
    s = ReplayStore(tmp_path / "replay.sqlite", run="r")
    yield s
    s.close()


def add(store, gid, spread=1.0, version=0):
    rewards = [0.0, spread] if spread else [1.0, 1.0]
    return store.add_group(*make_group(gid, rewards, version=version))


def state(store, gid):
    g = store.group(gid)
    return g.consumed, g.last_step


def test_rollback_undoes_the_consumptions_after_the_checkpoint_step(store):
    for gid in ("a", "b", "c", "d", "e", "flat"):
        add(store, gid, spread=0.0 if gid == "flat" else 1.0)
    store.mark_consumed(["a"], 1)
    store.mark_consumed(["b"], 2)
    store.mark_consumed(["c", "a"], 3)  # "a" replayed
    store.mark_consumed(["d", "b"], 4)  # "b" replayed after the checkpoint
    store.mark_consumed(["e", "flat"], 5)  # "flat" retired (zero spread)
    assert store.reuse_histogram() == {1: 4, 2: 2}
    assert store.rollback_consumption(3) == 4  # (d, 4), (b, 4), (e, 5), (flat, 5)
    assert [state(store, g) for g in "abcde"] == [(2, 3), (1, 2), (1, 3), (0, None), (0, None)]
    assert state(store, "flat") == (0, None)  # fresh again: the next plan retires it again
    assert [g.group_id for g in store.fresh()] == ["d", "e", "flat"]
    assert store.reuse_histogram() == {0: 3, 1: 2, 2: 1}
    assert store.reuse_histogram(spread=True) == {0: 2, 1: 2, 2: 1}
    assert store.count(consumed=True) == 3
    assert accepted_groups(store) == 5  # stored groups with spread: rollback does not change it
    assert [(g, s) for g, s, _ in store.consumptions()] == [("a", 1), ("b", 2), ("a", 3), ("c", 3)]
    # replay candidates follow the recounted uses: "b" has one use left of K = 2 again, "a" none
    found = store.replayable(current_version=3, tau_max=5, max_reuse=2)
    assert [g.group_id for g in found] == ["c", "b"]


def test_rollback_is_idempotent_and_to_zero_starts_consumption_over(store):
    for gid in ("a", "b"):
        add(store, gid)
    store.mark_consumed(["a", "b"], 1)
    store.mark_consumed(["a"], 2)
    assert store.rollback_consumption(2) == 0
    assert state(store, "a") == (2, 2)
    assert store.rollback_consumption(1) == 1 and store.rollback_consumption(1) == 0
    assert store.rollback_consumption(0) == 2
    assert store.count(consumed=False) == 2 and store.consumptions() == []
    store.mark_consumed(["a"], 1)  # the resumed run consumes at the same step numbers again
    assert state(store, "a") == (1, 1)
    with pytest.raises(ValueError, match="after_step"):
        store.rollback_consumption(-1)


def test_rollback_is_per_run(tmp_path):
    path = tmp_path / "replay.sqlite"
    with ReplayStore(path, run="r") as mine, ReplayStore(path, run="other") as other:
        add(mine, "m")
        add(other, "o")
        mine.mark_consumed(["m"], 5)
        other.mark_consumed(["o"], 5)
        mine.rollback_consumption(0)
        assert state(mine, "m") == (0, None) and state(other, "o") == (1, 5)


def test_mark_consumed_logs_each_step_once(store):
    add(store, "a")
    add(store, "b")
    store.mark_consumed(["a", "a", "b"], 7)  # listed twice: one use
    assert [(g, s) for g, s, _ in store.consumptions()] == [("a", 7), ("b", 7)]
    with pytest.raises(ValueError, match="already consumed by step 7"):
        store.mark_consumed(["b", "a"], 7)
    assert state(store, "a") == (1, 7) and state(store, "b") == (1, 7)  # the failed call changed nothing
    store.mark_consumed(["a"], 3)  # an older step (e.g. a test driving steps by hand): last_step stays
    assert state(store, "a") == (2, 7)


def test_a_version_1_file_gets_its_consumption_log_on_open(tmp_path):
    path = tmp_path / "replay.sqlite"
    with ReplayStore(path, run="r") as s:
        for gid in ("once", "twice", "never"):
            add(s, gid)
        s.mark_consumed(["once", "twice"], 2)
        s.mark_consumed(["twice"], 5)
    with closing(sqlite3.connect(path)) as db:  # what version 1 wrote: counts, no log
        db.execute("DROP TABLE consumptions")
        db.execute("PRAGMA user_version=1")
        db.commit()
    with ReplayStore(path, run="r") as s:
        # the last use at last_step, the earlier ones at the latest steps they can have been
        assert [(g, st) for g, st, _ in s.consumptions()] == [("once", 2), ("twice", 4), ("twice", 5)]
        assert s.rollback_consumption(4) == 1
        assert state(s, "once") == (1, 2) and state(s, "twice") == (1, 4) and state(s, "never") == (0, None)
    with closing(sqlite3.connect(path)) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION


def test_max_meta_is_the_last_task_seed(store):
    assert store.max_meta("seed") is None
    for i, seed in enumerate([4, 17, 9]):
        store.add_group(*make_group(f"g{i}", [0.0, 1.0]), meta={"seed": seed, "worker": 0})
    assert store.max_meta("seed") == 17
    with pytest.raises(ValueError, match="identifier"):
        store.max_meta("seed') OR 1=1 --")


def _decoupled_run(store, *, B, eta, steps, version, kill_at, rng, allow_replay, names):
    """The decoupled loop's data path by hand (admission, plan-and-consume before training, groups that
    arrive in random order), from `version` until `steps`, or until the step `kill_at` has been planned
    (the crash). Asserts that it never stalls: with nothing in flight a batch can always be planned."""
    adm, cfg = AdmissionControl(eta, B), CycleConfig(tau_max=3, max_reuse=2)
    running: list[tuple[float, str]] = []
    now = 0.0
    while version < steps:
        while True:  # admission as decoupled_loop counts it: groups with spread not yet trained
            uses = store.reuse_histogram(spread=True)
            accepted, trained = sum(uses.values()), sum(uses.values()) - uses.get(0, 0)
            assert accepted + store.in_flight() <= (eta + 1) * B + trained, "generation ran past the bound"
            if len(running) == 3 * B or not adm.may_start(version, accepted, store.in_flight(), trained):
                break
            gid = f"g{next(names)}"
            store.begin_group(gid, version)
            heapq.heappush(running, (now + rng.uniform(0.1, 3.0), gid))
        plan = plan_batch(
            store, want=B, current_version=version, share=0.5, cfg=cfg, allow_replay=allow_replay
        )
        if plan.size == B:
            consume(store, plan, step=version + 1)  # marked before the step trains, as the service does
            if version + 1 == kill_at:
                return version
            version += 1
            continue
        assert running, "nothing in flight and no batch: the resumed run stalls"
        now, gid = heapq.heappop(running)
        spread = 0.0 if rng.random() < 0.25 else 1.0
        add(store, gid, spread=spread, version=version)
    return version


@pytest.mark.parametrize("mode", ["async", "reflow"])
@pytest.mark.parametrize("seed", range(4))
def test_a_resumed_decoupled_run_trains_every_group_and_admission_stays_bounded(store, mode, seed):
    rng, B, eta, checkpoint_every = random.Random(seed), 3, 1, 3
    kill_at, common = rng.randint(4, 8), {"rng": rng, "allow_replay": mode == "reflow", "names": count()}
    _decoupled_run(store, B=B, eta=eta, steps=12, version=0, kill_at=kill_at, **common)
    restored = (kill_at - 1) // checkpoint_every * checkpoint_every  # the last checkpoint before the crash
    store.clear_in_flight()
    store.rollback_consumption(restored)
    assert {s for _, s, _ in store.consumptions()} <= set(range(1, restored + 1))
    if mode == "async":  # each step up to the checkpoint consumed B groups with spread, once each
        assert store.reuse_histogram(spread=True).get(1, 0) == restored * B
    _decoupled_run(store, B=B, eta=eta, steps=12, version=restored, kill_at=0, **common)
    log = store.consumptions()
    assert {s for _, s, _ in log} == set(range(1, 13))
    uses: dict[str, int] = {}
    for gid, _, _ in log:
        uses[gid] = uses.get(gid, 0) + 1
    for g in store.fresh() + store.replayable(current_version=99, tau_max=99, max_reuse=99):
        assert g.consumed == uses.get(g.group_id, 0)  # the columns agree with the log
        assert g.consumed <= (1 if mode == "async" else 2)


@pytest.mark.slow
def test_kill_resume_benchmark(tmp_path):
    """One kill per mode, then resume to the end: nothing lost, nothing trained too often (the default
    10 kills per mode are in docs/results.md)."""
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "kill_resume.py"),
            "--kills=1",
            "--steps=6",
            f"--out={tmp_path}",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    import json

    results = json.loads((tmp_path / "kill_resume.json").read_text())
    assert [r["mode"] for r in results] == ["sync", "async", "reflow"]
    for r in results:
        assert r["kills"] == 1 and r["completed"]
        assert r["lost"] == 0 and r["over_trained"] == 0 and r["stale_log_rows"] == 0
        assert r["dead_trained"] == 0 and r["quarantine_mismatch"] == 0  # lost weights' groups never train
        assert r["trained"] > 0 and r["acknowledged"] >= r["trained"]


@pytest.mark.parametrize(
    ("overrides", "kept"),
    [
        ([], False),  # the elastic pool's layout comes back
        (["elastic.min_rollout=2"], True),  # below the new minimum: the policy would refuse it
    ],
)
def test_a_resume_takes_the_saved_slot_layout_only_where_the_elastic_pool_may_hold_it(
    tmp_path, overrides, kept
):
    import json

    from reflow.config import load_config
    from reflow.recipes.checkpoints import resumed_config
    from reflow.train.trainer_state import STATE_FILE

    slots = ["rollout", "rollout", "train"]
    config = load_config(
        None, ["env.id=reflow/Calc-v0", "mode=reflow", f"resources.slots={slots}", *overrides]
    )
    saved = ["rollout", "train", "train"]  # the elastic pool had moved one slot to training
    ckpt = tmp_path / "step-000004"
    ckpt.mkdir()
    state = {"step": 4, "version": 4, "extra": {"run_state": {"scheduler": {"roles": saved}}}}
    (ckpt / STATE_FILE).write_text(json.dumps(state))
    assert resumed_config(config, ckpt).resources.slots == (slots if kept else saved)


def test_a_sync_resume_takes_up_the_groups_one_version_old_only_with_tail_handling(store, monkeypatch):
    """With partial rollouts carried over a step (sync mode's tail handling), groups finished after
    the checkpoint hold tokens one version older than its weights, and the groups done beyond a step's
    B are that old too: a resume trains them first. Without it they stay in the store untrained."""
    from types import SimpleNamespace

    import reflow.recipes.checkpoints as checkpoints
    from reflow.recipes.run_state import RunState

    for gid, version in [("old", 2), ("carried", 3), ("fresh", 4)]:
        add(store, gid, version=version)
    remote = SimpleNamespace(
        fresh=SimpleNamespace(remote=store.fresh), groups=SimpleNamespace(remote=store.groups)
    )
    monkeypatch.setattr(checkpoints.ray, "get", lambda value: value)  # the store is here, not an actor
    cluster, at = SimpleNamespace(replay=remote), RunState(step=4, version=4)
    assert [r.group_id for r in checkpoints.leftover_groups(cluster, at)] == ["fresh"]
    assert [r.group_id for r in checkpoints.leftover_groups(cluster, at, carried=True)] == [
        "carried",
        "fresh",
    ]
