"""The simulator's drifting workload (`workload.drift`): the growth arithmetic, the sampled lengths and
turns growing by the factor, a run's stored groups replayed by version, no-drift scenarios unchanged,
the elastic policy moving capacity toward rollout as responses grow, and the printed tables."""

from __future__ import annotations

import copy
import statistics
from pathlib import Path

import pytest
import yaml
from replay_helpers import make_group

from reflow.errors import ConfigError
from reflow.replay import ReplayStore
from reflow.sim.config import load_scenario, validate_scenario
from reflow.sim.costs import GroupShape, LengthSampler, SampleShape
from reflow.sim.drift import VersionedGroups, WorkloadDrift, growth_factor
from reflow.sim.simulation import simulate

ROOT = Path(__file__).resolve().parents[1]

# Small enough to run 40 steps in a fraction of a second, and a role change (2 s) cheap enough beside a
# step for the elastic policy to find moves worth their cost.
ELASTIC = {
    "name": "drift",
    "gpus": 8,
    "gpu": {"name": "G", "hbm_gb_s": 3000, "bf16_tflops": 400, "memory_gb": 80},
    "model": {"name": "M", "params_b": 1.5, "kv_bytes_per_token": 28672},
    "workload": {"response_tokens": {"median": 400, "sigma": 0.5}, "max_response_tokens": 16000},
    "batch": {"groups": 16, "samples_per_group": 4},
    "train": {"mfu": 0.3, "fixed_s": 1.0},
    "sync": {"role_change_s": 2.0},
    "mode": {
        "mode": "reflow",
        "rollout_gpus": 4,
        "eta": 1,
        "elastic": True,
        "cycle": {"max_reuse": 2, "share_max": 0.5},
    },
    "run": {"steps": 40, "warmup_steps": 2, "seed": 3},
}


def _scenario(drift: dict | None = None, **workload):
    data = copy.deepcopy(ELASTIC)
    data["workload"].update(workload)
    if drift is not None:
        data["workload"]["drift"] = drift
    return validate_scenario(data)


# ---- the arithmetic


def test_growth_factor_at_the_start_midway_the_end_and_after():
    assert growth_factor(3.0, 0, 10) == 1.0
    assert growth_factor(3.0, 5, 10) == pytest.approx(2.0)  # linear: halfway to 3
    assert growth_factor(3.0, 10, 10) == pytest.approx(3.0)
    assert growth_factor(3.0, 25, 10) == pytest.approx(3.0)  # held after over_steps
    assert growth_factor(4.0, 5, 10, "exponential") == pytest.approx(2.0)  # sqrt(4)
    assert growth_factor(4.0, 10, 10, "exponential") == pytest.approx(4.0)
    exp = [growth_factor(4.0, v, 10, "exponential") for v in range(11)]
    assert exp[1] / exp[0] == pytest.approx(exp[8] / exp[7])  # the same ratio every version
    assert growth_factor(0.5, 10, 10) == pytest.approx(0.5)  # shrinking works the same way
    assert growth_factor(1.0, 7, 10, "exponential") == 1.0
    with pytest.raises(ValueError, match="unknown drift shape"):
        growth_factor(2.0, 1, 10, "cubic")


def test_turn_drift_scales_the_extra_turns_and_the_horizon_defaults_to_the_run():
    s = _scenario({"turns_growth": 2.0}, turns_mean=3.0, max_turns=50)
    d = WorkloadDrift.of(s)
    assert d is not None and d.over_steps == s.run.steps  # no over_steps: the run's steps
    assert d.turns_mean(3.0, 0) == 3.0
    assert d.turns_mean(3.0, 20) == pytest.approx(4.0)  # 2 extra turns x 1.5
    assert d.turns_mean(3.0, 40) == pytest.approx(5.0)  # 2 extra turns x 2
    assert d.response_factor(40) == 1.0
    assert WorkloadDrift.of(_scenario()) is None
    assert WorkloadDrift.of(_scenario({"response_growth": 1.0, "over_steps": 5})) is None


def test_drift_keys_are_checked_and_errors_name_them():
    with pytest.raises(ConfigError, match=r"workload\.drift\.growth: unknown key"):
        _scenario({"growth": 2.0})
    with pytest.raises(ConfigError, match=r"workload\.drift\.shape"):
        _scenario({"response_growth": 2.0, "shape": "cubic"})
    with pytest.raises(ConfigError, match=r"workload\.drift\.response_growth"):
        _scenario({"response_growth": 0})
    with pytest.raises(ConfigError, match=r"drift\.from_versions needs workload\.groups_from"):
        _scenario({"from_versions": True})
    with pytest.raises(ConfigError, match=r"drift\.turns_growth needs extra turns"):
        _scenario({"turns_growth": 2.0})  # a single-turn workload has no extra turns to grow
    with pytest.raises(ConfigError, match=r"do not apply to stored groups"):
        _scenario({"response_growth": 2.0}, groups_from="runs/x/replay.sqlite")


# ---- the sampled workload


def _mean_tokens(sampler: LengthSampler, version: int, groups: int = 3000) -> float:
    shapes = [x for _ in range(groups) for x in sampler.group(4, version)]
    return statistics.fmean(sum(x.turns) for x in shapes)


def test_sampled_response_length_grows_by_about_the_factor():
    s = _scenario({"response_growth": 3.0, "over_steps": 10})
    sampler = LengthSampler(s.workload, 0, drift=WorkloadDrift.of(s))
    start, mid, end, after = (_mean_tokens(sampler, v) for v in (0, 5, 10, 30))
    assert mid / start == pytest.approx(2.0, rel=0.05)
    assert end / start == pytest.approx(3.0, rel=0.05)
    assert after / start == pytest.approx(3.0, rel=0.05)


def test_measured_lengths_are_scaled_by_the_drift():
    s = _scenario({"response_growth": 3.0, "over_steps": 10})
    sampler = LengthSampler(s.workload, 0, lengths=[100, 200], drift=WorkloadDrift.of(s))
    assert {sum(x.turns) for x in sampler.group(50, 0)} == {100, 200}
    assert {sum(x.turns) for x in sampler.group(50, 5)} == {200, 400}
    assert {sum(x.turns) for x in sampler.group(50, 10)} == {300, 600}


def test_sampled_turns_grow_and_stay_under_max_turns():
    s = _scenario({"turns_growth": 2.0, "over_steps": 10}, turns_mean=3.0, max_turns=50)
    sampler = LengthSampler(s.workload, 0, drift=WorkloadDrift.of(s))

    def turns(version: int) -> list[int]:
        return [len(x.turns) for _ in range(3000) for x in sampler.group(4, version)]

    assert statistics.fmean(turns(0)) == pytest.approx(3.0, rel=0.05)
    assert statistics.fmean(turns(10)) == pytest.approx(5.0, rel=0.05)
    capped = _scenario({"turns_growth": 4.0, "over_steps": 10}, turns_mean=3.0, max_turns=4)
    sampler = LengthSampler(capped.workload, 0, drift=WorkloadDrift.of(capped))
    assert max(turns(10)) == 4


def test_a_drifting_run_reports_the_growth_per_step():
    out = simulate(_scenario({"response_growth": 4.0}))
    per_step = [r["response_tokens_mean"] for r in out["step_records"] if r["response_tokens_mean"]]
    early, late = statistics.fmean(per_step[:4]), statistics.fmean(per_step[-4:])
    assert late / early == pytest.approx(4.0, rel=0.2)
    flat = simulate(_scenario())
    per_step = [r["response_tokens_mean"] for r in flat["step_records"] if r["response_tokens_mean"]]
    assert statistics.fmean(per_step[-4:]) / statistics.fmean(per_step[:4]) == pytest.approx(1.0, abs=0.15)


def test_no_drift_draws_exactly_what_a_scenario_without_the_section_draws():
    plain = _scenario(turns_mean=3.0, max_turns=8)
    ones = _scenario({"response_growth": 1, "turns_growth": 1, "over_steps": 3}, turns_mean=3.0, max_turns=8)
    assert simulate(plain) == simulate(ones)
    # a drift is 1 at version 0: the first groups are those of the stationary workload, draw for draw
    grows = _scenario({"response_growth": 3, "turns_growth": 2}, turns_mean=3.0, max_turns=8)
    a = LengthSampler(plain.workload, 5)
    b = LengthSampler(grows.workload, 5, drift=WorkloadDrift.of(grows))
    assert [a.draw(4, 0) for _ in range(50)] == [b.draw(4, 0) for _ in range(50)]


# ---- the elastic policy under a growing workload


def _split(out: dict) -> tuple[int, int, int]:
    """Rollout GPUs at the first and the last step, and the policy's moves toward rollout."""
    steps = out["step_records"]
    moves = [e for e in out["events"] if e["kind"] == "elastic" and e["what"] == "to_rollout"]
    return steps[0]["rollout_gpus"], steps[-1]["rollout_gpus"], len(moves)


def test_the_elastic_policy_moves_capacity_toward_rollout_as_responses_grow():
    start, end, moves = _split(simulate(_scenario({"response_growth": 4.0})))
    flat_start, flat_end, flat_moves = _split(simulate(_scenario()))
    assert start == flat_start == 4
    assert end >= start + 2  # longer responses: rollout is the slower side, slots follow
    assert end > flat_end and moves > flat_moves  # the stationary workload settles earlier


# ---- a run's stored groups, by version


def _growing_store(path: Path, versions: int = 10) -> None:
    """Two groups per version; version v's episodes have 1 turn of 10 * (v + 1) tokens."""
    with ReplayStore(path, run="r") as store:
        for v in range(versions):
            for i in range(2):
                rewards = [0.0, 1.0, 0.0, 1.0]
                store.add_group(*make_group(f"g{v}-{i}", rewards, version=v, n_turns=1, tokens=10 * (v + 1)))


def test_versioned_groups_pick_the_nearest_stored_version_and_its_window():
    def group(v: int) -> GroupShape:
        return GroupShape((SampleShape(1, [v + 1], [], 0),), True, v)

    groups = [group(v) for v in (0, 2, 2, 5)]
    by = VersionedGroups(groups)
    assert [by.nearest(v) for v in (0, 1, 2, 3, 4, 5, 9)] == [0, 0, 2, 2, 5, 5, 5]  # a tie: the older
    assert {g.version for g in by.near(2)} == {2} and len(by.near(2)) == 2
    assert {g.version for g in by.near(40)} == {5}  # past the run's last version: its last groups
    assert {g.version for g in VersionedGroups(groups, window=2).near(1)} == {0, 2}
    with pytest.raises(ValueError, match="no stored groups"):
        VersionedGroups([])


def test_from_versions_replays_a_measured_runs_growth(tmp_path):
    _growing_store(tmp_path / "replay.sqlite")
    data = copy.deepcopy(ELASTIC)
    data["workload"] = {"groups_from": str(tmp_path / "replay.sqlite"), "max_response_tokens": 10**6}
    data["mode"] = {"mode": "async", "rollout_gpus": 4, "eta": 1}
    data["run"] = {"steps": 10, "warmup_steps": 0, "seed": 1}
    data["batch"] = {"groups": 4, "samples_per_group": 4}
    flat = simulate(validate_scenario(data))
    data["workload"]["drift"] = {"from_versions": True}
    replayed = simulate(validate_scenario(data))
    tokens = [r["response_tokens_mean"] for r in replayed["step_records"]]
    # the groups started at version v are the run's version-v groups: 10 * (v + 1) tokens each
    assert tokens == [10.0 * (v + 1) if t is not None else None for v, t in enumerate(tokens)]
    assert sum(t is not None for t in tokens) >= 5
    flat_tokens = {r["response_tokens_mean"] for r in flat["step_records"]} - {None}
    assert len(flat_tokens) > 1 and max(flat_tokens) < 100  # uniform over the run: no growth


# ---- the printed tables and the shipped drift scenarios


def test_predict_and_plan_tables_show_the_drift(tmp_path, capsys):
    from reflow.cli import main

    data = copy.deepcopy(ELASTIC)
    data["workload"]["drift"] = {"response_growth": 3.0}
    data["run"] = {"steps": 12, "warmup_steps": 2, "seed": 3}
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(data))
    assert main(["simulate", "--config", str(path), "--predict"]) == 0
    out = capsys.readouterr().out
    assert "workload drift: response length x3 over 12 versions (linear); 12 steps" in out
    assert "split step 1 -> last | resp. tok/sample step 1 -> last |" in out
    assert "| sync | colocated |" in out and "| reflow full | " in out
    assert main(["simulate", "--plan", "--workload", str(path)]) == 0
    assert "workload drift: response length x3 over 12 versions (linear)" in capsys.readouterr().out


def test_shipped_drift_scenarios_drift_from_their_stationary_file():
    folder = ROOT / "configs" / "sim" / "predict"
    files = sorted((folder / "drift").glob("*-drift.yaml"))
    assert len(files) >= 3
    for f in files:
        s = load_scenario(f)
        base = load_scenario(folder / f.name.replace("-drift", ""))
        d = s.workload.drift
        assert d.response_growth > 1 and s.run.steps >= 30
        assert (d.turns_growth > 1) == (s.workload.max_turns > 1)
        assert s.workload.model_dump(exclude={"drift"}) == base.workload.model_dump(exclude={"drift"})
