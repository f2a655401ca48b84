"""Lending in the simulator (reflow/sim/lending.py): a rollout-bound run gains what the pipeline model
T_lend of reflow/policy/lending.py predicts, a trainer-bound one keeps its engine where lending costs
it nothing and has it reclaimed by the elastic policy where the steps it runs on beside cost more than
lending gives, lent engines generate during a step only when they run on past eta, the trainer's step
is slower by 1 - sync.lend_beside_slowdown beside them, a yielding engine hands over what the rollout
engines have free sequences for (the runtime's plan) and those episodes end there, no group is lost,
and with lending off nothing changes."""

from __future__ import annotations

import heapq
from collections.abc import Callable
from types import SimpleNamespace

import pytest

from reflow.errors import ConfigError
from reflow.policy.elastic import ElasticDecision
from reflow.policy.lending import lent_throughput
from reflow.sim.config import validate_scenario
from reflow.sim.from_run import scenario_for
from reflow.sim.lending import free_sequences
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
    beside: float = 0.35,
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
            "sync": {
                "fixed_s": 0.0,
                "bandwidth_gb_s": 1e9,
                "resume_s": 0,
                "lend_switch_s": switch_s,
                "lend_beside_slowdown": beside,
            },
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
    trainer waits, T_lend(1, 1, 1) = 2r / (1 + r / t') = 15 samples/s (t' = t: the engine yields to
    every step, none runs on beside it). The simulation gives it within 1% (exact but for the steps'
    granularity)."""
    off, on = simulate(scenario(lend=False)), simulate(scenario())
    assert off["samples_per_s"] == pytest.approx(10.0, rel=1e-6)
    assert on["lent_ran_on"] == 0
    predicted = lent_throughput(1, 1, 1, rollout_rate=10.0, train_rate=30.0)
    assert predicted == pytest.approx(15.0)
    assert on["samples_per_s"] == pytest.approx(predicted, rel=0.01)
    assert on["lent_groups"] > 0 and on["lent_yields"] > 0 and on["lent_busy_s"] > 0
    # the slot is idle only for the seconds its lent engine spent on the groups still in flight when
    # the run ends (2 of 42: 2%): it generates, into stored groups, whenever its trainer waits
    assert 0 < on["lent_groups"] - on["lent_groups_stored"] <= 2
    assert on["train_slot_idle_ratio"] < 0.03
    assert on["trainer_idle_ratio"] > 0.4 and "lent_busy_s" not in off


def test_the_trainer_pays_a_switch_per_yield_and_the_slowdown_only_beside_a_running_engine():
    """Every step of 16 samples x 400 tokens at 12000 tokens/s takes 0.533 s alone or when a lent
    engine yields to it, plus `sync.lend_switch_s`; 0.533 / (1 - 0.35) with an engine running on
    beside it. The policy observes the trainer's busy seconds and samples in the steps no engine ran
    on beside."""
    base = 16 * (TOKENS_IN + TOKENS_OUT) / 12000.0
    off = simulate(scenario(lend=False, steps=12))
    assert off["train_s"] == pytest.approx(base, rel=1e-9)
    on = Simulation(scenario(steps=12, switch_s=0.1))
    out = on.run()
    total = sum(r["train_s"] for r in out["step_records"])
    assert out["lent_ran_on"] == 0 and out["lent_yields"] >= 3
    assert total == pytest.approx(12 * base + 0.1 * out["lent_yields"], rel=1e-9)
    window = on.lending.window  # the policy's (no change applied: elastic off)
    assert window.alone_s == pytest.approx(12 * base) and window.alone_samples == 12 * 16
    assert window.yield_s == pytest.approx(0.1 * out["lent_yields"]) and window.beside_s == 0.0
    # a trainer that never waits: the lent engine's first groups run on beside steps past eta
    beside = Simulation(scenario(engine_tok_s=6000.0, train_tok_s=2000.0, groups_per_engine=4, steps=12))
    out = beside.run()
    ran_on, step_s = beside.lending.ran_on, 16 * (TOKENS_IN + TOKENS_OUT) / 2000.0
    assert ran_on > 0
    total = sum(r["train_s"] for r in out["step_records"])
    assert total == pytest.approx((12 - ran_on) * step_s + ran_on * step_s / 0.65, rel=1e-9)
    starts = 12 + beside.trainer.busy  # a step may have started when the run ended
    window = beside.lending.window
    assert window.alone_s == pytest.approx((starts - ran_on) * step_s)
    assert window.alone_samples == (starts - ran_on) * 16
    assert window.beside_s == pytest.approx(ran_on * step_s / 0.65)


def run_checked(
    s, sim: Simulation | None = None, check: Callable[[Simulation], list[str]] | None = None
) -> tuple[Simulation, list[int], list[str]]:
    """Run `s` (or `sim`, built from it) event by event; at each step start note which lent engines run
    on beside it (and how old their oldest group with an episode at home is), and after every event
    check that no other lent engine decodes while the trainer is busy (and `check`'s violations).
    Returns the simulation, the run-on ages and the violations."""
    sim = sim or Simulation(s)
    lending = sim.lending
    assert lending is not None
    allowed: set[int] = set()
    ages: list[int] = []
    step_starts = lending.step_starts

    def noting(version: int, seconds: float, tokens: float, samples: int) -> float:
        out = step_starts(version, seconds, tokens, samples)
        allowed.clear()
        for e in lending.engines:
            mine = [g.version for g in lending.groups.values() if g.lent is e and g.pending > g.episodes_away]
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
        if check is not None:
            violations += check(sim)
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


def test_a_trainer_bound_run_keeps_its_engine_where_lending_costs_nothing_measured():
    """r = 20, t = 10 samples/s on one train slot: the trainer barely waits, its engine yields to every
    step and none runs on beside one, so the steps measured alone are all of them and lending costs
    nothing: the elastic policy keeps the engine (an assumed 5% slowdown had it reclaimed at step 5)."""
    out = simulate(scenario(engine_tok_s=6000.0, train_tok_s=4000.0, elastic=True, steps=20))
    assert out["lent_ran_on"] == 0
    acts = [e["what"] for e in out["events"] if e.get("what") in ("lend", "reclaim")]
    assert acts == [] and out["lent_slots"] == 1
    holds = [e for e in out["events"] if e.get("kind") == "elastic" and e.get("what") == "hold"]
    assert holds and all(e["train_rate_alone"] == pytest.approx(e["train_rate"]) for e in holds[1:])


def test_the_policy_reads_lendings_cost_over_its_window_and_reclaims_on_what_it_measured():
    """r = 20, t = 5 samples/s: the lent engine's first groups, caught by the first step, run on beside
    the step that trains version 4, 35% slower. Each boundary reads the steps since the last change,
    not its own step: the rate alone stays t = 5 and the slowdown is the run-on step's share of the
    window's time (3.2 s alone a step, 3.2 / 0.65 beside: 11.9% over 4 steps, 9.7% over 5). At step 5,
    past the dwell, that measured cost is more than lending gives a trainer-bound pipeline: reclaim;
    the window starts afresh after it."""
    s = scenario(engine_tok_s=6000.0, train_tok_s=2000.0, elastic=True, groups_per_engine=4, steps=12)
    out = simulate(s)
    assert out["lent_ran_on"] == 1
    seen = [e for e in out["events"] if e.get("kind") == "elastic" and "lend_slowdown" in e]
    assert all(e["train_rate_alone"] == pytest.approx(5.0) for e in seen)
    assert [e["lend_slowdown"] for e in seen[:3]] == [0.0, 0.0, 0.0]
    assert seen[3]["step"] == 4 and seen[3]["train_rate"] == pytest.approx(0.65 * 5.0)
    assert seen[3]["lend_slowdown"] == pytest.approx(1 - 4 * 3.2 / (3 * 3.2 + 3.2 / 0.65))
    reclaim = seen[4]
    assert (reclaim["step"], reclaim["what"], reclaim["applied"]) == (5, "reclaim", True)
    assert reclaim["lend_slowdown"] == pytest.approx(1 - 5 * 3.2 / (4 * 3.2 + 3.2 / 0.65))
    assert all(e["what"] == "hold" and e["lend_slowdown"] is None for e in seen[5:])  # nothing lends
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
    # rollout-bound, idle trainer: lending pays, its engines taking groups (2 an engine)
    assert best.lend and best.mode != "sync" and best.summary["lent_groups"] > 0
    assert best.trained_tok_s > 1.2 * max(r.trained_tok_s for r in rows if not r.lend)


def test_the_rollout_engines_free_sequences_are_their_limit_less_what_runs_and_waits():
    """Each engine's limit (the per-worker groups times the group size, else its max_running) less the
    sequences it runs; the requests waiting for a rollout engine take the most room first."""
    engines = [SimpleNamespace(max_running=64, b=10), SimpleNamespace(max_running=64, b=30)]
    assert free_sequences(engines, 32, 0) == [22, 2]
    assert free_sequences(engines, 32, 5) == [17, 2]
    assert free_sequences(engines, None, 40) == [14, 34]
    assert free_sequences(engines, None, 200) == [0, 0]
    assert free_sequences(engines, 8, 0) == [0, 0]  # running past the limit: no room, not less


def test_a_yielding_engine_hands_over_what_the_rollout_engine_has_room_for():
    """A rollout engine with room (8 groups of 4 a worker: 32 sequences) and multi-turn episodes of
    spread lengths: at the steps' starts the lent engine's episodes move to the rollout engine as far
    as its free sequences go (the runtime's plan); a handed-over episode never again runs or waits on
    a lent engine and ends on the rollout engines, no group is lost, and no lent engine decodes during
    a step but one running on past eta."""
    base = scenario(groups_per_engine=8, sigma=1.0, steps=15)
    workload = base.workload.model_copy(update={"turns_mean": 3.0, "max_turns": 6})
    s = base.model_copy(update={"workload": workload})
    sim = Simulation(s)
    lending = sim.lending
    handed = []

    def on_lent_engines(sim: Simulation) -> list[str]:
        # every request on its way to a rollout engine is counted in prefill: a pending "ready" of a
        # rollout-side episode, or a handed-over one re-prefilling its prefix (no tail here: every
        # migration is a hand-over)
        pending = sum(
            kind in ("handed", "migrated") or (kind == "ready" and obj.lent_engine is None)
            for _, _, kind, obj, _ in sim.events
        )
        out = (
            []
            if sim.prefilling == pending
            else [f"t={sim.now:.3f}: prefilling {sim.prefilling} != {pending}"]
        )
        for e in lending.engines:
            for req in [*(r for _, _, r in e.running), *lending.queues[e]]:
                if req.handed:
                    out.append(f"t={sim.now:.3f}: a handed-over episode is on lent engine {e.eid}")
        for e in sim.engines:
            handed.extend(r for _, _, r in e.running if r.handed and r not in handed)
        return out

    sim, _, violations = run_checked(s, sim, on_lent_engines)
    assert not violations, violations[:3]
    events = [e for e in sim.rec.events if e.get("what") == "lent_hand_over"]
    assert lending.handed_over == sum(e["episodes"] for e in events) > 0
    assert handed  # they ran on the rollout engines
    started = next(sim.groups)
    assert started == sum(sim.store.reuse_histogram().values()) + sim.store.in_flight()
    assert lending.started == lending.stored_groups + len(lending.groups)
    for g in lending.groups.values():
        assert 0 <= g.episodes_away <= g.pending == len(g.episodes)
        assert g.episodes_away == sum(r.handed for r in g.episodes)


def test_a_group_handed_over_whole_frees_its_lent_engine_and_makes_it_run_on_no_more():
    """A lent group with every episode on the rollout engines counts in no lent engine's load and does
    not make its engine run on past eta (the engine yields, as the runtime's does); with one episode
    back home it does both."""
    sim = Simulation(scenario(steps=5))
    lending = sim.lending
    engine = lending.engines[0]
    g = sim.start_group(lent=engine)
    lending.groups[g.gid] = g
    for req in g.episodes:
        req.handed = True
    assert g.episodes_away == g.pending
    assert lending.loads()[engine] == 0 and lending.at_home(engine) == []
    lending.step_starts(10, 1.0, 1.0, 1)
    assert lending.ran_on == 0 and lending.yields == 1 and engine.paused == 1
    g.episodes[0].handed = False
    assert g.episodes_away == g.pending - 1
    assert lending.loads()[engine] == 1 and lending.at_home(engine) == [g.episodes[0]]
    lending.step_starts(11, 1.0, 1.0, 1)
    assert lending.ran_on == 1 and engine.paused == 0


def test_the_rollout_side_counts_handed_over_episodes_in_its_room_and_its_group_cap():
    """One rollout engine with no tail gate polling it (its groups counted whole, as the runtime's gate
    counts them): free sequences = 8 groups x 4 less 4 per rollout group in flight less the episodes
    handed over; and the rollout group cap (2 a worker here) counts handed-over episodes as groups."""
    sim = Simulation(scenario(groups_per_engine=8, steps=5))
    lending, engine = sim.lending, sim.engines[0]
    sim.start_group()
    sim.start_group()
    g = sim.start_group(lent=lending.engines[0])
    lending.groups[g.gid] = g
    for req in g.episodes[:3]:
        req.handed = True
    assert lending.rollout_free([engine]) == [32 - 2 * 4 - 3]
    capped = Simulation(scenario(groups_per_engine=2, steps=5))
    lending = capped.lending
    capped.start_group()
    g = capped.start_group(lent=lending.engines[0])
    lending.groups[g.gid] = g
    assert capped.admission_room() > 0  # one rollout group of two
    for req in g.episodes:  # a group's worth of episodes (4) on the rollout engine
        req.handed = True
    assert capped.admission_room() == 0
