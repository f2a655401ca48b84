"""The decoupled loop's elastic pool and tail scheduler: the tail gate's and the
re-indexing's arithmetic without Ray, then a real `agent-train` run in mode reflow whose elastic pool
moves a slot to rollout and back mid-run without losing a group or turning an engine's weights back
(the tail's per-episode actions applied: `test_tail_runtime.py`)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
from run_helpers import PARITY_ENV, QUICK_RUN, SMALL_ROLLOUT, TINY_MODEL

from reflow.policy.tail import Quantiles, TailConfig, TailPolicy
from reflow.policy.tail_actions import CarryOver, Migrate, OverProvision
from reflow.runtime.elastic import moved_positions
from reflow.runtime.tail import GroupInFlight
from reflow.runtime.tail_gate import TailGate, decoupled_gate

TESTS = Path(__file__).parent


# -- arithmetic --------------------------------------------------------------------------------------


def test_quantiles_of_recent_positive_durations():
    assert Quantiles.observed([]) is None and Quantiles.observed([0.0, 3.0]) is None
    q = Quantiles.observed([float(x) for x in range(1, 11)])  # 1..10 s
    assert q == Quantiles(p50=6.0, p90=10.0, p99=10.0, count=10)


def test_moved_positions_from_the_rollout_slots_before_and_after():
    assert moved_positions([0, 1, 3], [0, 3]) == (1, None)  # slot 1 went to training
    assert moved_positions([0, 3], [0, 2, 3]) == (None, 1)  # slot 2 joined between them
    assert moved_positions([0, 1], [0, 1]) == (None, None)
    with pytest.raises(ValueError, match="one slot"):
        moved_positions([0, 1], [2, 3])


def test_busy_clock_keeps_a_leaving_workers_busy_time_and_a_joining_one_starts_idle():
    from reflow.recipes.loop_counters import BusyClock

    clock = BusyClock(3)
    clock.start(1)
    clock.start(2)
    clock.remove(1)  # its slot moved to training with a group in flight (drained)
    assert clock.in_flight == [0, 1] and clock.busy > 0.0
    kept = clock.busy
    clock.insert(1)
    assert clock.in_flight == [0, 0, 1] and clock.busy == kept
    clock.done(2)  # the worker that was at position 2 is still at position 2 after remove + insert
    assert clock.in_flight == [0, 0, 0] and clock.total() == clock.busy > kept


def test_busy_clock_counts_a_worker_busy_while_it_runs_a_lent_engines_episodes(monkeypatch):
    """Its own groups done, a rollout worker generating what a lent engine handed over is not idle."""
    import reflow.recipes.loop_counters as counters

    now = [0.0]
    monkeypatch.setattr(counters.time, "monotonic", lambda: now[0])
    clock = counters.BusyClock(2)
    clock.start(0)
    now[0] = 2.0
    clock.serve([3, 0])  # handed-over episodes arrive while its group runs: one busy stretch
    now[0] = 5.0
    clock.done(0)  # its group done; the served episodes go on
    assert clock.total() == 5.0
    now[0] = 7.0
    clock.serve([0, 0])  # they ended: idle from here
    now[0] = 10.0
    assert clock.total() == 7.0 and clock.busy == 7.0
    clock.serve([0, 4])
    now[0] = 11.0
    clock.remove(1)  # it moves to training while serving: its second kept
    assert clock.busy == 8.0 and clock.served == [0]


def _group(i: int, worker: int, started: float) -> GroupInFlight:
    return GroupInFlight(worker, f"g{i}", started)


def test_tail_gate_starts_b_plus_delta_counts_the_extra_ones_and_stops_once_b_are_done():
    gate = TailGate(TailPolicy(TailConfig(min_samples=4, over_provision_max=0.5)), batch=4, per_worker=8)
    # fewer than min_samples durations seen: delta = 0, the batch starts exactly B
    look = gate.look(0, [], [0, 0], now=0.0)
    assert look.room == 4 and look.beyond_b == 0
    assert [e["what"] for e in look.events] == ["over_provision"] and look.events[0]["extra"] == 0
    assert [look.take(look.worker()) for _ in range(4)] == [False] * 4 and not look.allows()
    # a heavy tail (p90 / p50 = 2): delta = min(ceil(4 x (1 - 1/2)), floor(4 x 0.5)) = 2
    gate.observe([1.0] * 6 + [2.0] * 4)  # p50 1 s, p90 2 s
    running = [_group(i, i % 2, 0.0) for i in range(3)]
    look = gate.look(1, running, [2, 1], now=5.0)  # 1 done + 3 running of 4 + 2
    assert look.room == 2 and look.beyond_b == 2  # both extra groups are beyond B
    assert look.events[0]["what"] == "over_provision" and look.events[0]["extra"] == 2
    assert "h = 2" in look.events[0]["why"]
    assert [look.take(0), look.take(1)] == [True, True] and not look.allows()
    assert gate.look(1, running, [2, 1], now=6.0).events == []  # the same decision: no new event
    # B done: the rest carry over, nothing more starts for this batch
    look = gate.look(4, running[:2], [1, 1], now=7.0)
    assert look.room == 0 and not look.allows()
    assert [e["what"] for e in look.events] == ["carry_over"] and look.events[0]["applied"] is True
    assert gate.look(5, running[:1], [1, 0], now=8.0).events == []  # still carrying over: one event
    # a new batch: over-provisioning is an event again
    assert [e["what"] for e in gate.look(0, [], [0, 0], now=9.0).events] == ["over_provision"]


def test_a_gate_over_overlapping_batches_starts_what_admission_allows_once_b_are_done():
    # async/reflow with tail.batch_cap=false: admission's window ((eta + 1) x B groups not yet trained)
    # over-provisions the batch being collected instead of the cap (B + delta, none once B are done)
    running = [_group(i, 0, 0.0) for i in range(2)]
    capped = TailGate(TailPolicy(TailConfig(min_samples=4)), batch=4, per_worker=8)
    assert capped.look(4, running, [2, 0], now=1.0, next_room=3).room == 0  # B done: none
    gate = TailGate(TailPolicy(TailConfig(min_samples=4)), batch=4, per_worker=8, overlap=True)
    look = gate.look(4, running, [2, 0], now=1.0, next_room=3)
    assert look.room == 3 and look.only is None and look.worker() == 1  # any engine under its limit
    assert [e["what"] for e in look.events] == ["carry_over"]  # the carry-over is still reported
    # each is started beyond B (B done already): over-provisioned
    assert [look.take(look.worker()) for _ in range(3)] == [True] * 3 and not look.allows()
    # collecting: admission's room when it is the larger (B + delta - started = 4 - 3 = 1 here); the
    # starts once B are done or in flight count as over-provisioned: 1 + 2 + 6 - 4 = 5 of the 6
    look = gate.look(1, running, [2, 0], now=2.0, next_room=6)
    assert look.room == 6 and look.beyond_b == 5
    assert [look.take(w) for w in (1, 1, 0, 1, 0, 1)] == [False] + [True] * 5
    # admission's room the smaller: the policy's stands (the loop asks admission for each start)
    assert gate.look(0, [], [0, 0], now=3.0, next_room=2).room == 4
    # engines freed for the next batch take its groups, as with the cap: the room is not widened
    runtime = SimpleNamespace(cluster=None, released={"w1"}, engine_ids=lambda: ["w0", "w1"], new_batch=list)
    freed = TailGate(TailPolicy(TailConfig(min_samples=4)), 4, 8, runtime=runtime, overlap=True)
    look = freed.apply([CarryOver(("g0",), ("e0",), "B done")], started=5, next_room=3)
    assert look.room == 3 and look.only == {1}


def test_the_decoupled_loop_gate_caps_batches_unless_told_not_to():
    from reflow.config import load_config

    def gate(*overrides: str) -> TailGate:
        config = load_config(None, [*PARITY_ENV, *TINY_MODEL, *SMALL_ROLLOUT, "mode=reflow", *overrides])
        return decoupled_gate(SimpleNamespace(rollout=["r0"], lent=[]), config, per_worker=4)

    assert not gate().overlap and gate().policy is not None  # B + delta a batch, none once B are done
    assert gate("tail.batch_cap=false").overlap  # admission's window bounds the starts
    off = gate("tail.enabled=false", "tail.batch_cap=false")
    assert off.policy is None and not off.overlap


def test_tail_gate_off_sets_no_limit_and_migrations_are_logged_not_applied():
    off = TailGate(None, batch=4, per_worker=8).look(0, [], [0], now=0.0)
    assert off.room is None and off.allows() and off.take(0) is False and off.events == []
    gate = TailGate(TailPolicy(), batch=4, per_worker=8)
    actions = [
        OverProvision(1, 0, "one more"),
        Migrate("e1", "w1", "w0", 300, "tail fits on one engine"),
        CarryOver(("g1",), ("e1",), "B done"),
    ]
    look = gate.apply(actions, started=3)
    assert look.room == 1 and look.beyond_b == 0
    by_kind = {e["what"]: e for e in look.events}
    assert by_kind["migrate"]["applied"] is False and by_kind["migrate"]["tokens"] == 300
    assert by_kind["over_provision"]["applied"] is True
    with pytest.raises(TypeError, match="unknown tail action"):
        gate.apply([object()], started=0)


# -- a real run: the elastic pool moves a slot both ways mid-run --------------------------------------

BASE = [
    *PARITY_ENV,
    *TINY_MODEL,
    *SMALL_ROLLOUT,
    *QUICK_RUN,
]


class ScriptedElastic:
    """The elastic policy's interface, moving a train slot to rollout at step 2 and back at step 4
    (the rates of a tiny model on shared cores say nothing stable: the test fixes the decisions, the
    runtime and the loop apply them for real)."""

    def __init__(self, cfg: object = None) -> None:
        self.cfg = cfg
        self.last_move_version = None  # what a checkpoint saves of the policy
        self.lend_slowdown = None

    def decide(self, obs):
        from reflow.policy.elastic import ElasticDecision

        n, m = obs.rollout_slots, obs.train_slots
        if obs.step == 2:
            return ElasticDecision("to_rollout", n + 1, m - 1, 1.0, 0.0, 0.0, 0.0, "scripted")
        if obs.step == 4:
            return ElasticDecision("to_train", n - 1, m + 1, 1.0, 0.0, 0.0, 0.0, "scripted")
        return ElasticDecision("hold", n, m, 0.0, 0.0, 0.0, 0.0, "scripted hold")


@pytest.mark.slow
def test_reflow_run_moves_a_slot_both_ways_and_loses_no_group(tmp_path, monkeypatch):
    import ray

    import reflow.runtime.elastic as elastic_runtime
    from reflow.config import load_config
    from reflow.recipes.agent_train import train
    from reflow.replay import ReplayStore

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.setattr(elastic_runtime, "ElasticPolicy", ScriptedElastic)
    overrides = [
        *BASE,
        f"out_dir={tmp_path}",
        "run_name=elastic",
        "mode=reflow",
        "train.steps=6",
        "resources.slots=[rollout, train, train]",
        "replay.eta=1",
        "tail.migrate=false",  # this run is about role changes; the ablation flag keeps episodes put
    ]
    try:
        summary = train(load_config(None, overrides))
    finally:
        ray.shutdown()
    run_dir = tmp_path / "elastic"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["kind"] == "step"]
    assert summary["steps"] == 6 and [s["step"] for s in steps] == list(range(1, 7))
    moves = [r for r in rows if r["kind"] == "elastic" and r["what"] != "hold"]
    assert [m["direction"] for m in moves] == ["to_rollout", "to_train"]
    assert [m["step"] for m in moves] == [2, 4]
    assert moves[0]["slot"] == 2 and moves[0]["roles"] == ["rollout", "train", "rollout"]
    # the drained worker is the one with fewer calls in flight at that boundary (timing decides
    # which of the two): it was a rollout slot, and the cluster is back to one rollout, two train
    assert moves[1]["slot"] in (0, 2) and moves[1]["roles"][moves[1]["slot"]] == "train"
    assert moves[1]["roles"].count("train") == 2 and moves[1]["roles"][1] == "train"
    assert all(m["cost_s"] > 0 and m["abandoned_groups"] == 0 for m in moves)
    assert summary["role_changes"] == 2
    assert summary["role_change_s"] == pytest.approx(sum(m["cost_s"] for m in moves))
    holds = [r for r in rows if r["kind"] == "elastic" and r["what"] == "hold"]
    assert len(holds) == 4 and all(h["why"] == "scripted hold" for h in holds)
    # no engine's confirmed version goes backwards across the changes
    versions = [s["engine_version"] for s in steps]
    assert versions == sorted(versions)
    # the tail scheduler's decisions are events and its counters reach the summary
    tail = [r for r in rows if r["kind"] == "tail"]
    assert any(t["what"] == "over_provision" for t in tail)
    # the policy's decision names the groups; the loop's event says how many it carried over
    carried = [t["carried"] for t in tail if t["what"] == "carry_over" and "carried" in t]
    assert carried and summary["tail_carried_over"] == sum(carried)
    assert summary["tail_migrations"] == 0  # tail.migrate=false
    assert not [t for t in tail if t["what"] == "migrate"]
    # nothing acknowledged was lost: every group reported to the loop (drained ones included) is in
    # the store, whole, and every group a step trained on is stored and consumed
    with ReplayStore(run_dir / "replay.sqlite", "elastic") as store:
        assert store.integrity_check() == "ok"
        stored = store.count()
        assert sum(s["groups_generated"] for s in steps) <= stored
        consumed = store.count(consumed=True)
        assert consumed >= sum(s["groups_trained"] for s in steps) - sum(
            s.get("batch_replayed", 0) for s in steps
        )
        for g in store.replayable(current_version=99, tau_max=99, max_reuse=99):
            assert len(store.group(g.group_id).episodes) == 4
