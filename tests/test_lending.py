"""Lending on Ray: an engine beside the trainer takes groups while the trainer waits and yields when a
step starts. First a lent worker's yield on a real TorchEngine (it stops decoding within one step and
its episodes resume on newer weights, none lost), then a real `agent-train` run in mode reflow with
`elastic.lend` that trains the lent engine's groups with their per-token versions, losing no group."""

from __future__ import annotations

import asyncio
import os
import sqlite3
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


async def test_a_lent_worker_stops_decoding_within_one_step_and_its_episodes_resume_on_new_weights(tmp_path):
    from reflow.config import load_config
    from reflow.models import build_tiny
    from reflow.runtime.workers import RolloutWorker

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
    import sys

    sys.path.insert(0, str(TESTS))  # the parity env's plugin module
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
    # a lent group paused through a step resumed on the newer weights: per-token versions
    lent_records = [r for r in records if r.group_id in lent_groups]
    assert any(r.policy_version_start < r.policy_version_end for r in lent_records)
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
    lent = LentEngines(SimpleNamespace(lent=[actor]), per_engine=2, eta=1)
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
    state = SimpleNamespace(lent_busy_s=5.0, lent_stored_s=4.0, lent_yields=0)
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
    lent = lending.LentEngines(SimpleNamespace(lent=[actor]), per_engine=2, eta=0)
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
