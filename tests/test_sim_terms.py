"""Cost-model terms and runtime behaviours of the simulator added for its calibration: KV-pressure
slowdown, the colocated wake-up, the in-flight-dependent resume after a partial-rollout sync, and the
runtime's tail gate (B + delta groups per batch); analytic where the term allows."""

from __future__ import annotations

import pytest
from test_sim import constant, scenario

import reflow.sim.simulation as simulation
from reflow.sim.costs import decode_model, sync_s


def test_kv_pressure_slows_the_compute_term_only_while_a_request_waits_for_cache():
    # Two constant requests (100 prompt + 300 tokens) on one engine whose cache holds one at a time:
    # the first decodes while the second waits (a full cache: preemption and recompute in vLLM), at
    # kv_pressure_slowdown x the per-sequence term; the second then decodes alone at the plain rate.
    kv = (80 * 0.5 - 3.0) * 1e9 / 600  # bytes per token for a 600-token cache: room for one request
    over = {
        "gpus": 1,
        "model": {"name": "M", "params_b": 1.5, "kv_bytes_per_token": kv},
        "batch": {"groups": 1, "samples_per_group": 2},
        "mode": {"mode": "sync"},
    }

    def step(factor: float) -> float:
        return simulation.simulate(constant(decode={"kv_pressure_slowdown": factor}, **over))[
            "seconds_per_step"
        ]

    s = constant(**over)
    dm = decode_model(s.gpu, s.model, s.decode)
    assert dm.kv_capacity_tokens == pytest.approx(600)
    L = 300
    assert step(3.0) - step(1.0) == pytest.approx(2.0 * dm.per_seq_s * L, rel=1e-9)
    # a cache that holds both: nothing waits, the factor never applies
    roomy = {**over, "model": {**over["model"], "kv_bytes_per_token": kv / 4}}
    assert simulation.simulate(constant(decode={"kv_pressure_slowdown": 3.0}, **roomy))[
        "seconds_per_step"
    ] == (pytest.approx(simulation.simulate(constant(**roomy))["seconds_per_step"], rel=1e-12))


def test_colocated_engines_wake_up_after_each_sync_inside_the_generation_phase():
    # sync: the next batch's prefill runs while the engines wake up, so the step grows by the wake-up
    # less that prefill, and verl's `gen` column (the trainer's wait) holds it
    plain = simulation.simulate(constant(mode={"mode": "sync"}))
    s = constant(mode={"mode": "sync"}, sync={"colocated_wake_s": 9.0})
    woken = simulation.simulate(s)
    prefill = 100 * decode_model(s.gpu, s.model, s.decode).prefill_s_per_token
    assert woken["seconds_per_step"] == pytest.approx(plain["seconds_per_step"] + 9.0 - prefill, rel=1e-9)
    assert woken["trainer_wait_s"] - plain["trainer_wait_s"] == pytest.approx(9.0 - prefill, rel=1e-6)
    separate = {"mode": "async", "eta": 0, "partial_rollout": False, "rollout_gpus": 4}  # not colocated
    assert simulation.simulate(constant(mode=separate, sync={"colocated_wake_s": 9.0}))[
        "seconds_per_step"
    ] == (pytest.approx(simulation.simulate(constant(mode=separate))["seconds_per_step"], rel=1e-12))


def test_resume_after_a_sync_is_paid_only_by_engines_with_interrupted_requests():
    from reflow.sim.engines import GroupState, Request

    # eta 0: nothing is in flight when the trainer syncs, so no engine has anything to resume
    mode = {"mode": "async", "eta": 0, "partial_rollout": True, "rollout_gpus": 4}
    plain = simulation.simulate(constant(mode=mode))
    slow = simulation.simulate(constant(mode=mode, sync={"resume_s": 7.0}))
    assert slow["seconds_per_step"] == pytest.approx(plain["seconds_per_step"], rel=1e-12)
    assert slow["resume_s_mean"] == 0.0
    # eta 2, a fast trainer: requests are in flight at every sync; each engine holding some pays
    # resume_s plus the re-prefill of their contexts (the new weights invalidate the prefix cache)
    mode = {"mode": "async", "eta": 2, "partial_rollout": True, "rollout_gpus": 4}
    fast = {"mfu": 0.9, "fixed_s": 0.0}
    plain = simulation.simulate(constant(mode=mode, train=fast))
    slow = simulation.simulate(constant(mode=mode, train=fast, sync={"resume_s": 7.0}))
    assert slow["resume_s_mean"] > 7.0 and slow["seconds_per_step"] > plain["seconds_per_step"]
    sim = simulation.Simulation(constant(mode=mode, sync={"resume_s": 7.0}))
    e, g = sim.engines[0], GroupState("g", 0, 2, 0.0)
    assert sim.trainer.resume_pause(e) == 0.0  # nothing running
    for seq, ctx in enumerate((100, 250)):
        e.admit(Request(g, None, ctx=ctx, left=50), seq)
    assert sim.trainer.resume_pause(e) == pytest.approx(7.0 + 350 * sim.dm.prefill_s_per_token, rel=1e-12)
    drained = {"mode": "one_step_off", "rollout_gpus": 4}  # drains before the sync: nothing to resume
    assert simulation.simulate(constant(mode=drained, sync={"resume_s": 7.0}))[
        "seconds_per_step"
    ] == pytest.approx(simulation.simulate(constant(mode=drained))["seconds_per_step"], rel=1e-12)


def test_the_tail_gate_bounds_a_batch_to_b_plus_delta_as_the_runtime_loop_does():
    # eta 4 alone would let 5 B groups be untrained or in flight; the runtime's tail gate with its batch
    # cap (the default) allows the batch being collected at most B + delta (delta <= floor(B x
    # over_provision_max)) done or running
    s = scenario(
        run={"steps": 8, "warmup_steps": 1, "seed": 3},
        mode={
            "mode": "reflow",
            "eta": 4,
            "rollout_gpus": 4,
            "tail": True,
            "tail_config": {"over_provision_max": 0.5},
        },
    )

    def peak(s) -> int:
        sim = simulation.Simulation(s)
        seen, real_fill = [], sim.fill

        def fill() -> None:
            real_fill()
            seen.append(sim.store.reuse_histogram(spread=True).get(0, 0) + sim.store.in_flight())

        sim.fill = fill
        sim.run()
        return max(seen)

    B = s.batch.groups
    assert peak(s) <= B + B // 2
    assert peak(s.model_copy(update={"mode": s.mode.model_copy(update={"tail": False})})) > B + B // 2
    # without the batch cap (`tail.batch_cap=false`) admission's window bounds it
    uncapped = s.mode.model_copy(update={"tail_config": {"over_provision_max": 0.5, "batch_cap": False}})
    assert B + B // 2 < peak(s.model_copy(update={"mode": uncapped})) <= 5 * B


def test_a_drain_before_the_sync_counts_as_the_trainers_wait():
    # one-step-off (no partial rollout): after its update the trainer waits for the engines to finish
    # the next batch before it syncs (verl's wait_prev_gen). With generation on 1 GPU slower than the
    # update on 7, every step is that wait + the update + the sync, and the wait is reported.
    s = constant(mode={"mode": "one_step_off", "rollout_gpus": 1}, train={"fixed_s": 0.2})
    out = simulation.simulate(s)
    sync = sync_s(s.model, s.sync, colocated=False)
    assert out["trainer_wait_s"] > 0.5 * out["train_s"]
    assert out["trainer_wait_s"] + out["train_s"] + sync == pytest.approx(out["seconds_per_step"], rel=1e-6)
