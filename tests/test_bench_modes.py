"""The mode benchmark's table: time to target, spread across seeds, reuse and IS columns."""

import pytest

from reflow.recipes.bench_modes import pilot_targets, plot, start_noise, table, variants


def _run(mode, seed, successes, dt=10.0, reuse=None):
    evals = [{"wall_s": i * dt, "success_rate": s} for i, s in enumerate(successes)]
    steps = [
        {
            "wall_s": i * dt,
            "staleness_mean": 0.5,
            "w_mean": 1.0,
            "w_max": 1.2,
            "masked_frac": 0.0,
            "trained_tokens_per_s": 100.0,
        }
        for i in range(3)
    ]
    summary = {
        "generated_tokens_per_s": 1000.0 + seed,
        "trained_tokens_per_s": 500.0,
        "rollout_idle_ratio": 0.2,
        "trainer_idle_ratio": 0.4,
        "reuse_hist": reuse or {"1": 10},
        "steps": 30,
    }
    return {"mode": mode, "seed": seed, "evals": evals, "steps": steps, "summary": summary}


def test_table_reports_time_to_each_target_the_spread_and_how_much_sooner_than_sync(tmp_path):
    results = [
        _run("sync", 0, [0.1, 0.2, 0.3, 0.4]),
        _run("sync", 1, [0.1, 0.3, 0.35, 0.4]),
        _run("async", 0, [0.1, 0.35, 0.4, 0.4]),
        _run("async", 1, [0.1, 0.1, 0.1, 0.1]),  # never reaches a target
        _run("reflow", 0, [0.1, 0.4, 0.4, 0.5], reuse={"1": 6, "2": 4}),
        _run("reflow", 1, [0.1, 0.45, 0.5, 0.5], reuse={"0": 3, "1": 6, "2": 4}),
    ]
    md = table(results, {"50%": 0.3, "90%": 0.4}, budget_minutes=1)
    assert md.startswith("Targets held-out success, fixed before the runs: 50% 0.300, 90% 0.400")
    rows = {line.split(" | ")[0].strip("| "): line for line in md.splitlines() if line.startswith("| ")}
    assert rows["mode"].startswith("| mode | time to 50% (s) | reached 50% | time to 90% (s) | reached 90% |")
    # sync reaches 0.3 at t = 20 and t = 10, 0.4 at 30 and 30; async once each at 10; reflow at 10, 10
    assert "| sync | 15 ± 7.07 | 2/2 | 30 ± 0 | 2/2 |" in rows["sync"]
    assert "| async | 10 ± 0 | 1/2 | 20 ± 0 | 1/2 |" in rows["async"]
    assert "| reflow | 10 ± 0 | 2/2 | 10 ± 0 | 2/2 |" in rows["reflow"]
    assert "1.4 ± 0" in rows["reflow"]  # mean uses per consumed group: (6*1 + 4*2) / 10
    assert md.rstrip().endswith(
        "async 1.50x at 50%; reflow 1.50x at 50%; async 1.50x at 90%; reflow 3.00x at 90%."
    )
    assert plot(results, tmp_path, {"50%": 0.3, "90%": 0.4}).stat().st_size > 1000


def test_pilot_targets_are_shares_of_the_pilots_gain_at_the_budget_or_none_within_noise(tmp_path):
    # the gain is the last evaluation's (at the budget), not the best one's: 0.2 -> 0.6 (best 0.7)
    pilot = _run("pilot", 3, [0.2, 0.7, 0.6])
    assert pilot_targets(pilot) == {"50%": 0.4, "75%": 0.5, "90%": 0.56}
    assert pilot_targets(pilot, shares=(0.25,)) == {"25%": 0.3}
    assert pilot_targets(_run("pilot", 3, [0.2, 0.3, 0.1])) is None  # ended below its start
    flat = [_run("async", 0, [0.2, 0.2, 0.1])]
    md = table(flat, None, budget_minutes=1)
    assert md.startswith("No target: the pilot did not improve")
    assert "| async | 0.1 ± 0 | 0.2 ± 0 |" in md  # no target columns
    assert plot(flat, tmp_path, None).stat().st_size > 1000
    # gains of one or two problems in 100 are within the start's standard error (0.04 at 0.2): no target
    small = _run("pilot", 3, [0.2, 0.21, 0.24])
    small["evals"][0]["episodes"] = 100
    assert start_noise([small]) == pytest.approx(0.04)
    assert pilot_targets(small) is None
    small["evals"][0]["episodes"] = 10_000  # the same gain on 10,000 problems is real (se 0.004)
    assert pilot_targets(small) == {"50%": 0.22, "75%": 0.23, "90%": 0.236}


def test_sync_and_async_rows_run_their_mode_plain_even_where_the_config_switches_reflows_parts_on():
    from reflow.config import load_config

    on = ["env.id=reflow/Calc-v0", "elastic.enabled=true", "tail.enabled=true"]
    for name, mode, extra in variants(True):
        config = load_config(None, [*on, f"mode={mode}", *extra])  # sync refuses elastic.enabled=true
        parts = (config.elastic.active(mode), config.tail.active(mode))
        expected = {"reflow": (True, True), "reflow-static": (False, False), "reflow-no-tail": (True, False)}
        assert parts == expected.get(name, (False, False)), name


def test_ablation_rows_run_reflow_with_parts_off_and_show_role_changes_and_tail_actions(tmp_path):
    assert [name for name, _, _ in variants(False)] == ["sync", "async", "reflow"]
    rows = variants(True)
    assert [(name, mode) for name, mode, _ in rows[3:]] == [
        ("reflow-static", "reflow"),
        ("reflow-no-tail", "reflow"),
    ]
    assert dict((name, extra) for name, _, extra in rows)["reflow-static"] == [
        "elastic.enabled=false",
        "tail.enabled=false",
    ]
    assert dict((name, extra) for name, _, extra in rows)["reflow-no-tail"] == ["tail.enabled=false"]

    def counted(mode, seed, changes, cost, over, carried):
        run = _run(mode, seed, [0.1, 0.3])
        run["summary"].update(
            role_changes=changes,
            role_change_s=cost,
            tail_over_provisioned=over,
            tail_carried_over=carried,
            tail_migrations=0,
        )
        return run

    results = [
        _run("sync", 0, [0.1, 0.3]),  # a summary from before the counters: shown as 0
        counted("reflow", 0, 2, 3.0, 4, 10),
        counted("reflow", 1, 4, 5.0, 6, 14),
        counted("reflow-static", 0, 0, 0.0, 0, 0),
        counted("reflow-no-tail", 0, 1, 2.5, 0, 0),
    ]
    md = table(results, {"target": 0.2}, budget_minutes=1)
    lines = [line for line in md.splitlines() if line.startswith("| ")]
    assert lines[0].endswith(
        "| role changes | role change s | over-provisioned | carried over | migrations |"
    )
    names = [line.split(" | ")[0].strip("| ") for line in lines[2:]]
    assert names == ["sync", "reflow", "reflow-static", "reflow-no-tail"]  # the table's order
    cells = {n: line.strip("| ").split(" | ") for n, line in zip(names, lines[2:], strict=True)}
    assert all(len(c) == 20 for c in cells.values())  # mode, time and reached, 17 more
    assert cells["reflow"][-5:] == ["3 ± 1.41", "4 ± 1.41", "5 ± 1.41", "12 ± 2.83", "0 ± 0"]
    assert cells["reflow-no-tail"][-5:] == ["1 ± 0", "2.5 ± 0", "0 ± 0", "0 ± 0", "0 ± 0"]
    assert cells["sync"][-5:] == ["0 ± 0"] * 5
    assert plot(results, tmp_path, {"target": 0.2}).stat().st_size > 1000


def test_the_pilot_runs_first_on_an_unmeasured_seed_and_its_targets_are_on_disk_before_the_runs(
    tmp_path, monkeypatch
):
    import argparse
    import json

    from reflow.recipes import bench_modes

    calls = []

    def fake_run(config_path, name, mode, seed, extra, budget_minutes, out_dir, log):
        on_disk = (out_dir / "targets.json").is_file()
        calls.append((name, mode, seed, on_disk, "elastic.enabled=null" in extra))
        return _run(name, seed, [0.2, 0.5, 0.6] if name == "pilot" else [0.2, 0.6, 0.6])

    monkeypatch.setattr(bench_modes, "run_one", fake_run)
    args = argparse.Namespace(
        config="c.yaml", overrides=[], seeds=2, budget_minutes=1.0, target=None, out=str(tmp_path),
        ablations=False, report_only=False,
    )  # fmt: skip
    assert bench_modes.cmd_bench_modes(args) == 0
    assert calls[0] == ("pilot", "sync", 2, False, True)  # seed 2: outside the measured 0 and 1
    assert [c[:3] for c in calls[1:]] == [(m, m, s) for s in (0, 1) for m in ("sync", "async", "reflow")]
    assert all(c[3] for c in calls[1:])  # the targets were written before every measured run
    saved = json.loads((tmp_path / "targets.json").read_text())
    assert saved["targets"] == {"50%": 0.4, "75%": 0.5, "90%": 0.56}
    assert json.loads((tmp_path / "bench_modes.json").read_text())["targets"] == saved["targets"]
    # --target fixes it by hand: no pilot
    calls.clear()
    args.target = 0.45
    assert bench_modes.cmd_bench_modes(args) == 0
    assert "pilot" not in [c[0] for c in calls]
    assert "time to target (s)" in (tmp_path / "bench_modes.md").read_text()
