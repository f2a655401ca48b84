"""The cluster simulator: analytic cases exact, deterministic with a seed, the runtime's own policy objects
(not copies), and scenario validation errors that name the key."""

from __future__ import annotations

import ast
import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

import reflow.policy.dual_cycle as cycle
import reflow.policy.elastic as elastic
import reflow.policy.tail as tail
import reflow.replay.planning as planning
import reflow.sim.simulation as simulation
import reflow.sim.training as training
from reflow.errors import ConfigError
from reflow.sim.config import load_scenario, validate_scenario
from reflow.sim.costs import decode_model, sync_s, train_s

ROOT = Path(__file__).resolve().parents[1]

BASE = {
    "name": "t",
    "gpus": 8,
    "gpu": {"name": "G", "hbm_gb_s": 3000, "bf16_tflops": 400, "memory_gb": 80},
    "model": {"name": "M", "params_b": 1.5, "kv_bytes_per_token": 28672},
    "workload": {
        "response_tokens": {"median": 500, "sigma": 0.8},
        "max_response_tokens": 4000,
        "group_sigma": 0.3,
    },
    "batch": {"groups": 8, "samples_per_group": 4},
    "run": {"steps": 5, "warmup_steps": 1, "seed": 3},
}


def scenario(**over):
    data = copy.deepcopy(BASE)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    return validate_scenario(data)


def constant(**over):
    """Every sample: 100 prompt tokens, exactly 300 response tokens, one turn."""
    work = {
        "prompt_tokens": {"median": 100, "sigma": 0},
        "response_tokens": {"median": 300, "sigma": 0},
        "group_sigma": 0,
    }
    return scenario(workload=work, **over)


def analytic_gen_s(s, engines: int) -> float:
    """All B x n requests start together, spread evenly; each engine decodes b sequences from context P
    to P + L: the integral of t_iter over L tokens, plus the prefill."""
    dm = decode_model(s.gpu, s.model, s.decode)
    b = s.batch.groups * s.batch.samples_per_group // engines
    P, L = 100, 300
    return P * dm.prefill_s_per_token + (dm.a + dm.per_seq_s * b + dm.k * b * P) * L + dm.k * b * L * L / 2


def test_sync_with_constant_lengths_is_generation_plus_training_plus_sync():
    s = constant(mode={"mode": "sync"})
    out = simulation.simulate(s)
    tokens = s.batch.groups * s.batch.samples_per_group * 400
    expect = (
        analytic_gen_s(s, s.gpus)
        + train_s(tokens, s.gpus, s.gpu, s.model, s.train, recompute=True, colocated=True)
        + sync_s(s.model, s.sync, colocated=True)
    )
    assert out["seconds_per_step"] == pytest.approx(expect, rel=1e-9)
    assert out["staleness_hist"] == {"0": s.batch.groups * (s.run.steps)}
    # trained tokens are the generated ones (the loss's), as the runs count them; prompts are processed
    generated = s.batch.groups * s.batch.samples_per_group * 300
    assert out["trained_tokens_per_s"] == pytest.approx(generated / expect, rel=1e-9)
    assert out["processed_tokens_per_s"] == pytest.approx(tokens / expect, rel=1e-9)


def test_async_eta_0_without_partial_is_the_sync_formula_on_separate_pools():
    s = constant(mode={"mode": "async", "eta": 0, "partial_rollout": False, "rollout_gpus": 4})
    out = simulation.simulate(s)
    tokens = s.batch.groups * s.batch.samples_per_group * 400
    expect = (
        analytic_gen_s(s, 4)
        + train_s(tokens, 4, s.gpu, s.model, s.train, recompute=False)
        + sync_s(s.model, s.sync, colocated=False)
    )
    assert out["seconds_per_step"] == pytest.approx(expect, rel=1e-9)


def test_decode_turns_compute_bound_at_large_batch():
    # Each running sequence costs 2 x active params FLOPs per token at decode_mfu of the peak, so engine
    # tokens/s grows with the batch and saturates below peak * decode_mfu / (2 x active params).
    s = scenario(decode={"decode_mfu": 0.25, "per_seq_s": 0.0})
    dm = decode_model(s.gpu, s.model, s.decode)
    assert dm.per_seq_s == pytest.approx(2 * 1.5e9 / (400e12 * 0.25))
    ceiling = 1 / dm.per_seq_s
    rates = [dm.tokens_per_s(b, 0) for b in (1, 8, 64, 512, 4096)]
    assert rates == sorted(rates) and rates[-1] < ceiling and rates[-1] > 0.9 * ceiling
    faster = decode_model(s.gpu, s.model, s.decode.model_copy(update={"decode_mfu": 0.5}))
    assert faster.tokens_per_s(4096, 0) > 1.8 * rates[-1]  # bound by compute there, not by bandwidth
    assert faster.tokens_per_s(1, 0) == pytest.approx(rates[0], rel=0.01)  # bound by bandwidth here


def test_idle_ratio_is_defined_once_for_runs_and_the_simulator():
    import reflow.metrics
    import reflow.sim.metrics as sim_metrics

    assert sim_metrics.idle_ratio is reflow.metrics.idle_ratio
    assert "def idle_ratio" not in (ROOT / "reflow/recipes/run_log.py").read_text()
    assert reflow.metrics.idle_ratio(3.0, 4.0) == 0.25 and reflow.metrics.idle_ratio(5.0, 4.0) == 0.0
    assert reflow.metrics.quantile([3.0, 1.0, 2.0], 0.5) == 2.0 and reflow.metrics.quantile([], 0.9) == 0.0


def test_async_eta_0_equals_sync_step_for_step_with_random_lengths():
    # 16 GPUs split 8:8 with eta 0 against 8 colocated GPUs: same engines, same trainer, same sync cost.
    sep = sync_s(scenario().model, scenario().sync, colocated=False)
    a = simulation.simulate(
        scenario(gpus=16, mode={"mode": "async", "eta": 0, "rollout_gpus": 8, "recompute_logprob": True})
    )
    b = simulation.simulate(scenario(gpus=8, mode={"mode": "sync"}, sync={"colocated_s": sep}))
    assert [r["wall_s"] for r in a["step_records"]] == pytest.approx([r["wall_s"] for r in b["step_records"]])
    assert a["staleness_hist"] == b["staleness_hist"] == {"0": 40}


def test_deterministic_with_a_seed_and_the_seed_matters():
    s = scenario(mode={"mode": "async", "eta": 2})
    one, two = simulation.simulate(s), simulation.simulate(s)
    assert one == two
    other = simulation.simulate(scenario(mode={"mode": "async", "eta": 2}, run={"seed": 4}))
    assert other["seconds_per_step"] != one["seconds_per_step"]


def test_async_overlaps_and_staleness_stays_within_eta():
    sync = simulation.simulate(scenario(gpus=8, mode={"mode": "sync"}, train={"mfu": 0.05}))
    out = simulation.simulate(
        scenario(gpus=8, mode={"mode": "async", "eta": 2, "rollout_gpus": 4}, train={"mfu": 0.05})
    )
    assert max(int(k) for k in out["staleness_hist"]) <= 2 + 1  # a straggler may be overtaken (AReaL)
    assert out["trainer_idle_ratio"] < sync["trainer_idle_ratio"] + 1e-9
    assert out["seconds_per_step"] < sync["seconds_per_step"]


def test_reflow_replays_when_rollout_is_short_and_respects_k():
    s = scenario(
        gpus=8,
        mode={
            "mode": "reflow",
            "eta": 1,
            "rollout_gpus": 2,
            "cycle": {"max_reuse": 2, "share_init": 0.5, "share_max": 0.5},
        },
    )
    out = simulation.simulate(s)
    assert out["replay_fraction"] > 0
    assert max(int(k) for k in out["reuse_hist"]) <= 2
    base = simulation.simulate(scenario(gpus=8, mode={"mode": "async", "eta": 1, "rollout_gpus": 2}))
    assert out["steps_per_s"] > base["steps_per_s"]


def test_new_trained_tokens_count_a_groups_first_training_only():
    """A step's fresh groups are new work; its replayed groups count in trained tokens only."""
    from reflow.replay.planning import BatchPlan
    from reflow.replay.store import GroupInfo
    from reflow.sim.metrics import Recorder

    def group(gid, generated, consumed):
        meta = {"generated": generated, "tokens": 2 * generated}
        return GroupInfo(gid, 1, 0, 1.0, consumed, None, meta)

    rec = Recorder(1)
    rec.trained(BatchPlan(fresh=[group("a", 100, 0)], replay=[group("b", 60, 1)]), 1, 4)
    rec.trained(BatchPlan(fresh=[group("c", 30, 0)], replay=[group("a", 100, 1)]), 2, 4)
    assert (rec.new_trained_tokens, rec.trained_tokens) == (130, 290)
    s = scenario(
        gpus=8,
        mode={"mode": "reflow", "eta": 1, "rollout_gpus": 2, "cycle": {"max_reuse": 2, "share_max": 0.5}},
    )
    out = simulation.simulate(s)
    assert out["replay_fraction"] > 0
    assert out["new_trained_tokens_per_s"] < out["trained_tokens_per_s"]
    sync = simulation.simulate(scenario(gpus=8, mode={"mode": "sync"}))  # no replay: every group is new
    assert sync["new_trained_tokens_per_s"] == sync["trained_tokens_per_s"]


# ---- the simulator runs the runtime's policy objects


def test_the_simulator_imports_the_runtime_policies_not_copies():
    from reflow.sim import policies

    assert training.plan_batch is planning.plan_batch
    assert training.consume is planning.consume
    assert policies.AdmissionControl is cycle.AdmissionControl
    assert training.ReplayShare is cycle.ReplayShare
    assert training.CycleConfig is cycle.CycleConfig

    assert policies.ElasticPolicy is elastic.ElasticPolicy
    assert policies.TailPolicy is tail.TailPolicy
    # No policy is re-implemented under reflow/sim: none of the policies' function or class names is
    # defined there.
    policy_names = {
        "plan_batch",
        "consume",
        "accepted_groups",
        "AdmissionControl",
        "ReplayShare",
        "ElasticPolicy",
        "TailPolicy",
        "decide",
        "best_split",
        "extra_groups",
        "concurrency_knee",
        "remaining_seconds",
        "throughput",
        "step_seconds",
        "capacity",
        "room",
        "observe",
        "decision_event",
        "apply_tail",
        "tail_event",
    }
    for path in (ROOT / "reflow" / "sim").glob("*.py"):
        tree = ast.parse(path.read_text())
        defined = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.ClassDef)}
        assert not defined & policy_names, f"{path.name} defines {defined & policy_names}"


def test_every_policy_call_goes_through_the_runtime_objects(monkeypatch):
    calls: dict[str, int] = {}

    def spy(owner, name):
        real = getattr(owner, name)

        def wrapped(*a, **k):
            calls[name] = calls.get(name, 0) + 1
            return real(*a, **k)

        monkeypatch.setattr(owner, name, wrapped)

    spy(training, "plan_batch")
    spy(training, "consume")
    spy(cycle.AdmissionControl, "room")
    spy(cycle.ReplayShare, "update")
    spy(elastic.ElasticPolicy, "decide")
    spy(tail.TailPolicy, "decide")
    s = scenario(mode={"mode": "reflow", "eta": 1, "rollout_gpus": 2, "elastic": True, "tail": True})
    out = simulation.simulate(s)
    assert set(calls) == {"plan_batch", "consume", "room", "update", "decide"}
    assert calls["consume"] >= s.run.steps
    kinds = {e["kind"] for e in out["events"]}
    assert "elastic" in kinds
    # one event schema, the runtime's: the policy (kind), the action (what), the reason (why)
    assert all({"kind", "what", "why"} <= set(e) for e in out["events"])


def test_elastic_moves_slots_to_the_starved_side_with_the_role_change_cost():
    s = scenario(
        gpus=8,
        run={"steps": 14},
        mode={"mode": "async", "eta": 1, "rollout_gpus": 1, "elastic": True},
        sync={"role_change_s": 5.0},
        train={"mfu": 0.5},
    )
    out = simulation.simulate(s)
    moves = [e for e in out["events"] if e["kind"] == "elastic" and e["what"] != "hold"]
    assert moves and moves[0]["what"] == "to_rollout"
    assert out["rollout_gpus"] > 1
    assert moves[0]["cost_s"] == pytest.approx(5.0)


def test_sim_imports_no_heavy_modules():
    code = "import sys, reflow.sim.simulation, reflow.sim.cli; print(sorted(sys.modules))"
    mods = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    heavy = ("torch", "transformers", "ray", "sglang", "fastapi", "docker")
    assert not [m for m in eval(mods) if m.split(".")[0] in heavy]


# ---- scenario validation


def test_unknown_and_bad_keys_are_named():
    bad = copy.deepcopy(BASE)
    bad["decode"] = {"bw_efficency": 0.5}
    with pytest.raises(ConfigError, match=r"decode\.bw_efficency: unknown key"):
        validate_scenario(bad)
    bad = copy.deepcopy(BASE)
    bad["decode"] = {"bw_efficiency": 1.5}
    with pytest.raises(ConfigError, match=r"decode\.bw_efficiency"):
        validate_scenario(bad)
    bad = copy.deepcopy(BASE)
    del bad["gpu"]
    with pytest.raises(ConfigError, match=r"gpu: missing"):
        validate_scenario(bad)
    bad = copy.deepcopy(BASE)
    bad["mode"] = {"mode": "async", "rollout_gpus": 8}
    with pytest.raises(ConfigError, match="rollout_gpus must leave trainer GPUs"):
        validate_scenario(bad)
    bad = copy.deepcopy(BASE)
    bad["mode"] = {"mode": "async", "eta": 1, "staleness_threshold": 0.5}
    with pytest.raises(ConfigError, match="eta or staleness_threshold"):
        validate_scenario(bad)


def test_includes_merge_and_overrides_apply(tmp_path):
    (tmp_path / "hw.yaml").write_text("gpu: {name: G, hbm_gb_s: 3000, bf16_tflops: 400, memory_gb: 80}\n")
    (tmp_path / "s.yaml").write_text(
        "include: [hw.yaml]\nmodel: {params_b: 1.5, kv_bytes_per_token: 28672}\ngpu: {memory_gb: 40}\n"
    )
    s = load_scenario(tmp_path / "s.yaml", ["decode.tp=2", "gpus=16"])
    assert (s.gpu.hbm_gb_s, s.gpu.memory_gb, s.decode.tp, s.gpus) == (3000, 40, 2, 16)
    with pytest.raises(ConfigError, match="does not exist"):
        load_scenario(tmp_path / "missing.yaml")
    (tmp_path / "bad.yaml").write_text("- a list\n")
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_scenario(tmp_path / "bad.yaml")


def test_every_shipped_scenario_validates():
    files = sorted((ROOT / "configs" / "sim").rglob("*.yaml"))
    scenarios = [f for f in files if "validate" in f.parts or "predict" in f.parts]
    assert scenarios
    for f in scenarios:
        load_scenario(f)


# ---- the command line


def _write(path: Path, data: dict) -> Path:
    import yaml

    path.write_text(yaml.safe_dump(data))
    return path


def test_cli_runs_a_scenario_and_reports_errors_in_one_line(tmp_path, capsys):
    from reflow.cli import main

    cfg = _write(tmp_path / "s.yaml", {**BASE, "mode": {"mode": "async", "eta": 1}})
    assert main(["simulate", "--config", str(cfg), "--modes", "sync,async,reflow", "run.steps=3"]) == 0
    out = capsys.readouterr().out
    assert "seconds_per_step" in out and "reflow" in out
    assert main(["simulate", "--config", str(cfg), "--json"]) == 0
    import json

    assert json.loads(capsys.readouterr().out)["mode"] == "async"
    bad = _write(tmp_path / "bad.yaml", {**BASE, "decode": {"tp": 0}})
    assert main(["simulate", "--config", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "decode.tp" in err
    assert main(["simulate", "--config", str(tmp_path / "none.yaml")]) == 2


def test_validate_passes_within_tolerance_and_fails_outside(tmp_path, capsys):
    from reflow.cli import main
    from reflow.sim.validate import run_target

    data = {**BASE, "baseline": {"mode": "sync"}, "mode": {"mode": "async", "eta": 1}}
    simulated = run_target(validate_scenario({**data, "published": {"speedup": 1.0}}), {}).simulated
    folder = tmp_path / "v"
    folder.mkdir()
    _write(
        folder / "a.yaml",
        {**data, "name": "a", "published": {"speedup": simulated * 1.1}, "fit_subset": True},
    )
    assert main(["simulate", "--validate", "--folder", str(folder), "--markdown"]) == 0
    out = capsys.readouterr().out
    assert "| a |" in out and "fitted" in out
    _write(folder / "b.yaml", {**data, "name": "b", "published": {"speedup": simulated * 1.3}})
    assert main(["simulate", "--validate", "--folder", str(folder)]) == 1
    assert "1 of 2 targets within 15%" in capsys.readouterr().out
    assert main(["simulate", "--validate", "--folder", str(folder), "--require", "1"]) == 0
    assert main(["simulate", "--validate", "--folder", str(folder), "--require", "2"]) == 1
    capsys.readouterr()
    assert main(["simulate", "--validate", "--folder", str(folder), "--json"]) == 1
    rows = json.loads(capsys.readouterr().out)
    assert [(r["name"], r["passed"]) for r in rows] == [("a", True), ("b", False)]
    assert rows[0]["simulated"] == simulated  # full precision, not the table's rounding


def test_lengths_from_a_replay_store_or_an_export(tmp_path):
    import json

    from replay_helpers import make_group

    from reflow.replay import ReplayStore
    from reflow.sim.costs import load_lengths

    with ReplayStore(tmp_path / "r.sqlite", run="r") as store:
        store.add_group(*make_group("g0", [0.0, 1.0], n_turns=2, tokens=7))
    assert load_lengths(str(tmp_path / "r.sqlite")) == [14, 14]
    (tmp_path / "e.jsonl").write_text(
        "\n".join(json.dumps({"n_generated_tokens": n}) for n in (5, 0, 9)) + "\n"
    )
    assert load_lengths(str(tmp_path / "e.jsonl")) == [5, 9]
    s = scenario(workload={"lengths_from": str(tmp_path / "e.jsonl"), "max_response_tokens": 100})
    out = simulation.simulate(s)
    per_sample = (
        out["generated_tokens_per_s"] * out["seconds_per_step"] / (s.batch.groups * s.batch.samples_per_group)
    )
    assert 5 <= per_sample <= 9


def test_plan_ranks_the_grid_and_a_clearly_better_split_wins():
    from reflow.sim.plan import markdown, model_file, plan

    # Long responses, a cheap trainer: the rollout side is the bottleneck, so 6 rollout GPUs beat 2.
    s = scenario(
        gpus=8,
        workload={
            "response_tokens": {"median": 1500, "sigma": 0},
            "group_sigma": 0,
            "max_response_tokens": 4000,
        },
        train={"mfu": 0.6, "fixed_s": 0.1},
        decode={"decode_mfu": 0.02},
        run={"steps": 4, "warmup_steps": 1, "seed": 3},
    )
    rows = plan(s, splits=(0.25, 0.75), etas=(1,), reuse=(1, 2))
    # sync, then per split and lending off / on: async and reflow at each K
    assert len(rows) == 1 + 2 * 2 * (1 + 2)
    assert [r.trained_tok_s for r in rows] == sorted((r.trained_tok_s for r in rows), reverse=True)
    assert rows[0].rollout_gpus == 6 and rows[0].train_gpus == 2
    best_small = max(r.trained_tok_s for r in rows if r.rollout_gpus == 2)
    assert rows[0].trained_tok_s > 1.3 * best_small
    text = markdown(s, rows, top=3)
    assert "(simulated)" in text and "recommended: " in text and "6:2" in text.splitlines()[1]
    assert text.count("\n| ") == 1 + 3 + 1  # header, the top 3, the sync row
    assert "| new tok/s | vs sync (new tok/s) | trained tok/s (with replays) |" in text
    assert model_file("8B", ROOT / "configs/sim/models").name == "qwen3-8b.yaml"
    with pytest.raises(ValueError, match="match"):
        model_file("3B", ROOT / "configs/sim/models")


def test_plan_cli_needs_a_workload_and_says_so_in_one_line(capsys):
    from reflow.cli import main

    assert main(["simulate", "--plan", "--gpus", "8"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --plan needs --workload") and err.count("\n") == 1
