"""The tail scheduler's per-episode actions applied: the tail runtime's arithmetic
(loads in sequences, placeholders, migrations counted) and the gate applying `Migrate`, `FreeSlot` and
`SetConcurrency` on a snapshot set by hand, without Ray; then a real `agent-train` run in mode reflow
whose tail migrates episodes between engines, frees the source for the next batch and sets a
concurrency limit without losing a group or an episode."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
from migration_helpers import ScriptedTail
from run_helpers import LONG_TAIL_RUN, SMALL_ROLLOUT, TINY_MODEL

from reflow.policy.tail import TailConfig, TailPolicy
from reflow.policy.tail_actions import FreeSlot, Migrate, OverProvision, SetConcurrency
from reflow.runtime.tail import GroupInFlight, Snapshot, TailRuntime
from reflow.runtime.tail_gate import TailGate, TailLook, tail_runtime

TESTS = Path(__file__).parent


class Slots:
    """A cluster stand-in: rollout slots 0 and 2 (slot 1 trains)."""

    def __init__(self) -> None:
        self.rollout_slots = [SimpleNamespace(index=0), SimpleNamespace(index=2)]


class RecordedRuntime(TailRuntime):
    """`TailRuntime`'s own arithmetic (observe, limits, freed engines) on a snapshot set by hand; the
    calls that go to Ray are recorded instead."""

    def __init__(self, snapshot: Snapshot) -> None:
        super().__init__(Slots(), group_size=2, limit=8)
        self.asked: list = []
        self.snapshot = snapshot
        self.owner = {ep["id"]: ep["owner"] for ep in snapshot.episodes}
        self.seen = {ep["group"] for ep in snapshot.episodes}

    def poll(self, now, force=False):
        return []

    def migrate(self, action):
        self.asked.append(action)
        if action.episode == "gone":
            return {"applied": False, "error": "episode gone is not running here (ended?)"}
        self.moved[action.episode] = action.target
        return {"applied": True}

    def set_concurrency(self, action):
        self.asked.append(action)
        self.limits[action.engine] = action.concurrency
        return {"applied": True, "limit_was": 8, "limit": action.concurrency}


def _ep(id, group, engine, owner=None, tokens=100, seconds=5.0):
    return {
        "id": id,
        "group": group,
        "owner": owner or engine,
        "engine": engine,
        "turns": 2,
        "tokens": tokens,
        "seconds": seconds,
    }


def test_runtime_observes_episodes_and_loads_in_sequences_with_migrations_counted():
    snap = Snapshot(
        at=10.0,
        episodes=[_ep("a", "g1", "w0"), _ep("b", "g1", "w2", owner="w0"), _ep("c", "g2", "w2")],
        limits={"w0": 8, "w2": 6},
    )
    rt = RecordedRuntime(snap)
    in_flight = [GroupInFlight(0, "g1", 0.0), GroupInFlight(1, "g2", 0.0), GroupInFlight(1, "g3", 9.0)]
    episodes, loads, limits = rt.observe(in_flight, now=12.0)
    # g3 started after the snapshot: two placeholders on its worker, priced at the whole context budget
    assert [(e.id, e.engine, e.tokens) for e in episodes] == [
        ("a", "w0", 100),
        ("b", "w2", 100),
        ("c", "w2", 100),
        ("g3#0", "w2", 4096),
        ("g3#1", "w2", 4096),
    ]
    assert episodes[0].seconds == 7.0 and episodes[3].seconds == 3.0  # aged by the snapshot's age
    # the sequences running on each engine: w0 runs a (b of its g1 generates on w2); w2 runs b, c
    # (g2's other episode closed: it holds no place) and g3's two placeholders
    assert loads == [1, 4] and limits == [8, 6]
    rt.moved["a"] = "w2"  # a migration applied since the snapshot
    assert rt.observe(in_flight, now=12.0)[1] == [0, 5]


def test_a_group_whose_episodes_all_closed_before_its_report_came_still_counts_as_started():
    """Between its last episode's end and its report reaching the loop, a group is in no worker's
    progress: it stays in the policy's view (placeholders), so the batch's started groups are all
    counted and over-provisioning starts none too many."""
    rt = RecordedRuntime(Snapshot(at=10.0, episodes=[_ep("a", "g1", "w0")], limits={"w0": 8, "w2": 8}))
    rt.seen.add("g2")  # an earlier snapshot listed g2's episodes; this one does not: they all closed
    in_flight = [GroupInFlight(0, "g1", 0.0), GroupInFlight(1, "g2", 1.0), GroupInFlight(1, "g3", 11.0)]
    episodes, _, _ = rt.observe(in_flight, now=12.0)
    # g2 is finishing: counted, running on no engine; g3 (started since) has placeholders
    assert rt.finishing == 1 and sorted({e.group for e in episodes}) == ["g1", "g3"]
    gate = TailGate(TailPolicy(), batch=8, per_worker=4, group_size=2, runtime=rt)
    look = gate.look(0, in_flight, [1, 2], 12.0)
    over = [e for e in look.events if e["what"] == "over_provision"]
    assert over and "3 of 8 + 0 started" in over[0]["why"]  # g1, g3 and the finishing g2


def test_the_gate_looks_through_the_runtime_only_where_an_action_can_follow():
    # a look through the runtime asks every rollout worker's actor for its episodes, and the loop wakes
    # for it every POLL_S: with one rollout engine and no limits to set, no action can follow
    class Counting(RecordedRuntime):
        polls = 0

        def poll(self, now, force=False):
            self.polls += 1
            return []

    rt = Counting(Snapshot(at=0.0, episodes=[], limits={"w0": 8, "w2": 8}))
    gate = TailGate(TailPolicy(), batch=4, per_worker=4, group_size=2, runtime=rt)
    gate.look(0, [], [0, 0], 1.0)
    assert rt.polls == 1 and gate.wake_s(1) == rt.poll_s and gate.actuator.tail is rt  # two engines
    rt.cluster.rollout_slots = rt.cluster.rollout_slots[:1]  # one rollout engine left
    look = gate.look(0, [], [0], 2.0)
    assert rt.polls == 1 and gate.wake_s(1) is None and gate.actuator.tail is None
    assert look.room == 4 and look.worker() == 0  # over-provisioning still reads the group counts
    knee = TailGate(TailPolicy(TailConfig(set_concurrency=True)), 4, 4, group_size=2, runtime=rt)
    knee.look(0, [], [0], 3.0)
    assert rt.polls == 2 and knee.wake_s(1) == rt.poll_s  # a limit to set: it looks


def test_the_runtime_starts_afresh_when_the_gate_acts_through_it_again():
    # the elastic pool took a rollout engine away and gave one back: what the runtime knew before (an
    # engine freed for the next batch, groups seen) no longer holds
    class Polled(RecordedRuntime):
        polls = 0

        def poll(self, now, force=False):
            self.polls += 1
            if self.snapshot is None:
                self.snapshot = Snapshot(at=now, episodes=[], limits={"w0": 8, "w2": 8})
            return []

    rt = Polled(Snapshot(at=0.0, episodes=[], limits={"w0": 8, "w2": 8}))
    gate = TailGate(TailPolicy(), batch=4, per_worker=4, group_size=2, runtime=rt)
    gate.look(0, [], [0, 0], 1.0)
    rt.released.add("w2")
    rt.seen.add("g-old")
    both = rt.cluster.rollout_slots
    rt.cluster.rollout_slots = both[:1]
    gate.look(0, [], [0], 2.0)  # one engine: the gate does not act through the runtime
    assert rt.released == {"w2"} and rt.polls == 1
    rt.cluster.rollout_slots = both
    look = gate.look(0, [], [0, 0], 3.0)
    assert rt.released == set() and "g-old" not in rt.seen and rt.polls == 2 and look.only is None


def test_a_look_that_migrated_does_not_widen_an_overlapping_batch():
    # the loads it read are from before the migrations: the next look, with fresh loads, widens
    rt = RecordedRuntime(Snapshot(at=0.0, episodes=[_ep("a", "g1", "w0")], limits={"w0": 8, "w2": 8}))
    gate = TailGate(TailPolicy(), batch=4, per_worker=4, group_size=2, runtime=rt, overlap=True)
    look = gate.apply([Migrate("a", "w0", "w2", 100, "consolidate")], started=6, next_room=3)
    assert look.migrations == 1 and look.room == 0
    look = gate.apply([], started=6, next_room=3)
    assert look.room == 3 and look.only is None


def test_a_resume_restores_saved_limits_only_where_the_run_sets_limits():
    saved = {"limits": {"w0": 3, "w9": 5}}  # w9: no such engine now
    rt = RecordedRuntime(Snapshot(at=0.0, episodes=[]))
    # off (the default): a limit saved by a run that set one would hold for good; the engine keeps its own
    assert (
        TailGate(TailPolicy(), batch=4, per_worker=4, group_size=2, runtime=rt).load_state_dict(saved) == []
    )
    assert rt.asked == [] and rt.engine_limit("w0") == 8
    knee = TailGate(TailPolicy(TailConfig(set_concurrency=True)), 4, 4, group_size=2, runtime=rt)
    (event,) = knee.load_state_dict(saved)
    assert event["engine"] == "w0" and event["limit"] == 3 and rt.engine_limit("w0") == 3
    # and only such a run saves them: a later resume must not pin an engine at an old batch size
    assert knee.state_dict() == {"limits": {"w0": 3, "w2": 8}}
    assert TailGate(TailPolicy(), 4, 4, group_size=2, runtime=rt).state_dict() == {"limits": {}}


def test_the_tail_runtime_is_there_whenever_the_tail_is_on():
    """With migration and limits both off the gate still frees the engines already empty for the next
    batch: that needs the runtime's per-episode view."""
    from reflow.config import load_config

    def runtime(*overrides):
        return tail_runtime(Slots(), load_config(None, ["env.id=reflow/Calc-v0", "mode=reflow", *overrides]))

    assert isinstance(runtime("tail.migrate=false", "tail.set_concurrency=false"), TailRuntime)
    assert isinstance(runtime(), TailRuntime)
    assert runtime("tail.enabled=false") is None


def test_gate_applies_migrations_frees_the_source_for_the_next_batch_and_sets_limits():
    rt = RecordedRuntime(Snapshot(at=0.0, episodes=[_ep("a", "g1", "w0"), _ep("b", "g2", "w2")]))
    gate = TailGate(TailPolicy(), batch=4, per_worker=4, group_size=2, runtime=rt)
    actions = [
        Migrate("b", "w2", "w0", 100, "the tail fits on w0"),
        Migrate("gone", "w2", "w0", 50, "another"),
        FreeSlot("w2", "next_batch", "w2 emptied"),
        SetConcurrency("w0", 6, "knee at 6"),
    ]
    look = gate.apply(actions, started=4, next_room=3)
    assert look.migrations == 1 and [a.kind for a in rt.asked] == ["migrate", "migrate", "set_concurrency"]
    # an applied migration's event comes measured (from the worker); a refused one says why at once
    by_kind = {e["what"]: e for e in look.events}
    assert by_kind["migrate"]["episode"] == "gone" and by_kind["migrate"]["applied"] is False
    assert by_kind["free_slot"]["applied"] is True and by_kind["set_concurrency"]["limit"] == 6
    # the next batch's groups may start, as admission allows, on the freed engine only
    assert look.room == 3 and look.beyond_b == 0 and look.only == {1}
    look.loads, look.limits, look.group_size = [2, 0], [6, 8], 2
    assert look.worker() == 1 and look.take(1) is False
    # the same decisions next look: nothing asked again, no new events
    again = gate.apply(actions, started=4, next_room=3)
    assert again.events == [] and again.migrations == 0 and len(rt.asked) == 3
    assert again.only == {1}  # still freed until a new batch starts
    gate.apply([OverProvision(2, 0, "a new batch")], started=0)
    assert rt.released == set()


def test_gate_worker_picks_the_least_loaded_engine_with_room_under_its_limit():
    look = TailLook(None, loads=[4, 2, 6], limits=[8, 4, 6], group_size=2)
    assert look.worker() == 1 and look.take(1) is False and look.loads == [4, 4, 6]
    assert look.worker() == 0  # w1 is at its limit now; w2 too
    look.take(0)
    look.take(0)
    assert look.worker() is None
    # an idle engine always takes a group, even under a limit smaller than one group
    assert TailLook(None, loads=[0], limits=[1], group_size=4).worker() == 0


def test_the_gate_starts_a_group_beside_the_stragglers_of_another_on_an_engine_below_its_room():
    # groups of 2; the engines' measured knee: 2 sequences, so each keeps room for two groups (4). g1
    # has one episode left on w0 (the other closed); w2 runs g2 and g3 whole: w0 takes the next groups
    # (counting whole groups it looked full, and under the limit alone it took none: one group at a
    # time, the engine idle between them)
    rt = RecordedRuntime(
        Snapshot(
            at=10.0,
            episodes=[
                _ep("a", "g1", "w0"),
                *(_ep(i, g, "w2") for i, g in (("c", "g2"), ("d", "g2"), ("e", "g3"), ("f", "g3"))),
            ],
            limits={"w0": 2, "w2": 2},
        )
    )
    gate = TailGate(TailPolicy(), batch=8, per_worker=4, group_size=2, runtime=rt)
    in_flight = [GroupInFlight(0, "g1", 0.0), GroupInFlight(1, "g2", 0.0), GroupInFlight(1, "g3", 0.0)]
    look = gate.look(0, in_flight, [1, 2], 12.0)
    assert look.loads == [1, 4] and look.limits == [2, 2] and look.allows()
    assert look.worker() == 0 and look.take(0) is False and look.worker() == 0
    look.take(0)
    assert look.loads == [5, 4] and look.worker() is None


def test_an_engine_keeps_room_for_two_groups_under_a_limit_of_less():
    # groups of 8 on an engine whose measured knee is 5 (or 15): the engine queues what is over its
    # limit, so a second group waits ready beside the first (and beside a group's stragglers); under
    # the limit alone one group ran at a time and the engine idled between groups (rollout idled a
    # quarter of a run, the trainer half, in reflow runs without replay on calc-short)
    for limit in (5, 15):
        look = TailLook(None, loads=[3], limits=[limit], group_size=8)
        assert look.worker() == 0 and look.take(0) is False and look.loads == [11]
        assert look.worker() == 0 and look.take(0) is False and look.worker() is None  # 19: full
        assert TailLook(None, loads=[8], limits=[limit], group_size=8).worker() == 0
    assert TailLook(None, loads=[16], limits=[5], group_size=8).worker() is None
    # a limit above two groups is the room
    assert TailLook(None, loads=[40], limits=[48], group_size=8).worker() == 0
    assert TailLook(None, loads=[48], limits=[48], group_size=8).worker() is None


@pytest.mark.slow
def test_reflow_run_migrates_episodes_and_loses_no_group_or_episode(tmp_path, monkeypatch):
    import ray

    import reflow.runtime.tail_gate as tail_gate
    from reflow.config import load_config
    from reflow.recipes.agent_train import train
    from reflow.replay import ReplayStore

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.setattr(tail_gate, "TailPolicy", ScriptedTail)
    overrides = [
        *TINY_MODEL,
        *SMALL_ROLLOUT,
        *LONG_TAIL_RUN,
        f"out_dir={tmp_path}",
        "run_name=tail",
        "mode=reflow",
        "train.steps=5",
        "resources.slots=[rollout, rollout, train]",
        "elastic.enabled=false",  # the slots stay put: this run is about the tail
        "tail.set_concurrency=true",  # opt-in: the test sees a limit set
    ]
    try:
        summary = train(load_config(None, overrides))
    finally:
        ray.shutdown()
    run_dir = tmp_path / "tail"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert summary["steps"] == 5
    tail = [r for r in rows if r["kind"] == "tail"]
    migrations = [t for t in tail if t["what"] == "migrate" and t["applied"]]
    decided = [t for t in migrations if "tokens" in t]  # the decisions (a fallback is measured apart)
    # every migration applied is one event with what, why and the measured effect
    assert summary["tail_migrations"] >= 1 and len(decided) == summary["tail_migrations"]
    assert all({"episode", "source", "target", "tokens", "outcome"} <= set(m) for m in decided)
    assert all(m["source"] != m["target"] for m in decided)
    # measured: the tokens the target computed again, the first token's seconds there (its re-prefill)
    done = [m for m in decided if m["outcome"] == "ok"]
    assert done and all(m["reprefill_tokens"] > 0 for m in done)
    assert all(m["first_token_s"] is not None for m in done)
    assert all((m["handoff_s"] is not None) == m["in_flight"] for m in done)  # an abort's round trip
    assert any(t["what"] == "free_slot" and t["applied"] and t["use"] == "next_batch" for t in tail)
    assert any(t["what"] == "set_concurrency" and t["applied"] and t["limit"] == 12 for t in tail)
    # nothing lost: the store is whole, every group has its 4 episodes, none is an infra error, and the
    # migrated episodes whose groups were stored are there with their migration counted
    with ReplayStore(run_dir / "replay.sqlite", "tail") as store:
        assert store.integrity_check() == "ok"
        steps = [r for r in rows if r["kind"] == "step"]
        assert sum(s["groups_generated"] for s in steps) <= store.count()
        records = {r.episode_id: r for r in store.episodes()}
        groups = {r.group_id for r in records.values()}
        for g in groups:
            assert len(store.group(g).episodes) == 4
    assert all(r.status != "infra_error" for r in records.values())
    moved = [records[m["episode"]] for m in decided if m["episode"] in records]
    assert moved, "no migrated episode's group was stored"
    assert all(r.timings.get("migrations", 0) >= 1 and r.status in ("ok", "truncated") for r in moved)


class FakeWorker:
    """A rollout worker's tail side as the runtime calls it (`migrate`, `progress`), its calls'
    results handed back at once by a stand-in `ray.get`; `measured`: the migrations it reports next."""

    def __init__(self, engine: str) -> None:
        self.engine, self.measured = engine, []
        self.migrate = SimpleNamespace(remote=lambda episode, target, name: {"applied": True})
        self.progress = SimpleNamespace(remote=self._progress)

    def _progress(self) -> dict:
        report = {"engine": self.engine, "limit": 8, "curve": [], "episodes": [], "prefill_tokens_per_s": 0}
        report["migrations"], self.measured = self.measured, []
        return report


def test_an_episode_moved_twice_before_its_first_move_was_measured_logs_both_decisions(monkeypatch):
    import reflow.runtime.tail as tail

    monkeypatch.setattr(tail, "ray", SimpleNamespace(get=lambda ref, timeout=None: ref))
    cluster = Slots()
    cluster.rollout = [FakeWorker("w0"), FakeWorker("w2")]
    rt = TailRuntime(cluster, group_size=2, limit=8)
    rt.owner = {"a": "w0"}
    first, second = Migrate("a", "w0", "w2", 100, "tail"), Migrate("a", "w2", "w0", 120, "tail again")
    assert rt.migrate(first) == {"applied": True} and rt.migrate(second) == {"applied": True}
    # the worker measured both: the first move superseded by the second, which generated on w0
    report = {"episode": "a", "group": "g1", "in_flight": True, "handoff_s": None, "first_token_s": None}
    cluster.rollout[0].measured = [
        {**report, "source": "w0", "target": "w2", "outcome": "superseded", "reprefill_tokens": 0},
        {
            **report,
            "source": "w2",
            "target": "w0",
            "outcome": "ok",
            "reprefill_tokens": 120,
            "first_token_s": 0.2,
        },
    ]
    events = rt.poll(1.0, force=True) + rt.close(2.0)
    # two applied decisions, two events each with its own decision (tokens, why) and its measurement
    assert [(e["target"], e["tokens"], e["why"], e["outcome"]) for e in events] == [
        ("w2", 100, "tail", "superseded"),
        ("w0", 120, "tail again", "ok"),
    ]


def test_episodes_a_rollout_engine_runs_for_a_lent_engine_count_in_its_load_and_the_policys_view():
    """A lent engine's handed-over episodes generate on a rollout engine but are in no rollout worker's
    report: the loop passes them as `served`; the gate's loads (where groups start, the free sequences
    a hand-over may take) and the tail policy's engine states both count them."""
    rt = RecordedRuntime(Snapshot(at=10.0, episodes=[_ep("a", "g1", "w0")], limits={"w0": 8, "w2": 8}))
    gate = TailGate(TailPolicy(), batch=8, per_worker=4, group_size=2, runtime=rt)
    seen = []
    decide = gate.policy.decide
    gate.policy.decide = lambda obs: seen.append(obs) or decide(obs)
    look = gate.look(0, [GroupInFlight(0, "g1", 0.0)], [1, 0], 12.0, served=[0, 5])
    assert look.loads == [1, 5] and look.free_sequences() == [7, 3]
    assert [e.running for e in seen[0].engines] == [1, 5]
    # without a runtime (no progress reports) the policy counts groups: 5 episodes fill 3 groups of 2
    plain = TailGate(TailPolicy(), batch=8, per_worker=4, group_size=2)
    plain.policy.decide = lambda obs: seen.append(obs) or decide(obs)
    look = plain.look(0, [], [1, 0], 12.0, served=[0, 5])
    assert look.loads == [2, 5] and [e.running for e in seen[1].engines] == [1, 3]
    # the tail off: no policy, the loads still count them
    off = TailGate(None, batch=8, per_worker=4, group_size=2)
    assert off.look(0, [], [1, 0], 0.0, served=[1, 0]).loads == [3, 0]
