"""`reflow simulate --from-run`: a run folder in the runtime's format (config.yaml, metrics.jsonl in the
run_log format, replay.sqlite) written from a simulated run with known costs is read back, its costs
recovered and its figures re-predicted within tolerance; a folder that is not a run is a one-line error.
Also the sync loop's collection rounds and the runtime's group limit per rollout worker."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from replay_helpers import make_group

from reflow.replay import ReplayStore
from reflow.sim.config import validate_scenario
from reflow.sim.from_run import compare, scenario_for
from reflow.sim.measured import measure, run_folders
from reflow.sim.simulation import simulate
from reflow.sim.training import SyncRounds, round_size

ENGINE_TOK_S, TRAINER_TOK_S, SYNC_S = 400.0, 2500.0, 0.02
B, N, MAX_BATCH = 4, 4, 16


def _store(path: Path) -> None:
    """40 groups of 4 episodes, 1-3 turns of 6-40 tokens; every third group has no reward spread."""
    with ReplayStore(path, run="r") as store:
        for i in range(40):
            rewards = [1.0] * N if i % 3 == 0 else [float(j % 2) for j in range(N)]
            store.add_group(*make_group(f"g{i}", rewards, n_turns=1 + i % 3, tokens=6 + (i * 7) % 35))


def _truth(mode: str, store: Path):
    """The scenario the test's 'run' really had (what --from-run must recover)."""
    m = {"mode": mode, "groups_per_engine": MAX_BATCH // N, "recompute_logprob": False}
    if mode == "sync":
        m["resample_rounds"] = 2
    else:
        m.update(rollout_gpus=1, eta=1)
    if mode == "reflow":
        m.update(tail=True, elastic=True, tail_config={})
    return validate_scenario(
        {
            "gpus": 1 if mode == "sync" else 2,
            "gpu": {"hbm_gb_s": 1, "bf16_tflops": 1, "memory_gb": 1},
            "model": {"params_b": 1e-3, "kv_bytes_per_token": 1},
            "decode": {"engine_tokens_per_s": ENGINE_TOK_S, "iter_fixed_s": 0.0, "max_running": MAX_BATCH},
            "train": {"tokens_per_s": TRAINER_TOK_S, "fixed_s": 0, "logprob_factor": 0, "ref_factor": 0},
            "sync": {"fixed_s": SYNC_S, "colocated_s": SYNC_S, "bandwidth_gb_s": 1e6, "resume_s": 0},
            "workload": {"groups_from": str(store), "max_response_tokens": 10**9},
            "batch": {"groups": B, "samples_per_group": N},
            "mode": m,
            "run": {"steps": 14, "warmup_steps": 0, "seed": 11},
        }
    )


def _write_run(folder: Path, mode: str) -> dict:
    """A run folder as `reflow agent-train` leaves it, from a simulation of `_truth`."""
    folder.mkdir()
    _store(folder / "replay.sqlite")
    out = simulate(_truth(mode, folder / "replay.sqlite"))
    config = {
        "run_name": folder.name,
        "mode": mode,
        "rollout": {
            "group_size": N,
            "groups_per_step": B,
            "max_batch_size": MAX_BATCH,
            "max_resample_rounds": 2,
        },
        "replay": {"eta": 1},
        "resources": {"slots": ["rollout", "train"]},
    }
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    lines, trained = [], 0.0
    for r in out["step_records"]:
        wall = r["wall_s"]
        record = {
            "kind": "step",
            "step": r["step"],
            "wall_s": wall,
            "generated_tokens": r["generated_tokens"],
            "generated_tokens_per_s": r["generated_tokens"] / wall,
            "trained_tokens": r["trained_tokens"] - trained,  # per step, as the trainer reports it
            "trained_tokens_per_s": r["trained_tokens"] / wall,
            "new_trained_tokens_per_s": r["new_trained_tokens"] / wall,
            "rollout_idle_ratio": r["rollout_idle_ratio"],
            "trainer_idle_ratio": r["trainer_idle_ratio"],
            "train_s": r["train_s"],
            "sync_s": SYNC_S,
        }
        trained = r["trained_tokens"]
        lines.append(json.dumps(record))
    lines.append(json.dumps({"kind": "summary", "mode": mode, "steps": len(out["step_records"])}))
    (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return out


@pytest.mark.parametrize("mode", ["sync", "async", "reflow"])
def test_a_run_folder_round_trips_within_tolerance(tmp_path, mode):
    _write_run(tmp_path / f"run-{mode}", mode)
    m = measure(tmp_path / f"run-{mode}")
    assert m.mode == mode and m.steps == 14 and m.costs["stored_groups"] == 40
    # the costs come back: the engine's rate exactly up to the tokens of turns still running at the end
    assert m.costs["engine_tokens_per_s"] == pytest.approx(ENGINE_TOK_S, rel=0.03)
    assert m.costs["trainer_tokens_per_s"] == pytest.approx(TRAINER_TOK_S, rel=0.1)
    assert m.costs["sync_s"] == pytest.approx(SYNC_S)
    s = scenario_for(m)
    assert s.mode.mode == mode and s.batch.groups == B and s.mode.groups_per_engine == MAX_BATCH // N
    c = compare(m)
    assert c.passed, [(r.name, r.measured, r.simulated) for r in c.rows]
    assert all(abs(r.error) < 0.1 for r in c.rows)
    # new work is shown beside the compared figures, measured and simulated; never above trained tokens
    assert m.extra["new_trained_tokens_per_s"] <= m.figures["trained_tokens_per_s"]
    assert c.simulated["new_trained_tokens_per_s"] <= c.simulated["trained_tokens_per_s"]


def test_a_bench_folder_lists_its_runs_and_the_cli_compares_them(tmp_path, capsys):
    from reflow.cli import main

    bench = tmp_path / "bench"
    bench.mkdir()
    for mode in ("async", "sync"):
        _write_run(bench / f"bench-{mode}-seed0", mode)
    assert [p.name for p in run_folders(bench)] == ["bench-async-seed0", "bench-sync-seed0"]
    assert main(["simulate", "--from-run", str(bench), "--markdown"]) == 0
    out = capsys.readouterr().out
    assert "2 of 2 runs within 15%" in out and "| bench-sync-seed0 | sync | 14 | steps_per_s |" in out


def test_a_folder_that_is_not_a_run_is_a_one_line_error(tmp_path, capsys):
    from reflow.cli import main

    def error(path: Path) -> str:
        assert main(["simulate", "--from-run", str(path)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1
        return err

    assert "no such folder" in error(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    assert "no metrics.jsonl" in error(tmp_path / "empty")
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("mode: async\n")
    (run / "metrics.jsonl").write_text(json.dumps({"kind": "eval", "step": 0}) + "\n")
    assert "no step records" in error(run)
    (run / "metrics.jsonl").write_text("{not json\n")
    assert "not a JSON record" in error(run)


def test_sync_rounds_follow_the_runtime_sync_loop():
    # B = 4: a round of 4; 2 come back with spread (rate 1/2), so the next round is ceil(2 / 0.5) = 4
    r = SyncRounds(4, extra_rounds=2)
    assert r.left() == 4
    for _ in range(4):
        r.start()
    for spread in (True, False, True, False):
        assert r.train_size() is None
        r.done(spread)
    assert r.left() == 4 and r.train_size() is None
    for _ in range(4):
        r.start()
    for spread in (False, False, False, False):  # still 2 of 4: the rate is 2 / 8, a last round
        r.done(spread)
    assert r.left() == round_size(4, 2, 2, 8) == 8  # ceil(2 / 0.25), at most 2 B
    for _ in range(8):
        r.start()
    for _ in range(8):
        r.done(False)
    assert r.train_size() == 2  # rounds used up: train on the 2 with spread
    r.reset()
    assert r.left() == 4 and r.train_size() is None


def test_round_size_is_the_runtime_spread_round_size():
    pytest.importorskip("ray")
    from reflow.recipes.run_state import spread_round_size

    class Report:
        def __init__(self, spread: bool) -> None:
            self.has_spread = spread

    import reflow.policy.task_selection
    import reflow.sim.training

    assert reflow.sim.training.round_size is reflow.policy.task_selection.round_size  # one copy, both drivers
    for want in (1, 4, 8, 16):
        for generated in range(0, 3 * want):
            for spread in range(0, generated + 1):
                reports = [Report(i < spread) for i in range(generated)]
                for missing in range(1, want + 1):
                    assert round_size(want, missing, spread, generated) == spread_round_size(
                        want, missing, reports
                    )


def test_groups_per_engine_bounds_the_groups_in_flight(tmp_path):
    from reflow.sim.simulation import Simulation

    store = tmp_path / "replay.sqlite"
    _store(store)
    s = _truth("async", store)
    sim = Simulation(s.model_copy(update={"mode": s.mode.model_copy(update={"eta": 4})}))
    peak, real_fill = [], sim.fill

    def fill() -> None:
        real_fill()
        peak.append(sim.store.in_flight())

    sim.fill = fill
    sim.run()
    assert max(peak) == MAX_BATCH // N  # eta 4 would allow 20 groups; the rollout worker takes 4
