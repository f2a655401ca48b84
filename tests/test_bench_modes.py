"""The mode benchmark's table: time to target, spread across seeds, reuse and IS columns."""

import pytest

from reflow.recipes.bench_modes import default_target, plot, start_noise, table, variants


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


def test_table_reports_time_to_target_and_spread(tmp_path):
    results = [
        _run("sync", 0, [0.1, 0.2, 0.3, 0.4]),
        _run("sync", 1, [0.1, 0.3, 0.35, 0.4]),
        _run("async", 0, [0.1, 0.35, 0.4, 0.4]),
        _run("async", 1, [0.1, 0.1, 0.1, 0.1]),  # never reaches the target
        _run("reflow", 0, [0.1, 0.4, 0.4, 0.5], reuse={"1": 6, "2": 4}),
        _run("reflow", 1, [0.1, 0.45, 0.5, 0.5], reuse={"0": 3, "1": 6, "2": 4}),
    ]
    # async gains least: (0.3 + 0.0) / 2 = 0.15 over the start 0.1; but it did improve -> 0.1 + 0.9 * 0.15
    assert default_target(results) == 0.235
    md = table(results, target=0.3, budget_minutes=1)
    rows = {line.split(" | ")[0].strip("| "): line for line in md.splitlines() if line.startswith("| ")}
    assert "| 15 ± 7.07 | 2/2 |" in rows["sync"]  # the seeds reach 0.3 at t = 20 and t = 10
    assert "| 10 ± 0 | 1/2 |" in rows["async"]
    assert "| 10 ± 0 | 2/2 |" in rows["reflow"]
    assert "1.4 ± 0" in rows["reflow"]  # mean uses per consumed group: (6*1 + 4*2) / 10
    assert plot(results, tmp_path, 0.3).stat().st_size > 1000


def test_default_target_is_above_the_start_and_its_noise_or_not_measured(tmp_path):
    improved = [_run("sync", 0, [0.2, 0.3, 0.4]), _run("reflow", 0, [0.2, 0.4, 0.6])]
    flat = [_run("async", 0, [0.2, 0.2, 0.1])]
    # a mode that never improved does not pull the target down to the start: 90% of the largest gain
    assert default_target(improved + flat) == 0.56
    assert default_target(improved) == 0.38  # every mode improved: 90% of the smallest gain
    assert default_target(flat) is None  # no gain at all: nothing to time
    md = table(flat, target=None, budget_minutes=1)
    assert md.startswith("No mode improved on the start")
    assert "| async | - | - |" in md
    assert plot(flat, tmp_path, None).stat().st_size > 1000
    # gains of one or two problems in 100 are within the start's standard error (0.04 at 0.2): no target
    small = [_run("sync", 0, [0.2, 0.21, 0.22]), _run("reflow", 0, [0.2, 0.23, 0.23])]
    for r in small:
        r["evals"][0]["episodes"] = 100
    assert start_noise(small) == pytest.approx(0.04)
    assert default_target(small) is None
    for r in small:
        r["evals"][0]["episodes"] = 10_000  # the same gains on 10,000 problems are real (se 0.004)
    assert default_target(small) == 0.218


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
    md = table(results, target=0.2, budget_minutes=1)
    lines = [line for line in md.splitlines() if line.startswith("| ")]
    assert lines[0].endswith(
        "| role changes | role change s | over-provisioned | carried over | migrations |"
    )
    names = [line.split(" | ")[0].strip("| ") for line in lines[2:]]
    assert names == ["sync", "reflow", "reflow-static", "reflow-no-tail"]  # the table's order
    cells = {n: line.strip("| ").split(" | ") for n, line in zip(names, lines[2:], strict=True)}
    assert all(len(c) == 20 for c in cells.values())
    assert cells["reflow"][-5:] == ["3 ± 1.41", "4 ± 1.41", "5 ± 1.41", "12 ± 2.83", "0 ± 0"]
    assert cells["reflow-no-tail"][-5:] == ["1 ± 0", "2.5 ± 0", "0 ± 0", "0 ± 0", "0 ± 0"]
    assert cells["sync"][-5:] == ["0 ± 0"] * 5
    assert plot(results, tmp_path, 0.2).stat().st_size > 1000
