"""The loops' bounds: the staleness the async/reflow admission allows, counted from the
engines' confirmed weights and the groups actually trained; the time budget as arithmetic.

The simulations drive the real policy objects (`AdmissionControl`, `plan_batch` on a real ReplayStore)
the way `decoupled_loop` does, with made-up durations instead of models."""

from __future__ import annotations

import heapq

import pytest
from replay_helpers import make_group

from reflow.policy.dual_cycle import AdmissionControl, CycleConfig
from reflow.recipes.run_state import out_of_time
from reflow.recipes.weight_sync import EngineVersions
from reflow.replay import ReplayStore
from reflow.replay.planning import consume, plan_batch

# ---- the time budget


def test_no_step_starts_that_the_budget_cannot_fit():
    assert not out_of_time(None, 10**6, 10**6)  # no budget
    assert out_of_time(60.0, 60.0) and out_of_time(60.0, 75.0)  # spent
    assert not out_of_time(60.0, 59.0)  # nothing expected: work may start
    # the reported run: train.seconds=60, steps of ~20 s then 37 s. After two steps (57 s, mean
    # 28.5 s) a third would end at ~85 s: it does not start, and the phase ends at 57 s, not 96 s.
    assert not out_of_time(60.0, 20.0, 20.0)  # step 2 fits (ends at ~40 s by the estimate)
    assert out_of_time(60.0, 57.0, 57.0 / 2)
    assert not out_of_time(60.0, 30.0, 30.0) and out_of_time(60.0, 30.0, 30.5)  # ends at the budget: fits


def test_fresh_staleness_bound_arithmetic():
    assert AdmissionControl(eta=1, groups_per_step=8).max_fresh_staleness() == 1  # async: eta
    assert AdmissionControl(eta=0, groups_per_step=8).max_fresh_staleness() == 0
    # calc-tiny's reflow settings (B 8, eta 1, share_max 0.5): a step may train only 4 fresh groups,
    # so the (eta + 1) * B = 16 groups admitted ahead take 4 steps: staleness up to 3
    assert AdmissionControl(eta=1, groups_per_step=8).max_fresh_staleness(0.5) == 3
    assert AdmissionControl(eta=1, groups_per_step=8).max_fresh_staleness(0.25) == 2  # ceil(16 / 6) - 1
    with pytest.raises(ValueError, match="no fresh group"):
        AdmissionControl(eta=1, groups_per_step=4).max_fresh_staleness(1.0)


def test_admission_counts_the_groups_trained_not_the_steps():
    adm = AdmissionControl(eta=1, groups_per_step=4)
    # version 3 in async mode: 12 trained, 8 may be ahead
    assert adm.room(3, accepted=12, in_flight=0) == adm.room(3, accepted=12, in_flight=0, trained=12) == 8
    # reflow: the three steps trained only 6 fresh groups (replay filled the rest); the 6 accepted
    # groups that wait plus 2 in flight already fill the (eta + 1) * B = 8 allowed ahead
    assert adm.room(3, accepted=12, in_flight=2, trained=6) == 0
    with pytest.raises(ValueError, match="trained"):
        adm.capacity(0, trained=-1)


# ---- simulations: the driver's counting against the staleness each trained group gets


def _run(
    store: ReplayStore,
    *,
    B: int,
    eta: int,
    share: float,
    steps: int,
    gen_s,
    train_s: float,
    push_s: float,
    counting: str,
    workers: int = 10**6,
) -> dict[str, list[int]]:
    """A decoupled loop in simulated time. At most `workers` groups run at once; each takes
    gen_s(start time) seconds, and they arrive in start order; a step takes train_s; its weights reach the (single) engine push_s after it ends, and a
    group is generated with the weights the engine has when it starts. Admission counts as the loop
    does (counting="confirmed": the engine's confirmed version and the fresh groups trained by it),
    or as it used to ("trainer": the trainer's version, each step counted as B fresh groups).
    Returns the staleness of every trained fresh / replayed group and how many groups were ahead."""
    adm = AdmissionControl(eta, B)
    cfg = CycleConfig(tau_max=2, max_reuse=2, share_init=share, share_max=share)
    engine = EngineVersions(1, version=0)
    events: list[tuple[float, int, str, int]] = []  # (time, seq, kind, payload)
    trained, accepted, in_flight, version, now, n, last_arrival = {0: 0}, 0, 0, 0, 0.0, 0, 0.0
    step_fresh: int | None = None
    out: dict[str, list[int]] = {"fresh": [], "replay": [], "ahead": []}
    while version < steps:
        confirmed = engine.min_confirmed
        args = (trained[confirmed],) if counting == "confirmed" else ()
        start_version = confirmed if counting == "confirmed" else version
        while in_flight < workers and adm.may_start(start_version, accepted, in_flight, *args):
            gid = f"g{n}"
            store.begin_group(gid, confirmed)
            last_arrival = max(now + gen_s(now), last_arrival + 1e-6)  # in start order
            heapq.heappush(events, (last_arrival, n, "group", confirmed))
            n, in_flight = n + 1, in_flight + 1
        out["ahead"].append(accepted - trained[confirmed] + in_flight)
        if step_fresh is None:
            plan = plan_batch(store, want=B, current_version=version, share=share, cfg=cfg)
            if plan.size == B:
                consume(store, plan, step=version + 1)
                out["fresh"] += [version - g.policy_version for g in plan.fresh]
                out["replay"] += [version - g.policy_version for g in plan.replay]
                step_fresh = len(plan.fresh)
                heapq.heappush(events, (now + train_s, -1, "step", 0))
        now, seq, kind, payload = heapq.heappop(events)
        if kind == "group":
            store.add_group(*make_group(f"g{seq}", [0.0, 1.0], version=payload, n_turns=1, tokens=2))
            accepted, in_flight = accepted + 1, in_flight - 1
        elif kind == "step":
            version += 1
            trained[version] = trained[version - 1] + step_fresh
            step_fresh = None
            for _ in engine.publish(version):
                heapq.heappush(events, (now + push_s, -2, "push", version))
        else:
            following = engine.confirm(0, payload)
            if following is not None:
                heapq.heappush(events, (now + push_s, -2, "push", following))
    return out


@pytest.mark.parametrize("counting", ["confirmed", "trainer"])
def test_async_staleness_counts_from_the_weights_the_engines_confirmed(tmp_path, counting):
    """Async mode, groups arriving in start order, weights that take a while to reach the engine:
    counted from the trainer's version, a group started right after a step is generated with the
    previous weights and trained eta + 1 versions later; counted from the confirmed version, never."""
    with ReplayStore(tmp_path / "r.sqlite", "r") as store:
        out = _run(
            store,
            B=2,
            eta=1,
            share=0.0,
            steps=8,
            gen_s=lambda t: 0.5,
            train_s=1.0,
            push_s=0.6,
            counting=counting,
        )
    if counting == "confirmed":
        assert max(out["fresh"]) <= 1
    else:
        assert max(out["fresh"]) == 2  # what the old count allowed


@pytest.mark.parametrize("counting", ["confirmed", "trainer"])
def test_reflow_keeps_fresh_groups_within_the_documented_bound(tmp_path, counting):
    """Reflow mode: slow rollouts first (steps go ahead on half replay), then fast ones. Counting each
    step as B fresh groups let generation run further ahead with every step that replay filled, and
    fresh groups were trained staler than the bound (6 versions here); counting the groups trained
    keeps them within it, keeps at most (eta + 1) * B groups ahead, and replayed groups stay within
    tau_max."""
    B, eta, share = 4, 1, 0.5
    bound = AdmissionControl(eta, B).max_fresh_staleness(share)
    with ReplayStore(tmp_path / "r.sqlite", "r") as store:
        out = _run(
            store,
            B=B,
            eta=eta,
            share=share,
            steps=36,
            gen_s=lambda t: 2.0 if t < 20 else 0.1,
            train_s=1.0,
            push_s=0.0,
            counting=counting,
            workers=3,
        )
    assert max(out["replay"]) <= 2  # tau_max
    if counting == "confirmed":
        assert max(out["fresh"]) <= bound and max(out["ahead"]) <= (eta + 1) * B
    else:
        assert max(out["fresh"]) > bound + 1  # the old count: the bound did not hold


def _two_engines(
    store: ReplayStore, *, B: int, eta: int, steps: int, push_s: tuple[float, float], counting: str
):
    """Async mode in simulated time with two engines: a rollout worker (engine 0) and a lent engine
    (engine 1), each running up to B groups of 1 s (arriving in start order), steps of 1 s, and each
    new version reaching engine e push_s[e] after its step (a lent engine loads it on its trainer's
    core). A start is admitted against its own engine's confirmed version (counting="own", the loop's)
    or the oldest over both ("oldest", the loop's before). Returns the staleness of every trained
    group, the groups each engine started and the simulated seconds the steps took."""
    adm = AdmissionControl(eta, B)
    cfg = CycleConfig(tau_max=0, max_reuse=1, share_init=0.0, share_max=0.0)
    engines = EngineVersions(2, version=0)
    events: list[tuple[float, int, str, tuple[int, int]]] = []
    trained, accepted, in_flight, version, now, n, last = {0: 0}, 0, 0, 0, 0.0, 0, 0.0
    load, starts, stale, step_fresh = [0, 0], [0, 0], [], None
    while version < steps:
        for e in (0, 1):
            while load[e] < B:
                v = engines.confirmed[e] if counting == "own" else engines.min_confirmed
                if not adm.may_start(v, accepted, in_flight, trained[v]):
                    break
                store.begin_group(f"g{n}", engines.confirmed[e])
                last = max(now + 1.0, last + 1e-6)
                heapq.heappush(events, (last, n, "group", (e, engines.confirmed[e])))
                n, in_flight, load[e], starts[e] = n + 1, in_flight + 1, load[e] + 1, starts[e] + 1
        if step_fresh is None:
            plan = plan_batch(store, want=B, current_version=version, share=0.0, cfg=cfg)
            if plan.size == B:
                consume(store, plan, step=version + 1)
                stale += [version - g.policy_version for g in plan.fresh]
                step_fresh = len(plan.fresh)
                heapq.heappush(events, (now + 1.0, -1, "step", (0, 0)))
        now, seq, kind, (e, v) = heapq.heappop(events)
        if kind == "group":
            store.add_group(*make_group(f"g{seq}", [0.0, 1.0], version=v, n_turns=1, tokens=2))
            accepted, in_flight, load[e] = accepted + 1, in_flight - 1, load[e] - 1
        elif kind == "step":
            version += 1
            trained[version] = trained[version - 1] + step_fresh
            step_fresh = None
            for w in engines.publish(version):
                heapq.heappush(events, (now + push_s[w], -2, "push", (w, version)))
        else:
            following = engines.confirm(e, v)
            if following is not None:
                heapq.heappush(events, (now + push_s[e], -2, "push", (e, following)))
    return stale, starts, now


def test_a_lagging_lent_engine_holds_back_only_its_own_starts(tmp_path):
    """Each start is admitted against the weights of the engine it starts on: every group is still
    trained at most eta versions stale, and a lent engine whose weights arrive late (3 s after each
    1-s step) no longer shrinks the rollout worker's room, as counting from the oldest engine did."""
    runs = {}
    for counting in ("own", "oldest"):
        with ReplayStore(tmp_path / f"{counting}.sqlite", "r") as store:
            runs[counting] = _two_engines(store, B=4, eta=1, steps=12, push_s=(0.1, 3.0), counting=counting)
    (stale, starts, seconds), (_, old_starts, old_seconds) = runs["own"], runs["oldest"]
    assert max(stale) <= 1
    assert starts[0] > old_starts[0] and seconds < old_seconds


# ---- a step the trainer did not take


def test_a_step_with_no_sampled_token_keeps_the_version_and_pushes_nothing(tmp_path, monkeypatch):
    """The real trainer, given rows with no sampled token, changes nothing and says so (`updates` 0,
    every health metric present); the decoupled loop's step end then leaves step and version where the
    trainer's are, pushes no weights and counts the step as not taken."""
    import ray
    from engine_helpers import build_tiny_engine_model
    from rich.console import Console

    from reflow.config import load_config
    from reflow.policy.dual_cycle import ReplayShare
    from reflow.recipes import decoupled
    from reflow.recipes.run_log import RunLog, read_metrics
    from reflow.recipes.run_state import Clock, RunState
    from reflow.records import Segment
    from reflow.runtime.replay_service import PlannedBatch
    from reflow.runtime.workers import GroupReport
    from reflow.train.trainer import PolicyTrainer, TrainRow

    _, model, _ = build_tiny_engine_model(tmp_path / "model")
    trainer = PolicyTrainer(model, 0)
    prompt_only = Segment(0)
    prompt_only.extend_prompt([5, 6, 7])
    metrics = trainer.train_step([TrainRow(prompt_only, 1.0)], step=4)
    assert metrics["updates"] == 0 and trainer.version == 0
    assert {"masked_frac", "kl_behav", "is_ess"} <= set(metrics)

    class Pushes:
        confirmed, published = 3, []

        def publish(self, version):
            self.published.append(version)

    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    ray.init(address="local", num_cpus=1, include_dashboard=False)
    try:
        config = load_config(
            None, ["env.id=reflow/Calc-v0", "mode=reflow", f"out_dir={tmp_path}", "run_name=r"]
        )
        state = RunState(step=3, version=3)
        log = RunLog(tmp_path / "r", Console(quiet=True))
        plan = PlannedBatch(["a", "b"], [0, 1], {"batch_fresh": 2})
        step = decoupled.StepInFlight([ray.put(metrics)], plan, 0.0, 0.0)
        share = ReplayShare(decoupled.cycle_config(config))
        cluster = type("Cluster", (), {"rollout": [None]})()
        weights = Pushes()
        report = GroupReport("a", 3, [0.0, 1.0], [False, True], ["ok", "ok"], [1, 1], 12, True, 1.0)
        decoupled._finish_step(
            cluster, config, log, state, Clock(state), step, [report], share, weights, dict
        )
        log.close()
    finally:
        ray.shutdown()
    assert (state.step, state.version, state.steps_no_signal) == (3, 3, 1)
    assert weights.published == [] and share.history == []
    assert state.generated_tokens == 12  # the rollout that step took still counts
    assert read_metrics(tmp_path / "r", "no_signal")[-1]["groups"] == 2


# ---- after a step


def test_after_a_step_the_evaluation_point_comes_first_and_the_checkpoint_holds_it(monkeypatch):
    """Both loops end a trained step with `after_step`: an evaluation point if one is due, then a
    checkpoint if one is due (every `checkpoint_every` steps and at the last), which saves the
    adaptive state `scheduler` gives (the decoupled loop's) and so holds the point taken before it."""
    from reflow.config import load_config
    from reflow.recipes import checkpoints
    from reflow.recipes.run_state import RunState

    done = []
    monkeypatch.setattr(
        checkpoints, "evaluate", lambda cluster, config, log, state, clock: done.append(state.step)
    )
    monkeypatch.setattr(
        checkpoints, "checkpoint", lambda cluster, config, state: done.append(dict(state.scheduler))
    )
    overrides = ["eval.every=2", "train.checkpoint_every=4", "train.steps=5"]
    config = load_config(None, ["env.id=reflow/Calc-v0", *overrides])
    state = RunState()
    for step in range(1, 6):
        state.step = step
        checkpoints.after_step(None, config, None, state, None, scheduler=lambda: {"saved_at": state.step})
    assert done == [2, 4, {"saved_at": 4}, {"saved_at": 5}]

    done.clear()  # the sync loop: no adaptive state to save
    state = RunState(step=4)
    checkpoints.after_step(None, config, None, state, None)
    assert done == [4, {}]
