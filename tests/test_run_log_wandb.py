"""The W&B sink of a run's log (`log.wandb:`), in W&B's offline mode with every W&B folder inside the
test's tmp_path: the records metrics.jsonl gets (warmstart, step, eval, summary) are in the offline run
under the same keys and values, read back from its `.wandb` transaction log with wandb's own protobuf
record type. Off by default; a missing wandb package is one error line naming the key."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from wandb_helpers import offline_wandb, read_offline_runs

from reflow.config import load_config
from reflow.errors import ConfigError
from reflow.recipes.run_log import RunLog, read_metrics
from reflow.recipes.sinks import log_sinks


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
    return offline_wandb(tmp_path, monkeypatch)


def run_config(tmp_path: Path, *overrides: str):
    return load_config(None, ["env.id=reflow/Calc-v0", f"out_dir={tmp_path}", "run_name=r", *overrides])


WARMSTART = {"sft_steps": 12, "loss": 0.75, "model": "runs/r/warmstart", "cached": False}
STEPS = [
    {"step": 1, "version": 1, "reward_mean": 0.25, "success_rate": 0.5, "status_ok": 8, "entropy": None},
    {"step": 2, "version": 2, "reward_mean": 0.5, "success_rate": 0.625, "status_ok": 8, "entropy": 1.5},
]
EVAL = {"step": 2, "version": 2, "success_rate": 0.375, "episodes": 8, "wall_s": 3.5, "temperature": 0.0}
SUMMARY = {
    "run": "runs/r",
    "steps": 2,
    "heldout_success_final": 0.375,
    "heldout_success_start": None,
    "staleness_hist": {"0": 16},
    "reuse_hist": {1: 16},  # int keys, as run_summary has them: metrics.jsonl and W&B get strings
}


def test_the_wandb_run_gets_every_record_under_the_keys_metrics_jsonl_has(tmp_path, wandb_offline):
    config = run_config(tmp_path, "log.wandb.mode=offline", "log.wandb.tags=[smoke]", "log.wandb.group=g")
    log = RunLog(config.run_dir, live=False, sinks=log_sinks(config))
    log.write("warmstart", WARMSTART)
    for record in STEPS:
        log.step(record)
    log.eval(EVAL)
    log.write("summary", SUMMARY)
    log.close()

    (run,) = read_offline_runs(config.run_dir)
    assert (run["run"].project, run["run"].display_name, run["run"].run_group) == ("reflow", "r", "g")
    assert list(run["run"].tags) == ["smoke"]
    assert run["config"]["env"]["id"] == "reflow/Calc-v0"  # the run config, as W&B's config
    assert run["config"]["log"]["wandb"]["mode"] == "offline"
    rows = read_metrics(config.run_dir)
    assert [r["kind"] for r in rows] == ["warmstart", "step", "step", "eval", "summary"]
    logged = [row for row in rows if row["kind"] != "summary"]
    assert len(run["history"]) == len(logged)
    for row, history in zip(logged, run["history"], strict=True):
        want = {f"{row['kind']}/{k}": v for k, v in row.items() if k not in ("kind", "time")}
        assert {k: v for k, v in history.items() if not k.startswith("_")} == want
    summary = {k: v for k, v in rows[-1].items() if k not in ("kind", "time")}
    assert summary["reuse_hist"] == {"1": 16}
    assert {k: run["summary"][k] for k in summary} == summary
    # step records and evaluations are plotted against the train step
    assert run["metrics"] == {"step/*": "step/step", "eval/*": "eval/step"}
    assert run["exit_code"] == 0


def test_a_resumed_run_goes_on_in_the_same_wandb_run_and_a_crash_shows(tmp_path, wandb_offline):
    config = run_config(tmp_path, "log.wandb.project=reflow-tests")
    first = RunLog(config.run_dir, live=False, sinks=log_sinks(config))
    first.step(STEPS[0])
    first.close(exit_code=1)
    second = RunLog(config.run_dir, live=False, sinks=log_sinks(config))
    second.step(STEPS[1])
    second.close()

    crashed, resumed = read_offline_runs(config.run_dir)
    assert (
        crashed["run"].run_id
        == resumed["run"].run_id
        == (config.run_dir / "wandb-run-id").read_text().strip()
    )
    assert resumed["run"].project == "reflow-tests"
    assert (crashed["exit_code"], resumed["exit_code"]) == (1, 0)
    assert [h["step/step"] for h in crashed["history"] + resumed["history"]] == [1, 2]


def test_wandb_is_off_by_default_and_its_keys_are_checked():
    config = load_config(None, ["env.id=reflow/Calc-v0"])
    assert config.log.wandb is None and log_sinks(config) == []
    assert load_config(None, ["env.id=reflow/Calc-v0", "log.wandb.project=p"]).log.wandb.project == "p"
    for override, message in (
        ("log.wandb.mode=online-ish", r"log\.wandb\.mode: Input should be 'online', 'offline' or 'disabled'"),
        ("log.wandb.projekt=p", r"log\.wandb\.projekt: unknown key"),
        ("log.wandb.project=' '", r"log\.wandb: .*project must not be empty"),
        ("log.wandb.tags=tag", r"log\.wandb\.tags: Input should be a valid list"),
    ):
        with pytest.raises(ConfigError, match=message):
            load_config(None, ["env.id=reflow/Calc-v0", override])


def test_a_missing_wandb_package_is_one_error_line_naming_the_key(tmp_path, monkeypatch, capsys):
    from reflow import cli

    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    config = run_config(tmp_path, "log.wandb.project=p")
    with pytest.raises(ConfigError, match=r"^log\.wandb is set but the wandb package is not installed"):
        log_sinks(config)
    # the command says so before Ray starts, in one line, exit code 2
    import reflow.runtime.cluster

    def no_ray(config):
        raise AssertionError("Ray started before the missing package was reported")

    monkeypatch.setattr(reflow.runtime.cluster, "start_ray", no_ray)
    args = [
        "agent-train",
        "env.id=reflow/Calc-v0",
        f"out_dir={tmp_path}",
        "run_name=cli",
        "log.wandb.project=p",
    ]
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "log.wandb" in err and "pip install 'reflow-rl[wandb]'" in err


def test_an_online_run_without_a_wandb_login_is_an_error_naming_the_key(tmp_path, wandb_offline, monkeypatch):
    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.netrc login either
    monkeypatch.setenv("NETRC", str(tmp_path / "home" / ".netrc"))
    config = run_config(tmp_path, "log.wandb.mode=online")
    with pytest.raises(
        ConfigError, match=r"^log\.wandb: W&B could not start the run: .*log\.wandb\.mode=offline"
    ):
        log_sinks(config)
