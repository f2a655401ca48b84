"""Lending in the simulator (reflow/sim/lending.py): a rollout-bound run gains what the pipeline model
T_lend of reflow/policy/lending.py predicts, a trainer-bound one has its engine reclaimed by the elastic
policy, lent engines generate during a step only when they run on past eta, the trainer's step is
slower by 1 - lend_overhead beside them, no group is lost, and with lending off nothing changes."""

from __future__ import annotations

import heapq

import pytest

from reflow.errors import ConfigError
from reflow.policy.elastic import ElasticDecision
from reflow.policy.lending import lent_throughput
from reflow.sim.config import validate_scenario
from reflow.sim.from_run import scenario_for
from reflow.sim.measured import RunMeasurement
from reflow.sim.plan import plan
from reflow.sim.simulation import Simulation, simulate

TOKENS_OUT, TOKENS_IN = 300, 100  # every sample: 100 prompt tokens, exactly 300 generated, one turn


def scenario(
    engine_tok_s: float = 3000.0,
    train_tok_s: float = 12000.0,
    *,
    lend: bool = True,
    elastic: bool = False,
    eta: int = 2,
    gpus: int = 2,
    steps: int = 30,
    overhead: float = 0.05,
    switch_s: float = 0.0,
    sigma: float = 0.0,
    groups_per_engine: int | None = None,
    **elastic_config: object,
):
    """One rollout engine at `engine_tok_s` (a constant-rate server: r = engine_tok_s / 300 samples/s),
    `gpus` - 1 train slots at `train_tok_s` each (t = train_tok_s / 400 samples/s), no sync cost;
    `sigma` > 0 draws response lengths around 300 instead."""
    config = {"lend": True, "lend_overhead": overhead, **elastic_config} if lend else elastic_config
    return validate_scenario(
        {
            "gpus": gpus,
            "gpu": {"hbm_gb_s": 1, "bf16_tflops": 1, "memory_gb": 1},
            "model": {"params_b": 1e-3, "kv_bytes_per_token": 1},
            "decode": {"engine_tokens_per_s": engine_tok_s, "iter_fixed_s": 0.0, "max_running": 64},
            "train": {"tokens_per_s": train_tok_s, "fixed_s": 0, "logprob_factor": 0, "ref_factor": 0},
            "sync": {"fixed_s": 0.0, "bandwidth_gb_s": 1e9, "resume_s": 0, "lend_switch_s": switch_s},
            "workload": {
                "prompt_tokens": {"median": TOKENS_IN, "sigma": 0},
                "response_tokens": {"median": TOKENS_OUT, "sigma": sigma},
                "group_sigma": 0,
            },
            "batch": {"groups": 4, "samples_per_group": 4},
            "mode": {
                "mode": "async",
                "rollout_gpus": 1,
                "eta": eta,
                "groups_per_engine": groups_per_engine or eta,
                "recompute_logprob": False,
                "elastic": elastic,
                "elastic_config": config,
            },
            "run": {"steps": steps, "warmup_steps": 5, "seed": 1},
        }
    )


def test_a_rollout_bound_run_gains_what_the_lending_formula_predicts():
    """r = 10 samples/s, t = 30: without lending T = 10; with the train slot's engine lent while its
    trainer waits, T_lend(1, 1, 1) = 2r / (1 + r / 0.95t) = 14.8 samples/s. The simulation gives it
    within 1% (exact but for the steps' granularity)."""
    off, on = simulate(scenario(lend=False)), simulate(scenario())
    assert off["samples_per_s"] == pytest.approx(10.0, rel=1e-6)
    predicted = lent_throughput(1, 1, 1, rollout_rate=10.0, train_rate=30.0, overhead=0.05)
    assert predicted == pytest.approx(14.805, abs=1e-3)
    assert on["samples_per_s"] == pytest.approx(predicted, rel=0.01)
    assert on["lent_groups"] > 0 and on["lent_yields"] > 0 and on["lent_busy_s"] > 0
    # the slot is never idle: its lent engine generates (into stored groups) whenever its trainer waits
    assert on["train_slot_idle_ratio"] == pytest.approx(0.0, abs=1e-6)
    assert on["trainer_idle_ratio"] > 0.4 and "lent_busy_s" not in off


def test_the_trainer_is_slower_by_the_overhead_and_pays_a_hand_over_per_yield():
    """Every step of 16 samples x 400 tokens at 12000 tokens/s takes 0.533 s alone, 0.533 / 0.95 beside
    a lent engine, and `sync.lend_switch_s` more when a lent engine yields to it."""
    base = 16 * (TOKENS_IN + TOKENS_OUT) / 12000.0
    off = simulate(scenario(lend=False, steps=12))
    assert off["train_s"] == pytest.approx(base, rel=1e-9)
    on = Simulation(scenario(steps=12, switch_s=0.1))
    out = on.run()
    total = sum(r["train_s"] for r in out["step_records"])
    assert total == pytest.approx(12 * base / 0.95 + 0.1 * out["lent_yields"], rel=1e-9)
    assert out["lent_yields"] >= 3


def run_checked(s) -> tuple[Simulation, list[int], list[str]]:
    """Run `s` event by event; at each step start note which lent engines run on beside it (and how old
    their oldest group is), and after every event check that no other lent engine decodes while the
    trainer is busy. Returns the simulation, the run-on ages and the violations."""
    sim = Simulation(s)
    lending = sim.lending
    assert lending is not None
    allowed: set[int] = set()
    ages: list[int] = []
    step_starts = lending.step_starts

    def noting(version: int, seconds: float) -> float:
        out = step_starts(version, seconds)
        allowed.clear()
        for e in lending.engines:
            mine = [g.version for g in lending.groups.values() if g.lent is e]
            if mine and not e.paused:
                allowed.add(e.eid)
                ages.append(version - min(mine))
        return out

    lending.step_starts = noting  # type: ignore[method-assign]
    violations = []
    sim.fill()
    sim.trainer.try_train()
    while sim.version < s.run.steps:
        at, _, kind, obj, token = heapq.heappop(sim.events)
        sim.now = at
        sim.handlers[kind](obj, token)
        if sim.trainer.busy:
            violations += [
                f"t={sim.now:.3f}: lent engine {e.eid} decodes during a step"
                for e in lending.engines
                if e.b and not e.paused and e.eid not in allowed
            ]
    return sim, ages, violations


def test_lent_engines_generate_during_a_step_only_when_running_on_past_eta():
    """A trainer that never waits once its rollout engine feeds it (r = 20, t = 5 samples/s): the lent
    engine's first groups, caught by the first step, stay paused through the steps until they are
    more than eta = 2 versions old, then run on beside the step; nothing else of it decodes while the
    trainer is busy."""
    s = scenario(engine_tok_s=6000.0, train_tok_s=2000.0, eta=2, groups_per_engine=4, sigma=1.0, steps=12)
    sim, ages, violations = run_checked(s)
    assert not violations, violations[:3]
    assert sim.lending.yields >= 1
    assert ages and all(age > 2 for age in ages)
    assert sim.lending.ran_on == len(ages) > 0
    runs_on = [e for e in sim.rec.events if e.get("what") == "lent_runs_on"]
    assert len(runs_on) == len(ages)
    assert sim.lending.stored_groups > 0  # the groups that ran on were stored


def test_no_group_is_lost():
    """Groups started = groups stored + groups in flight at the end, on the rollout and the lent
    engines together and on the lent ones alone, where groups pause through steps and run on."""
    trainer_bound = scenario(
        engine_tok_s=6000.0, train_tok_s=2000.0, eta=2, groups_per_engine=4, sigma=1.0, steps=15
    )
    for s in (scenario(steps=15, sigma=1.0), trainer_bound):
        sim = Simulation(s)
        sim.run()
        started = next(sim.groups)
        stored = sum(sim.store.reuse_histogram().values())
        assert started == stored + sim.store.in_flight()
        lending = sim.lending
        assert lending.started > 0
        assert lending.started == lending.stored_groups + len(lending.groups)
        assert set(lending.groups) <= set(sim.store.in_flight_groups())


def test_a_trainer_bound_run_has_its_lent_engine_reclaimed():
    """r = 20, t = 10 samples/s on one train slot: lending only slows the trainer (T 10 -> 9.5), so the
    elastic policy reclaims the engine once its dwell is over, and does not lend it again."""
    out = simulate(scenario(engine_tok_s=6000.0, train_tok_s=4000.0, elastic=True, steps=20))
    acts = [(e["step"], e["what"]) for e in out["events"] if e.get("what") in ("lend", "reclaim")]
    assert acts and acts[0][1] == "reclaim" and acts[0][0] >= 5
    assert [a for _, a in acts] == ["reclaim"]
    reclaim = next(e for e in out["events"] if e.get("what") == "reclaim")
    assert reclaim["applied"] and reclaim["lent_slots"] == 0
    assert out["lent_slots"] == 0


def test_a_rollout_bound_run_keeps_lending_under_the_policy():
    """The rollout-bound run under the elastic policy: the policy sees the lent slot and its busy
    seconds and keeps it lending (no reclaim); the split itself may move."""
    out = simulate(scenario(elastic=True, gpus=3, steps=20))
    elastic = [e for e in out["events"] if e.get("kind") == "elastic" and "lent_slots" in e]
    assert elastic and all(e["what"] != "reclaim" for e in elastic)
    assert out["lent_slots"] == 2 and out["lent_busy_s"] > 0


def test_lending_off_is_the_simulation_without_the_key():
    """`lend: false` (with lending's other knobs set) simulates exactly what no lending key does."""
    plain = scenario(lend=False)
    said = plain.model_copy(
        update={
            "mode": plain.mode.model_copy(update={"elastic_config": {"lend": False, "lend_overhead": 0.3}})
        }
    )
    out = simulate(said)
    assert out == simulate(plain) and "lent_busy_s" not in out


def test_lending_needs_a_decoupled_mode_and_the_actuator_refuses_without_it():
    s = scenario(lend=False)
    with pytest.raises(ConfigError, match=r"elastic_config\.lend needs mode async or reflow"):
        validate_scenario({**s.model_dump(), "mode": {"mode": "sync", "elastic_config": {"lend": True}}})
    decision = ElasticDecision("lend", 1, 1, 0.0, 0.0, 1.0, 1.0, "test", 1)
    refused = Simulation(s).actuator.lend(decision)
    assert refused["applied"] is False and "lends no engine" in refused["error"]


def test_from_run_carries_a_runs_lending_in_its_decoupled_modes_only(tmp_path):
    costs = {
        "rollout_slots": 1,
        "train_slots": 1,
        "engine_tokens_per_s": 1000.0,
        "trainer_tokens_per_s": 5000.0,
        "sync_s": 0.01,
        "role_change_s": 30.0,
    }
    config = {"elastic": {"lend": True, "lend_overhead": 0.1}, "replay": {"eta": 1}}
    for mode, lends in (("reflow", True), ("async", True), ("sync", False)):
        m = RunMeasurement(tmp_path, {**config, "mode": mode}, mode, 10, 60.0, {}, costs)
        s = scenario_for(m)
        assert s.mode.lends is lends
        if lends:
            assert s.mode.elastic_config["lend_overhead"] == 0.1


def test_plan_ranks_lending_on_and_off():
    s = scenario(lend=False, steps=10)
    rows = plan(s, splits=(0.5,), etas=(2,), reuse=(1,))
    assert {(r.mode, r.lend) for r in rows} >= {("async", False), ("async", True), ("reflow", True)}
    best = rows[0]
    assert best.lend and best.mode != "sync"  # rollout-bound, idle trainer: lending pays
