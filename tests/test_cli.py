"""The `reflow` console script, run as a user runs it."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from fake_envs import BUILTIN_ENVS

REFLOW = str(Path(sys.executable).parent / "reflow")


def run(*args, input=None):
    return subprocess.run([REFLOW, *args], capture_output=True, text=True, input=input, timeout=300)


def test_envs_list_shows_the_four_envs():
    out = run("envs", "list")
    assert out.returncode == 0, out.stderr
    for env_id in BUILTIN_ENVS:
        assert env_id in out.stdout
    assert "calculator" in out.stdout and "run_python" in out.stdout


@pytest.mark.slow
def test_envs_check_all_passes():
    out = run("envs", "check", "--all")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "all checks passed" in out.stdout
    assert out.stdout.count("reflow envs check") == 4


def test_envs_check_reports_an_unknown_id_clearly():
    out = run("envs", "check", "reflow/NoSuch-v0")
    assert out.returncode == 2
    assert "no ReFlow env registered as 'reflow/NoSuch-v0'" in out.stdout
    assert "Traceback" not in out.stderr


def test_envs_check_fails_on_a_crashing_env(capsys):
    from reflow.cli import main

    assert main(["envs", "check", "test/Crashy-v0"]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "env_error" in out and "check(s) failed" in out


def test_envs_play_prints_success_and_length_distribution():
    out = run("envs", "play", "reflow/Calc-v0", "--episodes", "50", "--error-rate", "0.1", "--json")
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout.strip().splitlines()[-1])[0]
    assert summary["episodes"] == 50
    assert 0.4 < summary["success_rate"] < 1.0
    assert 1 <= summary["turns_p50"] <= summary["turns_p90"] <= summary["turns_max"] <= 12
    assert "success" in out.stdout and "turns p90" in out.stdout


def test_envs_play_from_stdin():
    moves = '<tool_call>{"name": "calculator", "arguments": {"expression": "6 * 7"}}</tool_call>\nThe answer is \\boxed{42}.\n'
    out = run("envs", "play", "reflow/Calc-v0", "--policy", "stdin", "--episodes", "1", "--json", input=moves)
    assert out.returncode == 0, out.stderr
    assert "tool: 42" in out.stdout
    summary = json.loads(out.stdout.strip().splitlines()[-1])[0]
    assert summary["statuses"] == {"ok": 1} and summary["turns_max"] == 2


def test_envs_play_writes_episode_records(tmp_path):
    path = tmp_path / "episodes.jsonl"
    out = run("envs", "play", "reflow/Guess-v0", "--episodes", "3", "--out", str(path))
    assert out.returncode == 0, out.stderr
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(records) == 3 and all(r["status"] == "ok" and r["messages"] for r in records)
