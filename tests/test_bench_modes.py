"""The mode benchmark: its table (time to target, means with 95% intervals over seeds, new and
trained tokens/s, the paired comparisons with sync and async), the rows (built-in and `--rows`), and
runs stored as they finish so that a re-run with the same --out skips them."""

import argparse
import json

import pytest

from reflow.errors import UsageError
from reflow.recipes.bench_modes import pilot_targets, plot, start_noise, table
from reflow.recipes.bench_rows import parse_rows, select_rows, variants


def _run(mode, seed, successes, dt=10.0, reuse=None, new=None, final=None, mean8=None):
    evals = [{"wall_s": i * dt, "success_rate": s} for i, s in enumerate(successes)]
    steps = [
        {
            "wall_s": i * dt,
            "staleness_mean": 0.5,
            "w_mean": 1.0,
            "w_max": 1.2,
            "masked_frac": 0.0,
            "trained_tokens_per_s": 100.0,
            "new_trained_tokens_per_s": 80.0,
        }
        for i in range(3)
    ]
    summary = {
        "generated_tokens_per_s": 1000.0 + seed,
        "trained_tokens_per_s": 500.0,
        "new_trained_tokens_per_s": 500.0 if new is None else new,
        "rollout_idle_ratio": 0.2,
        "trainer_idle_ratio": 0.4,
        "reuse_hist": reuse or {"1": 10},
        "steps": 30,
    }
    headroom = [] if final is None else [{"when": "final", "greedy_success": final, "tasks": 300}]
    if mean8 is not None:  # the end measurement's mean@8 beside its greedy success
        headroom[0].update(samples_per_task=8, sampled_success=mean8)
    return {
        "mode": mode,
        "seed": seed,
        "evals": evals,
        "steps": steps,
        "summary": summary,
        "headroom": headroom,
    }


def _rows(md, header):
    """{row name: cells} of the Markdown table whose header row starts with `header`."""
    lines = md.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = {}
    for line in lines[start + 2 :]:
        if not line.startswith("| "):
            break
        cells = line.strip("| ").split(" | ")
        rows[cells[0]] = cells
    return lines[start].strip("| ").split(" | "), rows


def test_table_headlines_time_to_target_final_success_and_new_tokens_with_intervals(tmp_path):
    results = [
        _run("sync", 0, [0.1, 0.2, 0.3, 0.4], final=0.40),
        _run("sync", 1, [0.1, 0.3, 0.35, 0.4], final=0.42),
        _run("async", 0, [0.1, 0.35, 0.4, 0.4], final=0.44),
        _run("async", 1, [0.1, 0.1, 0.1, 0.1], final=0.30),  # never reaches a target
        _run("reflow", 0, [0.1, 0.4, 0.4, 0.5], reuse={"1": 6, "2": 4}, new=250.0, final=0.5),
        _run("reflow", 1, [0.1, 0.45, 0.5, 0.5], reuse={"0": 3, "1": 6, "2": 4}, new=1000.0, final=0.52),
    ]
    md = table(results, {"50%": 0.3, "90%": 0.4}, budget_minutes=1)
    assert md.startswith("Targets held-out success, fixed before the runs: 50% 0.300, 90% 0.400")
    assert "Final held-out: greedy on 300 tasks." in md
    header, rows = _rows(md, "| mode | seeds |")
    assert header[:15] == [
        "mode", "seeds", "time to 50% (s)", "reached 50%", "time to 90% (s)", "reached 90%", "final held-out",
        "final greedy", "new tok/s", "trained tok/s (with replays)", "gen tok/s", "engine decode share",
        "engine prefill share", "engine tokens/decode step", "held-out at budget (curve)",
    ]  # fmt: skip
    # sync reaches 0.3 at t = 20 and 10: mean 15, s = 7.07, half-width t(1) 12.706 x 7.07 / sqrt(2) = 63.5
    assert rows["sync"][:7] == ["sync", "2", "15 ± 63.5", "2/2", "30 ± 0", "2/2", "0.41 ± 0.127"]
    assert rows["async"][2:6] == ["10", "1/2", "20", "1/2"]  # one seed reached: a mean, no interval
    assert rows["reflow"][2:10] == [
        "10 ± 0", "2/2", "10 ± 0", "2/2", "0.51 ± 0.127", "0.51 ± 0.127", "625 ± 4765", "500 ± 0"
    ]  # fmt: skip
    assert rows["reflow"][header.index("reuse (mean uses/group)")] == "1.4 ± 0"  # (6*1 + 4*2) / 10
    # against sync, seed by seed
    header, paired = _rows(md, "| mode | seeds paired |")
    assert header == [
        "mode", "seeds paired", "final held-out - sync", "final greedy - sync", "time to 50%: sync / row",
        "time to 90%: sync / row", "new tok/s: row / sync", "trained tok/s (with replays): row / sync",
    ]  # fmt: skip
    # reflow: +0.10 on both seeds; 50%: 20/10 and 10/10 -> geometric mean sqrt(2); 90%: 30/10 twice
    assert paired["reflow"][1:6] == [
        "2",
        "+0.100 [+0.100, +0.100]",
        "+0.100 [+0.100, +0.100]",
        "1.41x [0.02, 115.61] (n=2)",
        "3.00x [3.00, 3.00] (n=2)",
    ]
    # new tok/s 250/500 and 1000/500: geometric mean 1, the interval symmetric on the log scale
    assert paired["reflow"][6].startswith("1.00x [0.00, ")
    assert paired["reflow"][7] == "1.00x [1.00, 1.00]"
    # async seed 1 never reached a target: counted as the 60-s budget and named, not dropped: 50% is
    # sync's 20/10 and 10/60, geometric mean sqrt(2/6)
    assert paired["async"][4].startswith("0.58x [0.00, ")
    assert paired["async"][4].endswith("(n=2, row never reached 1, missed = 60 s)")
    assert plot(results, tmp_path, {"50%": 0.3, "90%": 0.4}).stat().st_size > 1000


def _reaching(mode, seed, at, mean8, greedy):
    """A 3-minute run whose curve (every 10 s) reaches 0.5 at `at` seconds (None: never)."""
    curve = [0.5 if at is not None and t >= at else 0.1 for t in range(0, 190, 10)]
    return _run(mode, seed, curve, final=greedy, mean8=mean8)


def test_the_paired_tables_read_the_bar_mean8_at_the_end_missed_targets_at_the_budget_and_async_too():
    """The replay bar: final difference on mean@8 (greedy beside), a run that never reaches T90 counted
    as the 180-s budget and flagged, speed ratios against sync and against async."""
    results = [
        _reaching("sync", 0, 40, 0.40, 0.50),
        _reaching("sync", 1, 60, 0.42, 0.50),
        _reaching("sync", 2, None, 0.44, 0.50),
        _reaching("async", 0, 20, 0.40, 0.50),
        _reaching("async", 1, 30, 0.40, 0.50),
        _reaching("async", 2, 60, 0.40, 0.50),
        _reaching("reflow", 0, 10, 0.41, 0.52),
        _reaching("reflow", 1, 20, 0.40, 0.48),
        _reaching("reflow", 2, None, 0.46, 0.50),
    ]
    for run in results[6:]:  # the trust region's dropped share, reported beside the row
        for step in run["steps"]:
            step["m2_masked_frac"] = 0.03
    md = table(results, {"T90": 0.5}, budget_minutes=3)
    assert "Final held-out: mean@8 on 300 tasks." in md
    header, rows = _rows(md, "| mode | seeds |")
    assert rows["reflow"][header.index("m2 masked frac")] == "0.03 ± 0"
    assert rows["sync"][header.index("m2 masked frac")] == "-"
    assert rows["reflow"][header.index("final held-out")] == "0.423 ± 0.0799"  # mean@8, not greedy
    assert rows["reflow"][header.index("final greedy")] == "0.5 ± 0.0497"
    header, vs_sync = _rows(md, "| mode | seeds paired | final held-out - sync")
    # mean@8 differences +0.01, -0.02, +0.02: mean +0.0033, s = 0.0208, t(2) 4.3027 x s / sqrt(3) = 0.0517
    assert vs_sync["reflow"][2] == "+0.003 [-0.048, +0.055]"
    assert vs_sync["reflow"][3] == "+0.000 [-0.050, +0.050]"  # greedy: +0.02, -0.02, 0
    # sync / reflow: 40/10, 60/20, and both missed on seed 2: 180/180 -> (4 x 3 x 1)^(1/3) = 2.29
    assert vs_sync["reflow"][4].startswith("2.29x [")
    assert vs_sync["reflow"][4].endswith("(n=3, neither reached 1, missed = 180 s)")
    header, vs_async = _rows(md, "| mode | seeds paired | final held-out - async")
    assert header[4] == "time to T90: async / row"
    assert list(vs_async) == ["sync", "reflow"]
    # async / reflow: 20/10, 30/20 and 60/180 (reflow missed): (2 x 1.5 / 3)^(1/3) = 1.00
    assert vs_async["reflow"][4].startswith("1.00x [")
    assert vs_async["reflow"][4].endswith("(n=3, row never reached 1, missed = 180 s)")
    # without the budget rule the missed seed would be left out: 20/10 and 30/20, 1.73x on n=2
    assert "1.73x" not in vs_async["reflow"][4]


def test_pilot_targets_are_shares_of_the_pilots_gain_at_the_budget_or_none_within_noise(tmp_path):
    # the gain is the last evaluation's (at the budget), not the best one's: 0.2 -> 0.6 (best 0.7)
    pilot = _run("pilot", 3, [0.2, 0.7, 0.6])
    assert pilot_targets(pilot) == {"50%": 0.4, "75%": 0.5, "90%": 0.56}
    assert pilot_targets(pilot, shares=(0.25,)) == {"25%": 0.3}
    assert pilot_targets(_run("pilot", 3, [0.2, 0.3, 0.1])) is None  # ended below its start
    flat = [_run("async", 0, [0.2, 0.2, 0.1])]
    md = table(flat, None, budget_minutes=1)
    assert md.startswith("No target: the pilot did not improve")
    # no target columns: seeds, then the final held-out (the curve's last point without a final measurement)
    assert "| async | 1 | 0.1 | - | 500 | 500 | 1000 |" in md  # no final measurement: no greedy
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
        expected = {
            "reflow": (True, True),
            "sync-tail": (False, True),
            "reflow-static": (False, False),
            "reflow-no-tail": (True, False),
            "reflow-lend": (True, True),
        }
        assert parts == expected.get(name, (False, False)), name


def test_ablation_rows_run_reflow_with_parts_off_and_show_role_changes_and_tail_actions(tmp_path):
    assert [name for name, _, _ in variants(False)] == ["sync", "async", "reflow"]
    rows = variants(True)
    assert [(name, mode) for name, mode, _ in rows[3:]] == [
        ("sync-tail", "sync"),
        ("reflow-static", "reflow"),
        ("reflow-no-tail", "reflow"),
        ("reflow-lend", "reflow"),
    ]
    assert dict((name, extra) for name, _, extra in rows)["reflow-static"] == [
        "elastic.enabled=false",
        "tail.enabled=false",
    ]
    assert dict((name, extra) for name, _, extra in rows)["reflow-no-tail"] == ["tail.enabled=false"]
    assert dict((name, extra) for name, _, extra in rows)["reflow-lend"] == ["elastic.lend=true"]

    def counted(mode, seed, changes, cost, over, carried, lent_s=0.0):
        run = _run(mode, seed, [0.1, 0.3])
        run["summary"].update(
            role_changes=changes,
            role_change_s=cost,
            tail_over_provisioned=over,
            tail_carried_over=carried,
            tail_migrations=0,
            lent_busy_s=lent_s,
            lent_stored_s=lent_s / 2,
            lent_yields=int(lent_s),
            lent_handed_over=3 if lent_s else 0,
            train_slot_idle_ratio=0.25 if lent_s else run["summary"]["trainer_idle_ratio"],
        )
        return run

    results = [
        _run("sync", 0, [0.1, 0.3]),  # a summary from before the counters: shown as 0
        counted("reflow", 0, 2, 3.0, 4, 10),
        counted("reflow", 1, 4, 5.0, 6, 14),
        counted("reflow-static", 0, 0, 0.0, 0, 0),
        counted("reflow-no-tail", 0, 1, 2.5, 0, 0),
        counted("reflow-lend", 0, 0, 0.0, 3, 5, lent_s=12.5),
    ]
    results[-1]["summary"].update(
        engine_decode_share=0.58, engine_prefill_share=0.27, engine_tokens_per_decode_step=45.7
    )
    results[1]["summary"]["malformed_call_share"] = 0.1
    results[2]["summary"]["malformed_call_share"] = 0.3
    md = table(results, {"target": 0.2}, budget_minutes=1)
    header, cells = _rows(md, "| mode | seeds |")
    assert header[-9:] == [
        "role changes", "role change s", "over-provisioned", "carried over", "migrations", "lent s",
        "lent stored s", "lent yields", "lent handed over",
    ]  # fmt: skip
    slot_idle = header.index("train slot idle")
    assert header[slot_idle - 1] == "trainer idle"
    assert list(cells) == ["sync", "reflow", "reflow-static", "reflow-no-tail", "reflow-lend"]  # table order
    assert all(len(c) == len(header) == 34 for c in cells.values())  # mode, seeds, time and reached, 30 more
    # the share of a run's tool calls that did not parse: a mean over seeds, "-" for runs without it
    malformed = header.index("malformed calls")
    assert (cells["reflow"][malformed], cells["sync"][malformed]) == ("0.2 ± 1.27", "-")
    # how the rollout engine spent its time: "-" for a run without the figures
    engine = header.index("engine decode share")
    assert header[engine - 1] == "gen tok/s"
    assert header[engine : engine + 3] == [
        "engine decode share",
        "engine prefill share",
        "engine tokens/decode step",
    ]
    assert cells["reflow-lend"][engine : engine + 3] == ["0.58", "0.27", "45.7"]
    assert cells["reflow"][engine : engine + 3] == ["-", "-", "-"]
    # two seeds: mean ± t(1) s / sqrt(2), with s = 1.41 for 2 and 4: 12.706
    assert cells["reflow"][-9:-4] == ["3 ± 12.7", "4 ± 12.7", "5 ± 12.7", "12 ± 25.4", "0 ± 0"]
    assert cells["reflow-no-tail"][-9:] == ["1", "2.5", "0", "0", "0", "0", "0", "0", "0"]  # one seed
    assert cells["reflow-lend"][-4:] == ["12.5", "6.25", "12", "3"]
    # the train slot's idle share counts the lent engine's stored generation; a run from before it
    # shows its trainer's idle share
    assert cells["reflow-lend"][slot_idle] == "0.25"
    assert cells["sync"][slot_idle] == cells["sync"][slot_idle - 1]
    assert cells["sync"][-9:] == ["0"] * 9
    assert plot(results, tmp_path, {"target": 0.2}).stat().st_size > 1000


def _args(tmp_path, **over):
    config = tmp_path / "c.yaml"
    if not config.exists():
        config.write_text("env:\n  id: reflow/Calc-v0\n")
    values = dict(
        config=str(config), overrides=[], seeds=2, budget_minutes=1.0, target=None, out=str(tmp_path / "out"),
        ablations=False, rows=[], only=[], report_only=False, final_tasks=None,
    )  # fmt: skip
    return argparse.Namespace(**{**values, **over})


def _fake_runs(monkeypatch):
    """run_one replaced by a recorder of its calls: (name, mode, seed, targets on disk, overrides)."""
    from reflow.recipes import bench_modes

    calls = []

    def fake_run(config_path, name, mode, seed, extra, budget_minutes, out_dir, log):
        calls.append((name, mode, seed, (out_dir / "targets.json").is_file(), extra))
        return _run(name, seed, [0.2, 0.5, 0.6] if name == "pilot" else [0.2, 0.6, 0.6], final=0.6)

    monkeypatch.setattr(bench_modes, "run_one", fake_run)
    return calls


def test_the_pilot_runs_first_on_an_unmeasured_seed_and_its_targets_are_on_disk_before_the_runs(
    tmp_path, monkeypatch
):
    from reflow.recipes import bench_modes

    calls = _fake_runs(monkeypatch)
    args = _args(tmp_path)
    assert bench_modes.cmd_bench_modes(args) == 0
    assert calls[0][:4] == ("pilot", "sync", 2, False)  # seed 2: outside the measured 0 and 1
    assert "elastic.enabled=null" in calls[0][4]
    assert [c[:3] for c in calls[1:]] == [(m, m, s) for s in (0, 1) for m in ("sync", "async", "reflow")]
    assert all(c[3] for c in calls[1:])  # the targets were written before every measured run
    out = tmp_path / "out"
    saved = json.loads((out / "targets.json").read_text())
    assert saved["targets"] == {"50%": 0.4, "75%": 0.5, "90%": 0.56}
    assert json.loads((out / "bench_modes.json").read_text())["targets"] == saved["targets"]
    # --target fixes it by hand: no pilot, and the stored runs are reused
    calls.clear()
    args.target = 0.45
    assert bench_modes.cmd_bench_modes(args) == 0
    assert calls == []
    assert "time to target (s)" in (out / "bench_modes.md").read_text()


def test_only_runs_the_rows_named_and_the_table_keeps_every_run_stored(tmp_path, monkeypatch):
    from reflow.recipes import bench_modes

    calls = _fake_runs(monkeypatch)
    assert bench_modes.cmd_bench_modes(_args(tmp_path, seeds=1, target=0.5, only=["sync", "reflow"])) == 0
    assert [c[:3] for c in calls] == [("sync", "sync", 0), ("reflow", "reflow", 0)]
    calls.clear()  # a later call for another row: only it runs; the report holds all three
    assert bench_modes.cmd_bench_modes(_args(tmp_path, seeds=1, target=0.5, only=["async"])) == 0
    assert [c[:3] for c in calls] == [("async", "async", 0)]
    report = json.loads((tmp_path / "out" / "bench_modes.json").read_text())
    assert [r["mode"] for r in report["results"]] == ["sync", "async", "reflow"]


def test_every_run_gets_a_final_evaluation_on_at_least_300_held_out_tasks(tmp_path, monkeypatch):
    from reflow.recipes import bench_modes

    calls = _fake_runs(monkeypatch)
    assert (
        bench_modes.cmd_bench_modes(_args(tmp_path, seeds=1, target=0.5, overrides=["eval.pass_at=0"])) == 0
    )
    for *_, extra in calls:  # after the command line's; no eval.every_s given: the wall-clock grid
        assert extra[-4:] == ["eval.pass_at=1", "eval.end_episodes=300", "eval.every=0", "eval.every_s=30"]
    calls.clear()  # a config's own larger measurement and its own grid are kept
    args = _args(tmp_path, seeds=1, target=0.5, out=str(tmp_path / "o2"))
    args.overrides = ["eval.pass_at=8", "eval.end_episodes=500", "eval.every_s=20"]
    assert bench_modes.cmd_bench_modes(args) == 0
    assert all(c[4][-2:] == ["eval.pass_at=8", "eval.end_episodes=500"] for c in calls)
    calls.clear()  # --final-tasks sets the measurement's tasks (a long-episode testbed), the config's too
    args = _args(tmp_path, seeds=1, target=0.5, out=str(tmp_path / "o4"), final_tasks=100)
    assert bench_modes.cmd_bench_modes(args) == 0
    assert calls and all(c[4][-3] == "eval.end_episodes=100" for c in calls)
    args.overrides, args.out = ["eval.end_episodes=150"], str(tmp_path / "o5")
    calls.clear()
    assert bench_modes.cmd_bench_modes(args) == 0
    assert calls and all(c[4][-3] == "eval.end_episodes=100" for c in calls)  # given: it decides
    with pytest.raises(UsageError, match=r"--final-tasks 0: at least one task"):
        bench_modes.cmd_bench_modes(_args(tmp_path, final_tasks=0, out=str(tmp_path / "o6")))
    with pytest.raises(UsageError, match=r"eval\.episodes must be > 0"):
        bench_modes.cmd_bench_modes(_args(tmp_path, overrides=["eval.episodes=0"], out=str(tmp_path / "o3")))


def test_rows_from_the_command_line_parse_with_their_mode_and_bad_ones_are_named():
    rows = parse_rows(
        [
            "k3=replay.max_reuse=3",
            "a2=mode=async,replay.eta=2",
            "split=resources.slots=[rollout,rollout,train]",
        ]
    )
    assert rows == [
        ("k3", "reflow", ["replay.max_reuse=3"]),  # reflow by default
        ("a2", "async", ["elastic.enabled=null", "tail.enabled=null", "replay.eta=2"]),  # plain, as built-in
        ("split", "reflow", ["resources.slots=[rollout,rollout,train]"]),  # a comma inside a value stays
    ]
    assert [n for n, _, _ in variants(False, rows)] == ["sync", "async", "reflow", "k3", "a2", "split"]
    for bad, message in (
        ("nokeys", "expected NAME=KEY=VALUE"),
        ("eval.episodes=50", "expected NAME=KEY=VALUE"),  # an override given after --rows
        ("bad name=x=1", "expected NAME=KEY=VALUE"),
        ("x=mode=fast", "mode 'fast' is not one of"),
        ("reflow=replay.eta=2", "the row name 'reflow' is taken"),
        ("pilot=replay.eta=2", "is taken"),
    ):
        with pytest.raises(UsageError, match=message) as e:
            parse_rows([bad])
        assert repr(bad) in str(e.value)
    with pytest.raises(UsageError, match="'k3' is taken"):
        parse_rows(["k3=replay.eta=1", "k3=replay.eta=2"])


def test_only_selects_rows_in_the_tables_order_and_names_an_unknown_one():
    rows = variants(True, parse_rows(["k3=replay.max_reuse=3"]))
    picked = select_rows(rows, ["reflow-lend", "k3", "sync"])
    assert [n for n, _, _ in picked] == ["sync", "reflow-lend", "k3"]
    assert picked[1] == ("reflow-lend", "reflow", ["elastic.lend=true"])
    assert select_rows(rows, []) == rows
    with pytest.raises(UsageError, match=r"--only reflow-fast: not a row of this command \(rows: sync,"):
        select_rows(rows, ["sync", "reflow-fast"])
    with pytest.raises(UsageError, match="overrides for every row go before --only"):
        select_rows(rows, ["sync", "eval.episodes=50"])


def test_a_bad_row_is_a_one_line_cli_error_naming_it(tmp_path, capsys):
    from reflow.cli import main

    argv = ["bench", "modes", "--config", str(tmp_path / "c.yaml"), "--out", str(tmp_path / "o")]
    assert main([*argv, "--rows", "ok=replay.eta=2", "oops=eta2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'oops=eta2'" in err and "NAME=KEY=VALUE" in err
    assert not (tmp_path / "o").exists()  # nothing ran, nothing written


def test_a_rerun_with_the_same_out_skips_the_runs_done_and_refuses_a_changed_row(tmp_path, monkeypatch):
    from reflow.recipes import bench_modes

    calls = _fake_runs(monkeypatch)
    out = tmp_path / "out"
    args = _args(tmp_path, rows=["k3=replay.max_reuse=3"])
    assert bench_modes.cmd_bench_modes(args) == 0
    assert len(calls) == 1 + 2 * 4  # the pilot, then four rows on two seeds
    stored = sorted(p.name for p in (out / "runs").glob("*"))
    assert stored == sorted(
        [
            "pilot-seed2.json",
            *(f"{row}-seed{s}.json" for row in ("sync", "async", "reflow", "k3") for s in (0, 1)),
        ]
    )
    saved = json.loads((out / "runs" / "k3-seed1.json").read_text())
    assert saved["spec"]["mode"] == "reflow" and "replay.max_reuse=3" in saved["spec"]["overrides"]
    # a second call runs nothing; with a run missing (killed before it finished) it runs only that one
    calls.clear()
    assert bench_modes.cmd_bench_modes(args) == 0
    assert calls == []
    (out / "runs" / "async-seed1.json").unlink()
    assert bench_modes.cmd_bench_modes(args) == 0
    assert [c[:3] for c in calls] == [("async", "async", 1)]
    # a new row runs alone; the rest, pilot included, is reused
    calls.clear()
    args.rows = ["k3=replay.max_reuse=3", "k4=replay.max_reuse=4"]
    assert bench_modes.cmd_bench_modes(args) == 0
    assert [c[:3] for c in calls] == [("k4", "reflow", 0), ("k4", "reflow", 1)]
    # a row run with other overrides is refused before anything runs, naming the run and what differs
    calls.clear()
    args.rows = ["k3=replay.max_reuse=2"]
    with pytest.raises(UsageError) as e:
        bench_modes.cmd_bench_modes(args)
    assert "k3-seed0.json was run with overrides ['replay.max_reuse=3']" in str(e.value)
    assert "['replay.max_reuse=2']" in str(e.value) and calls == []
    # so is a changed config file or budget
    args.rows = []
    (tmp_path / "c.yaml").write_text("env:\n  id: reflow/Calc-v0\nseed: 1\n")
    with pytest.raises(UsageError, match=r"pilot-seed2\.json was run with config_sha256"):
        bench_modes.cmd_bench_modes(args)
    assert calls == []
    # a half-written result never exists (written whole, then renamed); a foreign file is named
    (out / "runs" / "sync-seed0.json").write_text("{")
    (tmp_path / "c.yaml").write_text("env:\n  id: reflow/Calc-v0\n")
    with pytest.raises(UsageError, match=r"sync-seed0\.json is not a benchmark result"):
        bench_modes.cmd_bench_modes(args)


def test_report_only_rebuilds_the_table_from_the_runs_stored_so_far(tmp_path, monkeypatch):
    from reflow.recipes import bench_modes

    _fake_runs(monkeypatch)
    args = _args(tmp_path, seeds=1)
    assert bench_modes.cmd_bench_modes(args) == 0
    (tmp_path / "out" / "bench_modes.json").unlink()  # as if the benchmark had been stopped
    (tmp_path / "out" / "runs" / "reflow-seed0.json").unlink()
    assert bench_modes.cmd_bench_modes(_args(tmp_path, report_only=True)) == 0
    _, rows = _rows((tmp_path / "out" / "bench_modes.md").read_text(), "| mode | seeds |")
    assert list(rows) == ["sync", "async"]
    # the runs alone (copied from an archive, no targets.json): the stored pilot's targets again
    for name in ("targets.json", "bench_modes.json"):
        (tmp_path / "out" / name).unlink()
    assert bench_modes.cmd_bench_modes(_args(tmp_path, report_only=True)) == 0
    assert json.loads((tmp_path / "out" / "bench_modes.json").read_text())["targets"] == {
        "50%": 0.4,
        "75%": 0.5,
        "90%": 0.56,
    }
    with pytest.raises(UsageError, match="no stored runs"):
        bench_modes.cmd_bench_modes(_args(tmp_path, report_only=True, out=str(tmp_path / "empty")))


def test_only_the_pilot_measures_the_warm_starts_pass_at_k_at_the_start(tmp_path, monkeypatch):
    """Every run starts from one cached warm start: the start measurement (minutes a run) is the pilot's,
    each run keeps its own final one."""
    import reflow.recipes.agent_train as agent_train
    import reflow.recipes.run_log as run_log
    from reflow.recipes import bench_modes

    seen = {}
    monkeypatch.setattr(agent_train, "train", lambda config: seen.update(config=config) or {})
    monkeypatch.setattr(run_log, "read_metrics", lambda run_dir, kind: [])
    for name, mode, expected in (
        ("pilot", "sync", True),
        ("sync", "sync", False),
        ("reflow", "reflow", False),
    ):
        bench_modes.run_one(
            "configs/calc-short.yaml", name, mode, 0, ["eval.pass_at=8"], 3.0, tmp_path, print
        )
        ev = seen["config"].eval
        assert ev.pass_at == 8 and ev.pass_at_start is expected, name
