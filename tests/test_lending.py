"""Lending on Ray: an engine beside the trainer takes groups while the trainer waits and yields when a
step starts. First a lent worker's yield on a real TorchEngine (it stops decoding within one step and
its episodes resume on newer weights, none lost), then a real `agent-train` run in mode reflow with
`elastic.lend` that trains the lent engine's groups with their per-token versions, losing no group."""

from __future__ import annotations

import asyncio
import os
import sqlite3
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from run_helpers import PARITY_ENV, QUICK_RUN, SMALL_ROLLOUT, TINY_MODEL, train_and_read

TESTS = Path(__file__).parent


class _Store:
    """What a rollout worker calls on the replay-store actor, in-process: the groups it stores."""

    def __init__(self) -> None:
        self.groups: list[list] = []
        self.add_group = SimpleNamespace(remote=self._add)
        self.end_group = SimpleNamespace(remote=self._end)

    async def _add(self, records, advantages, meta=None) -> None:
        self.groups.append(records)

    async def _end(self, group_id) -> None:
        pass


async def _steps(worker) -> int:
    return (await worker.engine.health())["steps"]


def _worker_setup(tmp_path):
    """A reflow config on the parity env (groups of 4, long answers) and a one-layer tiny model."""
    import sys

    from reflow.config import load_config
    from reflow.models import build_tiny

    model_dir = str(build_tiny(tmp_path / "m", num_hidden_layers=1, hidden_size=32, intermediate_size=64))
    config = load_config(
        None,
        [
            *PARITY_ENV,
            f"out_dir={tmp_path}",
            "mode=reflow",
            "rollout.group_size=4",
            "rollout.max_new_tokens=400",
            "rollout.max_context_tokens=512",
            "rollout.temperature=1.0",
        ],
    )
    sys.path.insert(0, str(TESTS))  # the parity env's plugin module
    return config, model_dir


async def test_a_lent_worker_stops_decoding_within_one_step_and_its_episodes_resume_on_new_weights(tmp_path):
    from reflow.runtime.workers import RolloutWorker

    config, model_dir = _worker_setup(tmp_path)
    store = _Store()
    worker = RolloutWorker(config, model_dir, replay=store, index=3)
    try:
        group = asyncio.ensure_future(worker.generate([7]))
        for _ in range(500):  # until the engine has decoded a few steps of the group
            if await _steps(worker) >= 5:
                break
            await asyncio.sleep(0.01)
        assert (await worker.engine.health())["running"] > 0
        assert await worker.pause_episodes() == 4
        at_yield = await _steps(worker)
        await asyncio.sleep(0.5)  # the trainer's step: the engine must not decode meanwhile
        health = await worker.engine.health()
        assert health["steps"] - at_yield <= 1, "the lent engine went on decoding after yielding"
        assert health["running"] == 0 and not group.done()
        # the step's weights arrive while paused (the same weights, a new version: what is tested is
        # the per-token version of what the episodes generate after the resume)
        assert await worker.update_weights(worker.engine.model.state_dict(), 1) == 1
        await worker.resume_episodes()
        report = (await asyncio.wait_for(group, 120))[0]
    finally:
        await worker.close()
    # no episode lost: the group is whole and stored, and its episodes span both versions
    assert len(report.rewards) == 4 and len(store.groups) == 1 and len(store.groups[0]) == 4
    records = store.groups[0]
    assert all(r.status != "infra_error" for r in records)
    spanning = [r for r in records if r.policy_version_start < r.policy_version_end]
    assert spanning, [(r.policy_version_start, r.policy_version_end, r.n_generated_tokens) for r in records]
    for r in spanning:
        versions = [v for turn in r.turns for v in turn.token_versions]
        assert versions == sorted(versions) and set(versions) == {0, 1}


async def test_a_lent_worker_hands_its_episodes_to_a_rollout_engine_with_room_instead_of_pausing(tmp_path):
    """At a step's start a lent engine yields; what a rollout engine has room for moves there and goes
    on generating through the step (the lent engine decodes nothing more), so a paused lent group does
    not hold admission's room idle. Its group is whole, its tokens carry both engines' versions."""
    from migration_helpers import _Method

    from reflow.runtime.workers import RolloutWorker

    config, model_dir = _worker_setup(tmp_path)
    store = _Store()
    lent = RolloutWorker(config, model_dir, replay=store, index=3)
    rollout = RolloutWorker(config, model_dir, replay=_Store(), index=0)
    handle = SimpleNamespace(
        engine_generate=_Method(rollout.engine_generate), engine_abort=_Method(rollout.engine_abort)
    )
    try:
        # the rollout engine has the newer weights (same values, version 1): tokens tell the engines apart
        assert await rollout.update_weights(rollout.engine.model.state_dict(), 1) == 1
        group = asyncio.ensure_future(lent.generate([7]))
        for _ in range(500):  # until the lent engine has decoded a few steps of the group
            if await _steps(lent) >= 5:
                break
            await asyncio.sleep(0.01)
        out = await lent.yield_episodes(handle, "w0", 3)  # room for three on the rollout engine
        (gid,) = out["moved"]
        assert (out["moved"], out["home"], out["paused"]) == ({gid: 3}, {gid: 1}, 1)
        at_yield, rollout_at_yield = await _steps(lent), await _steps(rollout)
        await asyncio.sleep(0.5)  # the trainer's step: the lent engine must not decode meanwhile
        assert await _steps(lent) - at_yield <= 1, "the lent engine went on decoding after yielding"
        assert await _steps(rollout) > rollout_at_yield, "the handed-over episodes did not go on"
        assert not group.done()  # one episode waits paused
        await lent.resume_episodes()
        report = (await asyncio.wait_for(group, 120))[0]
    finally:
        await lent.close()
        await rollout.close()
    assert len(report.rewards) == 4 and len(store.groups) == 1 and len(store.groups[0]) == 4
    records = store.groups[0]
    assert all(r.status != "infra_error" for r in records)
    versions = [sorted({v for turn in r.turns for v in turn.token_versions}) for r in records]
    # three episodes finished on the rollout engine (version 1) after starting on the lent one (they
    # had generated tokens there: the engine had decoded 5 steps of the group)
    assert sum(v == [0, 1] for v in versions) >= 3, versions


@pytest.mark.slow
def test_a_reflow_run_with_lending_trains_the_lent_engines_groups_and_loses_none(tmp_path, monkeypatch):
    from reflow.replay import ReplayStore

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    summary, rows = train_and_read(
        [
            *PARITY_ENV,
            *TINY_MODEL,
            *SMALL_ROLLOUT,
            *QUICK_RUN,
            f"out_dir={tmp_path}",
            "run_name=lend",
            "mode=reflow",
            "train.steps=8",
            "elastic.lend=true",
            "rollout.max_new_tokens=24",
            "rollout.stop=[]",
        ]
    )
    steps = [r for r in rows if r["kind"] == "step"]
    assert summary["steps"] == 8 and len(steps) == 8
    # the lent engine (index 3: after the two slots) generated groups, yielded at step starts, and its
    # generating seconds are counted
    assert summary["lent_busy_s"] > 0 and summary["lent_yields"] > 0
    # the slot's idle share counts the lent generation that ended in stored groups
    assert 0 < summary["lent_stored_s"] <= summary["lent_busy_s"]
    assert summary["train_slot_idle_ratio"] < summary["trainer_idle_ratio"]
    with ReplayStore(tmp_path / "lend" / "replay.sqlite", "lend") as store:
        assert store.integrity_check() == "ok"
        arrived = sum(r["groups_generated"] for r in rows if r["kind"] in ("step", "no_signal"))
        assert store.count() >= arrived
        records = list(store.episodes())
    with sqlite3.connect(tmp_path / "lend" / "replay.sqlite") as db:  # which worker made each group
        query = "SELECT group_id FROM groups WHERE json_extract(meta, '$.worker') = 3"
        lent_groups = {row[0] for row in db.execute(query)}
    assert lent_groups, "no group came from the lent engine"
    by_group: dict[str, list] = {}
    for r in records:
        by_group.setdefault(r.group_id, []).append(r)
    assert all(len(eps) == 4 for eps in by_group.values())
    assert all(r.status != "infra_error" for r in records)
    # every hand-over at a step start is logged and counted, with the groups it moved episodes of; the
    # episodes went on there and were stored as migrated (a group is stored once all its episodes end,
    # and the run does not wait for groups in flight at its end, so the groups stored are checked).
    # Whether a yield finds a lent episode in flight, and whether the rollout engine has room for it,
    # is timing (a run may see neither): test_a_lent_worker_stops_decoding_... and
    # test_a_lent_worker_hands_its_episodes_... show pausing and handing over deterministically
    handed = [r for r in rows if r["kind"] == "elastic" and r["what"] == "lent_hand_over"]
    assert summary["lent_handed_over"] == sum(e["episodes"] for e in handed)
    assert all(sum(e["groups"].values()) == e["episodes"] for e in handed)
    moved: dict[str, int] = {}
    for e in handed:
        for gid, n in e["groups"].items():
            moved[gid] = moved.get(gid, 0) + n
    assert all(gid in lent_groups for gid in moved if gid in by_group)  # only lent groups are handed over
    for gid, n in moved.items():  # (an episode moves twice only after a fallback home: a role change)
        if gid in by_group and not summary["role_changes"]:
            migrated = sum(1 for r in by_group[gid] if r.timings.get("migrations", 0) > 0)
            assert migrated >= n, (gid, n, migrated)
    # a hand-over falls back home only when its target left (a role change), never by a failure here
    outcomes = {r["outcome"] for r in rows if r.get("what") == "lent_migration_measured"}
    assert outcomes <= {"ok", "ended", "superseded"} or summary["role_changes"] > 0, outcomes
    # the engine versions never go backwards (a lent group's staleness bound is
    # test_a_lent_engine_kept_paused_by_back_to_back_steps_runs_on_once_its_group_passes_the_bound's)
    versions = [s["engine_version"] for s in steps]
    assert versions == sorted(versions)


class _Recorder:
    """A lent engine's pause/resume calls, as a Ray actor records them."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def pause_episodes(self) -> int:
        self.calls.append("pause")
        return 1

    def resume_episodes(self) -> None:
        self.calls.append("resume")

    def update_weights(self, state_dict, version: int) -> int:
        self.calls.append(f"weights v{version}")
        return version

    def yield_episodes(self, target=None, target_name: str = "", n: int = 0, version=None) -> dict:
        """A worker whose engine runs only group "g" (4 episodes): hands `n` of them over (once), the
        rest pause; reports what runs where, as `RolloutWorker.yield_episodes`."""
        self.calls.append(f"hand {n} to {target_name} ({target})" if n else "pause")
        self.moved = getattr(self, "moved", 0) + min(n, 4 - getattr(self, "moved", 0))
        self.where = target_name or getattr(self, "where", "w0")
        home = 4 - self.moved
        return {"moved": {"g": min(n, 4)} if n else {}, "paused": int(home > 0), **self.lent_report()}

    def lent_report(self) -> dict:
        moved, over = getattr(self, "moved", 0), getattr(self, "over", 0)  # over: ended on the target
        home = 4 - moved
        away = {"g": {self.where: moved - over}} if moved - over else {}
        return {"home": {"g": home} if home else {}, "away": away, "migrations": []}

    def finish_on_target(self, k: int) -> None:
        """`k` of the handed-over episodes ended there."""
        self.over = getattr(self, "over", 0) + k

    def fall_back(self) -> None:
        """The handed-over episodes still running fell back home (their target went)."""
        self.moved = self.over = 0

    def log(self) -> list[str]:
        return self.calls


@pytest.fixture
def local_ray(monkeypatch):
    import ray

    # the workers import this module (the recording actor) from the tests folder
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    ray.init(address="local", num_cpus=1, include_dashboard=False)
    yield ray
    ray.shutdown()


def test_a_lent_engine_kept_paused_by_back_to_back_steps_runs_on_once_its_group_passes_the_bound(
    local_ray,
):
    """A trainer that never waits (replay fills every batch) never resumes a lent engine: at each step
    start the engine's oldest group is checked against eta, paused engines too."""
    from reflow.runtime.lending import LentEngines

    ray = local_ray
    actor = ray.remote(_Recorder).options(num_cpus=0).remote()
    lent = LentEngines(SimpleNamespace(lent=[actor], rollout=[], rollout_slots=[]), per_engine=2, eta=1)
    lent.started("group-a", 0, version=4)
    assert lent.pause(4) == [] and lent.paused == {0}  # step 5 starts: the engine yields
    assert not lent.beside_step
    assert lent.pause(5) == [] and lent.paused == {0}  # step 6: one version old, still paused
    events = lent.pause(6)  # step 7: two versions old with eta 1: it runs on beside the step
    assert [e["what"] for e in events] == ["lent_runs_on"] and lent.paused == set()
    assert ray.get(actor.log.remote()) == ["pause", "resume"]
    assert (lent.pauses, lent.ran_on) == (1, 1) and lent.beside_step  # the elastic driver reads it
    assert lent.free() is not None  # it has room for a second group (the loop starts none mid-step)
    assert lent.done("group-a") and lent.in_flight == 0 and not lent.done("group-a")


def test_lent_time_after_an_engines_last_stored_group_counts_as_idle(monkeypatch):
    """`stored_s`: the lent seconds that ended in a stored group; a group cancelled at the run's end
    produced nothing, so the time spent on it after the last stored group is idle (the train slot's
    idle ratio counts `stored_s`). A resumed run continues both counters."""
    import reflow.runtime.lending as lending

    now = [100.0]
    monkeypatch.setattr(lending.time, "monotonic", lambda: now[0])
    state = SimpleNamespace(lent_busy_s=5.0, lent_stored_s=4.0, lent_yields=0, lent_handed_over=0)
    lent = lending.LentEngines(SimpleNamespace(lent=[object(), object()]), per_engine=2, eta=1, state=state)
    lent.started("a", 0, version=0)
    lent.started("b", 1, version=0)
    now[0] = 103.0
    assert lent.done("a")  # engine 0: 3 s, stored
    now[0] = 104.0
    lent.started("c", 0, version=0)  # engine 0 generates again from 104
    now[0] = 110.0  # the run ends: c (6 s) and b (10 s) never stored
    assert lent.busy_s() == pytest.approx(5.0 + 3.0 + 6.0 + 10.0)
    assert lent.stored_s() == pytest.approx(4.0 + 3.0)
    assert lent.done("b")  # engine 1's group came in after all: its 10 s produced a stored group
    assert lent.stored_s() == pytest.approx(4.0 + 3.0 + 10.0)


def test_a_lent_engine_running_on_beside_a_step_adds_no_stored_time_the_step_holds(local_ray, monkeypatch):
    """A lent engine that runs on through a train step shares the slot with the trainer: those seconds
    count in its busy time but not in `stored_s` (the trainer's step time has them), so the train
    slot's idle ratio counts them once."""
    import reflow.runtime.lending as lending

    ray = local_ray
    now = [100.0]
    monkeypatch.setattr(lending.time, "monotonic", lambda: now[0])
    actor = ray.remote(_Recorder).options(num_cpus=0).remote()
    lent = lending.LentEngines(
        SimpleNamespace(lent=[actor], rollout=[], rollout_slots=[]), per_engine=2, eta=0
    )
    lent.started("a", 0, version=3)
    now[0] = 104.0  # 4 s while the trainer waits
    assert [e["what"] for e in lent.pause(4)] == ["lent_runs_on"]  # past eta: it runs on
    now[0] = 110.0  # 6 s beside the step
    lent.step_done()  # the step's result is in; the loop's bookkeeping (checkpoint, evaluation) follows
    now[0] = 111.0
    lent.resume()  # the trainer waits again
    now[0] = 112.0  # 2 s more while it waits
    assert lent.done("a")
    assert lent.busy_s() == pytest.approx(12.0) and lent.stored_s() == pytest.approx(6.0)


def test_a_resumed_run_gives_the_lent_engines_its_weights_too(local_ray):
    """A resume loads the checkpoint's weights into every engine with its version: a lent engine left
    at version 0 would tag its tokens 0 (wrong staleness, replay and lineage bookkeeping)."""
    from reflow.recipes.weight_sync import sync_weights

    ray = local_ray
    worker, lent = (ray.remote(_Recorder).options(num_cpus=0).remote() for _ in range(2))
    cluster = SimpleNamespace(
        rollout=[worker], lent=[lent], engines=[worker, lent], state_dict_ref=lambda: ray.put({})
    )
    sync_weights(cluster, 20)
    assert ray.get(lent.log.remote()) == ["weights v20"] == ray.get(worker.log.remote())


def test_the_elastic_driver_keeps_the_policys_lend_window_from_the_loops_steps():
    """What lending costs is read over the steps since the last change (`LendWindow`), not one step:
    the driver adds each step's train seconds and trained tokens alone or beside a lent engine (its
    `beside_step`), with the seconds the yield took before it, from the loop's counters (a resumed
    run's earlier seconds are not this window's), and starts the window afresh after a change."""
    from reflow.config import load_config
    from reflow.recipes.run_state import RunState
    from reflow.runtime.elastic import ElasticDriver

    config = load_config(None, [*PARITY_ENV, *TINY_MODEL, *SMALL_ROLLOUT, "mode=reflow", "elastic.lend=true"])
    group = config.rollout.group_size
    state = RunState(trainer_busy_s=7.0, trained_tokens=900.0)  # a resumed run's counters so far
    lent = SimpleNamespace(
        beside_step=False, yield_s=0.0, busy_s=lambda: 0.0, state_dict=dict, load_state_dict=lambda s: None
    )
    driver = ElasticDriver(None, config, state, 0.0, lent)
    assert ElasticDriver(None, config, state, 0.0).window is None  # no lending: no window
    for seconds, tokens, beside, yield_s in ((2.0, 100.0, False, 0.1), (4.0, 150.0, True, 0.0)):
        lent.beside_step, lent.yield_s = beside, yield_s
        state.trainer_busy_s += seconds
        state.trained_tokens += tokens
        driver.stepped(2, state)
    w = driver.window
    assert (w.alone_s, w.alone_tokens, w.alone_samples, w.yield_s) == (2.0, 100.0, 2 * group, 0.1)
    assert (w.beside_s, w.beside_tokens) == (4.0, 150.0)
    assert w.alone_rate(1) == pytest.approx(group) and w.slowdown() == pytest.approx(1 - 250 / 6.1 / 50)
    # a checkpoint keeps the window and the policy's last measured slowdown
    driver.runtime.policy.lend_slowdown = 0.2
    resumed = ElasticDriver(None, config, state, 0.0, lent)
    resumed.load_state_dict(driver.state_dict())
    assert resumed.window.entries == w.entries and resumed.runtime.policy.lend_slowdown == 0.2
    # at a boundary the runtime gets the window; a hold keeps it, a change starts it afresh
    got: list = []

    def boundary(what):
        def at_boundary(interval, **kw):
            got.append(kw["lend_window"])
            return {"what": what}, None

        return at_boundary

    for what, kept in (("hold", 2.0), ("reclaim", 0.0)):
        driver.runtime = SimpleNamespace(at_boundary=boundary(what))
        driver.at_boundary(state, 10.0, 0.0, replay_share=0.0, fresh_waiting=0, in_flight={})
        assert got[-1] is w and w.alone_s == kept


def test_a_lent_engine_whose_group_went_to_a_rollout_engine_counts_it_there_and_not_as_its_own(
    local_ray, monkeypatch
):
    """A yield that hands a whole group over: the rollout engine's load counts its 4 episodes until the
    group is done (the next yield and the tail gate see the room taken); the lent engine's busy clock
    stays stopped at the resume (the train slot's idle share must not count the rollout engine's work);
    at the next step start the group, past eta, makes no run-on (none of it is on the lent engine),
    and the engine is paused all the same (an episode that fell back home would wait)."""
    import reflow.runtime.lending as lending

    ray = local_ray
    now = [100.0]
    monkeypatch.setattr(lending.time, "monotonic", lambda: now[0])
    actor = ray.remote(_Recorder).options(num_cpus=0).remote()
    cluster = SimpleNamespace(lent=[actor], rollout=["rollout-0"], rollout_slots=[SimpleNamespace(index=5)])
    lent = lending.LentEngines(cluster, per_engine=2, eta=0, group_size=4)
    lent.started("ref-g", 0, version=3, group_id="g")
    now[0] = 104.0  # 4 s generating while the trainer waited
    events = lent.pause(3, free=[64])  # the rollout engine has room for all 4 episodes
    assert [e["what"] for e in events] == ["lent_hand_over"] and lent.handed_over == 4
    assert ray.get(actor.log.remote()) == ["hand 4 to w5 (rollout-0)"]
    assert lent.served_loads() == [4]
    now[0] = 110.0
    lent.resume()
    now[0] = 120.0
    assert lent.busy_s() == pytest.approx(4.0)
    assert lent.pause(5, free=[60]) == [] and not lent.beside_step and lent.ran_on == 0
    assert ray.get(actor.log.remote())[-2:] == ["resume", "pause"]
    assert lent.done("ref-g") and lent.served_loads() == [0] and lent.away == set()


def test_a_lent_engine_still_paused_at_the_next_step_hands_over_once_a_rollout_engine_has_room(local_ray):
    """Back-to-back steps (the trainer never waits): the lent engine paused at the first step start,
    when the rollout engine had no room, is not resumed; at the next start the rollout engine has room
    and the paused group is handed over there (the engine is not paused again)."""
    from reflow.runtime.lending import LentEngines

    ray = local_ray
    actor = ray.remote(_Recorder).options(num_cpus=0).remote()
    cluster = SimpleNamespace(lent=[actor], rollout=["rollout-0"], rollout_slots=[SimpleNamespace(index=0)])
    lent = LentEngines(cluster, per_engine=2, eta=3, group_size=4)
    lent.started("ref-g", 0, version=3, group_id="g")
    assert lent.pause(3, free=[0]) == [] and lent.paused == {0}  # no room: it pauses
    events = lent.pause(4, free=[8])  # still paused; now room for its 4 episodes
    assert [e["what"] for e in events] == ["lent_hand_over"] and lent.pauses == 1
    assert ray.get(actor.log.remote()) == ["pause", "hand 4 to w0 (rollout-0)"]
    assert lent.pause(5, free=[8]) == []  # nothing left on it: no call at all
    assert ray.get(actor.log.remote()) == ["pause", "hand 4 to w0 (rollout-0)"]


def test_a_lent_engine_hands_over_only_to_a_rollout_engine_whose_weights_are_no_older(local_ray):
    """The rollout engine still loads version 3 while the lent engine has 4: the group pauses (its
    tokens would go back a version there, past what admission counted); once the rollout engine
    confirms 4 the paused group goes there at the next step start."""
    from reflow.runtime.lending import LentEngines

    ray = local_ray
    actor = ray.remote(_Recorder).options(num_cpus=0).remote()
    cluster = SimpleNamespace(lent=[actor], rollout=["rollout-0"], rollout_slots=[SimpleNamespace(index=0)])
    lent = LentEngines(cluster, per_engine=2, eta=3, group_size=4)
    lent.started("ref-g", 0, version=4, group_id="g")
    # confirmed versions in Cluster.engines' order: the rollout worker, then the lent engine
    assert lent.pause(4, free=[8], confirmed=[3, 4]) == [] and lent.paused == {0}
    assert ray.get(actor.log.remote()) == ["pause"] and lent.handed_over == 0
    events = lent.pause(5, free=[8], confirmed=[4, 4])
    assert [e["what"] for e in events] == ["lent_hand_over"] and lent.handed_over == 4
    assert ray.get(actor.log.remote()) == ["pause", "hand 4 to w0 (rollout-0)"]


def test_a_refresh_drops_served_episodes_that_ended_and_counts_a_fallback_home_on_its_engine(
    local_ray, monkeypatch
):
    """Between yields the served loads follow the lent engine's reports (at most every `refresh_s`):
    handed-over episodes that ended free their rollout engine's room; episodes that fell back home
    (their target left) count on the lent engine again: its busy clock runs (it is not paused) and,
    past eta at the next step start, it runs on."""
    import reflow.runtime.lending as lending

    ray = local_ray
    now = [100.0]
    monkeypatch.setattr(lending.time, "monotonic", lambda: now[0])
    actor = ray.remote(_Recorder).options(num_cpus=0).remote()
    cluster = SimpleNamespace(lent=[actor], rollout=["rollout-0"], rollout_slots=[SimpleNamespace(index=0)])
    lent = lending.LentEngines(cluster, per_engine=2, eta=1, group_size=4, refresh_s=1.0)
    lent.started("ref-g", 0, version=3, group_id="g")
    assert [e["what"] for e in lent.pause(3, free=[8])] == ["lent_hand_over"]
    lent.resume()  # the trainer waits again; nothing of the group is on the lent engine
    assert lent.served_loads() == [4] and lent.loads() == [0] and not lent._busy.running(0)
    ray.get(actor.finish_on_target.remote(3))
    now[0] = 100.5
    assert lent.refresh() == [] and lent.served_loads() == [4]  # too soon: no call
    now[0] = 101.0
    lent.refresh()
    assert lent.served_loads() == [1]
    ray.get(actor.fall_back.remote())  # the target left: the group's episodes are home again
    now[0] = 102.0
    lent.refresh()
    assert lent.served_loads() == [0] and lent.away == set() and lent.loads() == [1]
    assert lent._busy.running(0)  # it generates them (not paused)
    now[0] = 104.0
    assert lent.busy_s() == pytest.approx(2.0)
    events = lent.pause(5)  # started on 3, eta 1: past the bound at step 6, it runs on
    assert [e["what"] for e in events] == ["lent_runs_on"]


def test_a_lent_group_not_reported_yet_counts_whole_at_home_and_one_reported_done_counts_away(local_ray):
    """A group launched just before a yield has no episode open yet: it stays whole in the plan's
    demand (a paused engine hands it over at the next start); a group reported before and absent now
    (its episodes all ended, its report not in yet) holds no room on its engine."""
    from reflow.runtime.lending import LentEngines

    cluster = SimpleNamespace(lent=[None], rollout=[], rollout_slots=[])
    lent = LentEngines(cluster, per_engine=2, eta=1, group_size=4)
    lent.started("ref-new", 0, version=3, group_id="new")
    lent.started("ref-old", 0, version=3, group_id="old")
    lent._book(0, {"home": {"old": 2}, "away": {}}, {})
    assert lent._at_home(0) == 4 + 2 and lent.loads() == [2]
    lent._book(0, {"home": {}, "away": {}}, {})  # old's episodes ended; new still not open
    assert lent._at_home(0) == 4 and lent.away == {"ref-old"} and lent.loads() == [1]


class _Reports:
    """A lent worker whose reports the test sets (`RolloutWorker.lent_report`'s shape); counts them."""

    def __init__(self) -> None:
        self.report: dict = {"home": {}, "away": {}, "migrations": []}
        self.asked = 0

    def set(self, report: dict) -> None:
        self.report = {"home": {}, "away": {}, "migrations": [], **report}

    def lent_report(self) -> dict:
        self.asked += 1
        if getattr(self, "slow", False):
            time.sleep(2)  # longer than the timeout the test sets
        out, self.report = self.report, {**self.report, "migrations": []}  # drained once reported
        return out

    def yield_episodes(self, *target) -> dict:
        return {"moved": {}, "paused": 0, **self.lent_report()}

    def resume_episodes(self) -> None:
        pass

    def count(self) -> int:
        return self.asked

    def slow_report(self) -> None:
        self.slow = True


def _reporting(ray, **kw):
    from reflow.runtime.lending import LentEngines

    actor = ray.remote(_Reports).options(num_cpus=0).remote()
    cluster = SimpleNamespace(lent=[actor], rollout=["rollout-0"], rollout_slots=[SimpleNamespace(index=0)])
    return actor, LentEngines(cluster, per_engine=2, group_size=4, **kw)


def test_an_engine_running_on_whose_group_falls_back_home_counts_its_seconds_beside_the_step(local_ray):
    """Group a went to a rollout engine at an earlier yield; group r, at home, takes its engine past
    the bound: it runs on. r ends (the clocks stop); an episode of a falls back home during the same
    step: the busy clock runs again and so does the beside-the-step clock (those seconds are the
    step's too, not the lent engine's stored generation)."""
    ray = local_ray
    actor, lent = _reporting(ray, eta=0)
    lent.started("ref-a", 0, version=0, group_id="a")
    lent.started("ref-r", 0, version=0, group_id="r")
    ray.get(actor.set.remote({"home": {"r": 4}, "away": {"a": {"w0": 4}}}))
    lent.refresh(force=True, ask={0})
    assert lent.away == {"ref-a"} and lent.served_loads() == [4]
    assert [e["what"] for e in lent.pause(1)] == ["lent_runs_on"]  # its report was asked first
    assert ray.get(actor.count.remote()) == 2 and lent._beside.running(0)
    ray.get(actor.set.remote({"away": {"a": {"w0": 4}}}))  # r's episodes ended
    lent.refresh(force=True)
    assert not lent._busy.running(0) and not lent._beside.running(0)
    ray.get(actor.set.remote({"home": {"a": 1}, "away": {"a": {"w0": 3}}}))  # a's target left
    lent.refresh(force=True)
    assert lent._busy.running(0) and lent._beside.running(0)
    lent.step_done()
    assert not lent._beside.running(0)


def test_an_engine_is_asked_for_its_hand_overs_measurements_after_its_group_is_done(local_ray):
    """The group's last handed-over episodes end and its result reaches the loop before the lent
    worker's next report: that report (their migrations' outcomes) is still asked for, once."""
    ray = local_ray
    actor, lent = _reporting(ray, eta=3)
    lent.started("r", 0, version=0, group_id="g")
    ray.get(actor.set.remote({"away": {"g": {"w0": 4}}}))
    lent.refresh(force=True, ask={0})  # as a yield's report: the group went to the rollout engine
    assert lent.wake_s() == lent.refresh_s  # the loop wakes to refresh
    assert lent.done("r")
    ray.get(actor.set.remote({"migrations": [{"episode": "e1", "outcome": "ended"}]}))
    events = lent.refresh(force=True)
    assert [(e["what"], e["outcome"]) for e in events] == [("lent_migration_measured", "ended")]
    asked = ray.get(actor.count.remote())
    assert lent.refresh(force=True) == [] and ray.get(actor.count.remote()) == asked  # nothing to ask
    assert lent.wake_s() is None


def test_a_lent_engine_that_does_not_report_in_time_keeps_its_books(local_ray, monkeypatch):
    import reflow.runtime.lending as lending

    monkeypatch.setattr(lending, "REPORT_TIMEOUT_S", 0.2)
    ray = local_ray
    actor, lent = _reporting(ray, eta=3)
    lent.started("r", 0, version=0, group_id="g")
    ray.get(actor.set.remote({"away": {"g": {"w0": 4}}}))
    lent.refresh(force=True, ask={0})  # as a yield's report: the group went to the rollout engine
    ray.get(actor.slow_report.remote())
    ray.get(actor.set.remote({"home": {"g": 4}}))
    assert lent.refresh(force=True) == [] and lent.served_loads() == [4]  # the old books
