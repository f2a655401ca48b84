"""Over-provisioned sync rounds with an abort at the target (reflow/sim/oversample.py: slime's rollout
loop, APRIL's --over-sampling-batch-size and --partial-rollout): the loop's arithmetic, that no token is
generated twice or lost across an abort, that a work-conserving engine gains nothing from it, that one
chunk of B groups is the plain sync mode, and the rollout-phase throughput the validation compares."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from reflow.errors import ConfigError
from reflow.sim.config import load_scenario, validate_scenario
from reflow.sim.engines import GroupState
from reflow.sim.oversample import OverProvision
from reflow.sim.simulation import Simulation, simulate
from reflow.sim.validate import rollout_tokens_per_s

RATE = 5000.0  # tokens/s of the one constant-rate engine
ROOT = Path(__file__).resolve().parents[1]


def scenario(
    *,
    over: int | None = None,
    carry: bool = False,
    zero: float = 0.0,
    rate: float | None = RATE,
    steps: int = 12,
    mode: str = "sync",
) -> dict:
    """One engine, 4 groups of 4 per step, lognormal lengths with a long tail, no prefill (a measured
    engine), no sync cost. `rate`: a constant-rate engine (processor sharing at `rate` tokens/s whatever
    the batch); None: the H100-like cost model, whose rate grows with the batch."""
    decode = (
        {"engine_tokens_per_s": rate, "iter_fixed_s": 0.0, "max_running": 1024}
        if rate is not None
        else {"max_running": 1024, "kv_memory_fraction": 0.9}
    )
    m: dict = {"mode": mode}
    if over is not None:
        m.update(over_sampling_groups=over, abort_carry=carry)
    return {
        "gpus": 1,
        "gpu": {"hbm_gb_s": 3350, "bf16_tflops": 989, "memory_gb": 80},
        "model": {"params_b": 1.0, "kv_bytes_per_token": 100_000},
        "decode": decode,
        "train": {"fixed_s": 1.0, "logprob_factor": 0, "ref_factor": 0},
        "sync": {"colocated_s": 0.5},
        "workload": {
            "prompt_tokens": {"median": 100, "sigma": 0},
            "response_tokens": {"median": 400, "sigma": 1.0},
            "group_sigma": 0.5,
            "max_response_tokens": 4000,
            "zero_spread_prob": zero,
        },
        "batch": {"groups": 4, "samples_per_group": 4},
        "mode": m,
        "run": {"steps": steps, "warmup_steps": 2, "seed": 3},
    }


def _group(gid: str) -> GroupState:
    return GroupState(gid, 0, 4, 0.0)


# ---- the loop's arithmetic (OverProvision)


def test_one_chunk_starts_and_a_filtered_group_starts_another_once_short_of_the_target():
    """slime: submit a chunk while (submitted - filtered) < target. Chunk B: the first filtered group
    starts a second chunk; chunk 2B: only the (B+1)-th filtered group does."""
    p = OverProvision(want=4, chunk=4)
    assert p.left() == 4
    groups = [_group(f"g{i}") for i in range(4)]
    for g in groups:
        p.start(g)
    assert p.left() == 0
    p.done(groups[0], has_spread=True)
    assert p.left() == 0
    p.done(groups[1], has_spread=False)  # 4 started - 1 filtered < 4: another chunk of 4
    assert p.left() == 4

    q = OverProvision(want=4, chunk=8)
    gs = [_group(f"h{i}") for i in range(8)]
    for g in gs:
        q.start(g)
    for g in gs[:4]:
        q.done(g, has_spread=False)  # 8 - 4 = 4: not short
    assert q.left() == 0
    q.done(gs[4], has_spread=False)  # 8 - 5 < 4
    assert q.left() == 8


def test_close_stops_the_round_and_returns_the_unfinished_groups_in_start_order():
    p = OverProvision(want=2, chunk=4)
    gs = [_group(f"g{i}") for i in range(4)]
    for g in gs:
        p.start(g)
    p.done(gs[1], True)
    p.done(gs[3], True)
    assert [g.gid for g in p.close()] == ["g0", "g2"]
    assert p.left() == 0 and not p.live
    p.reset()
    assert p.left() == 4


def test_a_chunk_below_the_batch_is_refused():
    with pytest.raises(ValueError, match="below"):
        OverProvision(want=4, chunk=3)


@pytest.mark.parametrize(
    "mode, message",
    [
        ({"mode": "async", "over_sampling_groups": 8}, "needs mode sync"),
        ({"mode": "sync", "over_sampling_groups": 8, "resample_rounds": 1}, "needs mode sync"),
        ({"mode": "sync", "abort_carry": True}, "abort_carry needs over_sampling_groups"),
        ({"mode": "sync", "over_sampling_groups": 3}, "below batch.groups"),
    ],
)
def test_invalid_over_sampling_settings_are_errors(mode, message):
    data = scenario()
    data["mode"] = mode
    data["gpus"] = 2
    with pytest.raises(ConfigError, match=message):
        validate_scenario(data)


# ---- the abort and the carry in the simulation


def test_one_chunk_of_the_batch_without_filtered_groups_is_the_plain_sync_mode():
    """Over-sampling B groups with no group filtered starts exactly the batch and aborts nothing: the
    same run, step for step, as the sync mode's own admission control."""
    plain = simulate(validate_scenario(scenario(rate=None)))
    slime = simulate(validate_scenario(scenario(over=4, rate=None)))
    assert slime["step_records"] == plain["step_records"]
    assert slime["off_policy_ratio"] == 0.0


def test_no_token_is_generated_twice_or_lost_across_aborts():
    """With the carry, every generated token is in a trained group or in a carried group's progress:
    generated = sum over trained groups of their tokens + sum over carried groups of (their tokens -
    what their unfinished samples still have to generate)."""
    sim = Simulation(validate_scenario(scenario(over=8, carry=True, rate=None)))
    trained: list[float] = []
    original = sim.rec.trained

    def record(plan, version, samples):
        trained.extend(g.meta["generated"] for g in plan.groups)
        original(plan, version, samples)

    sim.rec.trained = record
    out = sim.run()
    # the run ends right after a sync: the carried groups were resubmitted (their requests wait in
    # prefill), nothing runs on the engine
    assert not sim.queue and not any(e.running for e in sim.engines)
    groups = [*sim.over.carried, *sim.over.live.values()]
    unfinished = [obj for _, _, kind, obj, _ in sim.events if kind == "ready"]
    unfinished += [r for g in groups for r in (g.held or [])]
    assert any(r.ctx > r.shape.prompt for r in unfinished), "a 2x over-provisioned run carries progress"
    progress = sum(g.generated for g in groups) - sum(r.left for r in unfinished)
    assert sim.rec.generated_tokens == pytest.approx(sum(trained) + progress, rel=1e-9)
    assert out["partial_ratio"] > 0 and out["staleness_mean"] > 0
    assert 0 < out["off_policy_ratio"] < 1


def test_without_the_carry_the_aborted_groups_are_dropped_and_every_step_is_on_policy():
    out = simulate(validate_scenario(scenario(over=8, carry=False, rate=None)))
    assert set(out["staleness_hist"]) == {"0"}
    assert out["partial_ratio"] == 0.0 and out["off_policy_ratio"] == 0.0


def test_a_work_conserving_engine_gains_nothing_from_over_provisioning():
    """One engine at a constant rate R (processor sharing, no prefill) is never idle while a round
    runs, carried requests or not: the rollout phase generates R tokens/s in the baseline and with
    over-provisioning and carry alike, so the gain is 1 to float precision. Any gain of APRIL's in
    the model comes from the batch dependence of the decode rate (the tail decoding at a small batch)."""
    base = simulate(validate_scenario(scenario(over=4)))
    april = simulate(validate_scenario(scenario(over=8, carry=True)))
    assert rollout_tokens_per_s(base) == pytest.approx(RATE, rel=1e-9)
    assert rollout_tokens_per_s(april) == pytest.approx(RATE, rel=1e-9)


def test_with_a_batch_dependent_decode_rate_the_carry_raises_the_rollout_throughput():
    base = simulate(validate_scenario(scenario(over=4, rate=None)))
    april = simulate(validate_scenario(scenario(over=8, carry=True, rate=None)))
    assert rollout_tokens_per_s(april) > rollout_tokens_per_s(base)


def test_filtered_groups_start_another_chunk_and_only_groups_with_spread_are_trained():
    out = simulate(validate_scenario(scenario(over=4, zero=0.5, rate=None)))
    assert out["samples_per_s"] > 0
    assert out["steps"] == 12  # every step found its 4 groups with spread


def test_the_rollout_throughput_is_a_sync_mode_figure():
    data = scenario()
    data.update(gpus=2, mode={"mode": "async", "rollout_gpus": 1, "eta": 1})
    with pytest.raises(ValueError, match="sync-mode"):
        rollout_tokens_per_s(simulate(validate_scenario(data)))


def test_the_april_targets_take_their_lengths_from_aprils_published_figure():
    """The three APRIL targets' response lengths follow the rule written down before any run with them
    (docs/results.md): the figure in APRIL's README (each prompt's average response length) gives the
    dashed-line median and the prompts' log spread; the spread within a prompt stays the assumed 1.0;
    the sample median is the dashed line x exp(-sigma^2 / 2); the scripts' 16k cap; no filter."""
    figure = {  # target: (dashed line, tokens; sd of the log of the prompts' averages)
        "april-dapo-math-17k": (7905, 0.66),
        "april-deepscaler": (6087, 0.84),
        "april-deepmath-103k": (5598, 0.65),
    }
    for name, (line, spread) in figure.items():
        w = load_scenario(ROOT / "configs" / "sim" / "validate" / f"{name}.yaml").workload
        assert w.response_tokens.sigma == 1.0
        assert w.group_sigma == spread
        assert w.response_tokens.median == round(line * math.exp(-(w.response_tokens.sigma**2) / 2))
        assert (w.max_response_tokens, w.zero_spread_prob) == (16384, 0.0)
